"""MPS sharing decided: which GPUs get a control daemon, where its files are, what it is told,
what a container is given, and whether a daemon's marker says it is ready. Pure.

Why one module for the daemon's side and the plugin's side: ``nvcontainer mps-daemon`` and
``nvcontainer device-plugin`` run in different containers, from the same ``[device-plugin]``
table, and must agree on every path and every limit; both compute them here from the same
inventory and settings, so they cannot drift apart.

What NVIDIA's plugin does, and where this differs:

* ``sharing = "mps"`` with ``replicas = N`` (N > 1): each GPU advertised N times (IDs and
  resource names as under time-slicing), each client limited to ``100/N`` percent of the GPU's
  threads (``set_default_active_thread_percentage``) and ``memory/N`` of its memory
  (``set_default_device_pinned_mem_limit``), rounded down to whole MiB as upstream does; a
  ``replicas`` that does not divide the memory leaves the remainder unused, said in one line;
* MIG devices cannot be shared with MPS: refused with one line, as upstream;
* more replicas than an MPS server takes clients (48 from compute capability 7.0, 16 before) is
  refused, as upstream;
* one control daemon per GPU (upstream: one per resource), started with ``CUDA_VISIBLE_DEVICES``
  naming that GPU, so a daemon that dies takes only its own GPU's replicas out of service;
* the limits are also handed to each container as ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (upstream only sets the daemon's defaults): a client
  may lower its own limits but the daemon's defaults hold for one that unsets them.

Layout under ``mps-root`` (the same path in both containers and on the host)::

    <mps-root>/<resource>/<GPU uuid>/pipe/          CUDA_MPS_PIPE_DIRECTORY (holds ``control``)
    <mps-root>/<resource>/<GPU uuid>/log/           CUDA_MPS_LOG_DIRECTORY
    <mps-root>/<resource>/<GPU uuid>/shm/           this daemon's /dev/shm and its clients' (1777)

Why a /dev/shm per daemon (NVIDIA shares one ``<mps-root>/shm`` among every daemon and every
client on the node): pods of different tenants on different GPUs would see each other's shared
memory. The daemon is started in a mount namespace of its own with its ``shm/`` bound on
/dev/shm (:class:`~nvcontainer.mps.control.Control`), and only its GPU's clients get it.
    <mps-root>/<resource>/<GPU uuid>/.ready         the daemon's marker, written once it is set up
"""

from __future__ import annotations

import json

from ..errors import NvcError, escape
from ..mps.control import (BINARY as CONTROL_BINARY, CONTROL, MEMORY_ENV, PIPE_ENV, PROBE, QUIT,  # noqa: F401
                                  Paths, THREADS_ENV, daemon_env as _daemon_env)
from ..records import record
from .devices import Resource
from .settings import Settings

CONTAINER_ROOT = "/mps"          # where a container sees its GPU's pipe directory (as upstream)
CONTAINER_SHM = "/dev/shm"
READY = ".ready"
SHM = "shm"
MARKER_LIMIT = 4096


@record
class Share(Paths):
    """One GPU shared by MPS: its daemon's directories and the limits its clients get."""

    resource: str             # the advertised resource (nvidia.com/gpu, nvidia.com/gpu.shared)
    uuid: str
    index: int
    replicas: int
    threads: int              # percent of the GPU's threads per client
    memory_mib: int           # pinned device memory per client, MiB; 0: no limit (unknown size)
    total_mib: int
    directory: str            # <mps-root>/<resource>/<uuid>

    @property
    def ready(self) -> str:
        return f"{self.directory}/{READY}"

    @property
    def name(self) -> str:
        return f"GPU {self.index} ({self.uuid})"


def enabled(settings: Settings) -> bool:
    """MPS is on when asked for with more than one replica (one replica shares nothing)."""
    return settings.sharing == "mps" and settings.replicas > 1


def max_clients(arch: str) -> int:
    """How many clients one MPS server takes: 48 from compute capability 7.0 (Volta), 16 before."""
    major, _, _ = arch.partition(".")
    return 48 if major.isdigit() and int(major) >= 7 else 16


