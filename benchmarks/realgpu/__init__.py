"""What nvcontainer does on a node with a real NVIDIA GPU and driver, beside NVIDIA's own tools.

The tests and ``python -m benchmarks`` run on the fake GPU machine (``tests/fixtures/fakegpu``):
a mock NVML and real ELF files laid out as a driver install. This module is the check that the
fake machine stands for a real one: run as root on a GPU node (``benchmarks/realgpu.sh`` sets it
up on a bare machine), it records, into one JSON file and one text report,

* the node: GPU, driver, kernel, cgroup hierarchy, where the driver's files are;
* ``info``, ``info --csv`` and ``list`` of ours beside NVIDIA's ``nvidia-container-cli`` 1.17.0
  (the anchors' build), output compared line by line;
* ``configure --pid`` into a fresh mount and PID namespace, ours and NVIDIA's cli each into its
  own, with what each mounted and created, and ``nvidia-smi -L`` and a CUDA program (a kernel
  launched, its result copied back and checked) run chrooted in each;
* real ``runc run`` starts with each prestart registration (our in-process hook, our served
  path with the native client, NVIDIA's hook with its cli): the container runs nvidia-smi and
  the CUDA program behind runc's deny-by-default device cgroup, so a GPU that works inside
  proves the cgroup step too; a container that asks for no GPU gets nothing;
* start latency, interleaved rounds of ``runc run`` of ``true`` with every registration and
  without a hook, as ``python -m benchmarks`` times them on the fake machine, with CPU per
  start (runc's children, plus the server's whole tree for the served arms); and 32 starts at
  once per registration, the p95 each adds over the no-hook arm's; from these two steps, issue
  27's targets 1 to 3 with a real node's limits, against NVIDIA's arm of the same run
  (``benchmarks/targets.py``, the table ``python -m benchmarks`` ends with on the fake machine);
* the engines' path (``benchmarks/realgpu/engines.py``, issue 33): a GPU container's start
  through containerd's CRI, through ``ctr run`` (containerd's runc shim executing the runtime's
  binary, as dockerd does) and through dockerd where ``TOOLS/engines`` carries it, ours beside
  NVIDIA's runtime and plain runc, interleaved;
* the Kubernetes side (``benchmarks/realgpu/k8s.py``): two containers at once on GPU 0's MPS
  replicas (``nvcontainer mps-daemon`` and what the device plugin's Allocate hands out), the
  real GPU's DRA ResourceSlice and one claim prepared by ``nvcontainer dra-driver`` and run
  through its CDI spec, and a running container as ``nvcontainer ps --json`` shows it.

Nothing here changes the GPU's settings (no persistence mode, no clocks, no MIG): the node is
only read, and the namespaces, cgroups and runc state it makes are removed at the end.
"""
