"""Node labels for Kubernetes, as NVIDIA's GPU Feature Discovery publishes them, from the inventory."""
