"""``nvcontainer dra-driver``: the kubelet's Dynamic Resource Allocation plugin for this node's
GPUs, under NVIDIA's driver name (``gpu.nvidia.com``), so claims written for NVIDIA's
k8s-dra-driver-gpu work unchanged.

The kubelet side (registration through the plugin watcher, NodePrepareResources and
NodeUnprepareResources, a transient CDI spec per claim, the checkpoint) and the API server side
(ResourceSlices from the inventory, the claims' allocations) share the inventory every other
command uses. ``registration/``, ``v1/`` and ``v1beta1/`` hold the kubelet's published
``.proto`` files and the modules grpcio-tools generated from them.
"""
