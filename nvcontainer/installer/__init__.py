"""``nvcontainer install``: the node stack put on a node from its image, as NVIDIA's toolkit
installer (``nvidia-ctk-installer``) does from the GPU Operator's DaemonSet."""
