"""nvcontainer: put a host's NVIDIA driver and selected GPUs into a container as it starts."""

__version__ = "0.1.0"
