"""GPU leases: which container holds which GPUs on a shared node (issue 26)."""