def shares(resources: tuple[Resource, ...], settings: Settings) -> tuple[Share, ...]:
    """The GPUs the advertised ``resources`` share by MPS, or an :class:`NvcError` naming the
    first thing MPS cannot do (MIG devices, more replicas than clients)."""
    if not enabled(settings):
        return ()
    out: dict[str, Share] = {}
    for resource in resources:
        for d in resource.devices:
            unit = d.unit
            if unit.mig is not None or unit.gpu.mig_enabled:
                what = f"MIG device {unit.index}" if unit.mig else f"GPU {unit.index}, which has MIG enabled,"
                raise NvcError("config", f"device-plugin.sharing = \"mps\": {what} ({escape(unit.uuid, 80)}) "
                                         "cannot be shared with MPS (as with NVIDIA's plugin); use time-slicing, "
                                         "or disable MIG on GPU " + str(unit.gpu.index))
            gpu = unit.gpu
            if gpu.uuid in out:
                continue
            limit = max_clients(gpu.arch)
            if settings.replicas > limit:
                raise NvcError("config", f"device-plugin.replicas = {settings.replicas}: an MPS server on GPU "
                                         f"{gpu.index} (compute capability {escape(gpu.arch, 20)}) takes at "
                                         f"most {limit} clients")
            out[gpu.uuid] = Share(
                resource=resource.name, uuid=gpu.uuid, index=gpu.index, replicas=settings.replicas,
                threads=100 // settings.replicas, memory_mib=(gpu.memory >> 20) // settings.replicas,
                total_mib=gpu.memory >> 20, directory=f"{settings.mps_root}/{resource.name}/{gpu.uuid}")
    return tuple(out.values())


def rounding(share: Share) -> str:
    """One line when ``replicas`` does not divide the memory (or the size is unknown); '' else."""
    if share.total_mib == 0:
        return f"{share.name}: NVML gave no memory size; clients get no pinned memory limit"
    left = share.total_mib - share.memory_mib * share.replicas
    if not left:
        return ""
    return (f"{share.name}: {share.total_mib} MiB do not divide into {share.replicas} replicas; each "
            f"client may pin {share.memory_mib} MiB (rounded down, {left} MiB unused)")


def commands(share: Share) -> tuple[str, ...]:
    """What the control daemon is told once started (upstream's order: memory, then threads).
    The GPU is device 0 to the daemon: its CUDA_VISIBLE_DEVICES names only that GPU."""
    out = []
    if share.memory_mib:
        out.append(f"set_default_device_pinned_mem_limit 0 {share.memory_mib}M")
    out.append(f"set_default_active_thread_percentage {share.threads}")
    return tuple(out)


def daemon_env(share: Share) -> dict[str, str]:
    """The control daemon's whole environment: nothing inherited."""
    return _daemon_env(share.directory, share.uuid)


def client_pipe(share: Share) -> str:
    return f"{CONTAINER_ROOT}/{share.resource}/pipe"


def client_env(share: Share) -> dict[str, str]:
    """What a container given a replica of ``share``'s GPU is told."""
    env = {PIPE_ENV: client_pipe(share), THREADS_ENV: str(share.threads)}
    if share.memory_mib:
        env[MEMORY_ENV] = f"0={share.memory_mib}M"
    return env


def client_mounts(share: Share, mps_root: str) -> tuple[tuple[str, str], ...]:
    """(container path, host path) of each mount a container gets: its GPU's pipe directory
    and its GPU's daemon's own /dev/shm."""
    return ((client_pipe(share), share.pipe), (CONTAINER_SHM, share.shm))


def marker(share: Share) -> str:
    """What ``.ready`` holds: the settings the daemon was started with, so a plugin configured
    differently does not advertise replicas the daemon does not serve."""
    return json.dumps({"uuid": share.uuid, "replicas": share.replicas, "threads": share.threads,
                       "memory_mib": share.memory_mib}, sort_keys=True) + "\n"


def not_ready(share: Share, marker_text: str | None, control_is_pipe: bool) -> str:
    """Why ``share``'s replicas are unhealthy, or '' when the daemon is up and set up as we are."""
    if marker_text is None:
        return "its MPS daemon is not ready (no marker)"
    if not control_is_pipe:
        return "its MPS daemon's control pipe is missing"
    try:
        seen = json.loads(marker_text)
    except ValueError:
        return "its MPS daemon's marker is not JSON"
    if not isinstance(seen, dict) or seen != json.loads(marker(share)):
        return "its MPS daemon was set up with other limits (" + escape(marker_text.strip(), 120) + ")"
    return ""
