"""``nvcontainer setup``: what each container engine needs to reach the GPUs, installed with a
backup and a diff."""
