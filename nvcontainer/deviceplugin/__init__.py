"""``nvcontainer device-plugin``: the kubelet's Device Plugin API (v1beta1) from the one inventory.

The kubelet only schedules GPUs a device plugin advertises. This package is that plugin, built
on the inventory ``list``, the hook and ``cdi generate`` use, so the three can never disagree
about which GPUs a node has. Functional core, imperative shell:

=================  ====  =====================================================================
module             pure  role
=================  ====  =====================================================================
settings           yes   the config file's ``[device-plugin]`` table, checked
devices            yes   inventory + settings → resources and the device IDs they advertise
allocate           yes   request IDs + table + strategy → a container's response
preferred          yes   GetPreferredAllocation over the topology
health             yes   the watcher's reports → which devices are unhealthy
topology           no    NUMA nodes from sysfs; the watcher's NVLink/PCIe report, in indexes
state              no    the device table, health and topology while the plugin runs
service            no    the DevicePlugin gRPC service: protobuf in and out, nothing decided
sockets            no    our sockets in the kubelet's directory, safely
agent              no    servers, registration, kubelet restarts, signals
monitor            no    runs the health watcher child, heartbeat and backoff
watcher            no    the child program: NVML events, probes and topology
report             no    one stderr line per change of state
command            no    the ``device-plugin`` command
v1beta1/           -     api.proto and the modules grpcio-tools generated from it
=================  ====  =====================================================================
"""
