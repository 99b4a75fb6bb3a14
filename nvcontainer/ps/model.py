"""The facts ``nvcontainer ps`` assembles: running containers, GPU processes, leases.

Plain records read by :mod:`.scan` and :mod:`.ocistate` from the host and by the inventory's
NVML child; :mod:`.assemble` turns them into the per-GPU view without touching the host, so the
whole view can be tested on made-up facts.
"""

from __future__ import annotations

from ..records import record


@record
class Container:
    pid: int                            # its init process, as this host's procfs numbers it
    start: int | None = None            # its init's start time (clock ticks since boot)
    cgroup: str = ""                    # its device cgroup's directory ("" unknown)
    pidns: str = ""                     # readlink of /proc/PID/ns/pid, e.g. pid:[4026532201]
    id: str = ""                        # the engine's container ID (cgroup path or OCI state)
    name: str = ""                      # the engine's name for it, where its state says
    engine: str = ""                    # docker, podman, containerd, cri-o, kubernetes, runc, crun
    command: str = ""                   # its init's command line (bounded, escaped), where no engine names it
    cgroup_minors: tuple[int, ...] = ()   # GPU minors its device cgroup allows by exact rule
    cgroup_all: bool = False              # its device cgroup allows the whole major (privileged)
    mount_minors: tuple[int, ...] = ()    # /dev/nvidiaN mounted in its mount namespace


@record
class Process:
    """A process NVML reports on a GPU, with where it lives."""
    pid: int
    gpu: str                            # the GPU's UUID
    memory: int | None = None           # bytes, None where the driver does not say
    kinds: tuple[str, ...] = ()         # compute, graphics
    sm: int | None = None               # SM utilisation in percent, None when not sampled
    cgroup: str = ""                    # its device cgroup's directory
    pidns: str = ""
    command: str = ""                   # /proc/PID/comm


@record
class Lease:
    """A lease as ``ps`` and ``doctor`` see it: who holds which GPUs, and whether it still runs."""
    container: str                      # the container ID the lease names
    pid: int                            # its init process
    gpus: tuple[str, ...]               # GPU UUIDs
    alive: bool = True                  # that init still runs (same pid, same start time)
    start: int | None = None
