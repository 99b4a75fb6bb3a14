"""A claim's MPS control daemon: what it sees and is told, what the claim's containers are
given to reach it, and its start and stop (by :class:`~nvcontainer.kubelet.mpscontrol.Control`).

Why one daemon per claim, as NVIDIA's driver: the pods sharing a claim are the daemon's clients,
and nobody else's; the limits are the claim's opaque configuration, so two claims on one GPU
with different limits each get their own. The daemon sees exactly the claim's devices
(``CUDA_VISIBLE_DEVICES`` = their UUIDs, in the claim's order, so a per-device limit's index
is the daemon's device number) and its directory is the plugin's own::

    <plugins>/gpu.nvidia.com/mps/<claim UID>/pipe/   CUDA_MPS_PIPE_DIRECTORY (``control``)
    <plugins>/gpu.nvidia.com/mps/<claim UID>/log/    CUDA_MPS_LOG_DIRECTORY

The claim's CDI spec mounts ``pipe/`` at ``/tmp/nvidia-mps`` (CUDA's default pipe directory, in
place of the host's own that the driver's files bring) and sets ``CUDA_MPS_PIPE_DIRECTORY`` there, with the limits also as the clients' own
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` / ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (as the device
plugin's MPS does: a client may lower them; the daemon's defaults hold for one that unsets
them). Everything here is decided from the claim's record (its devices' UUIDs and sharing
settings), so a repeated prepare after a restart decides the same from the checkpoint.
"""

from __future__ import annotations

import os

from ..cdi.generate import BIND_OPTIONS
from ..cdi.spec import Mount, Spec
from ..errors import NvcError, escape
from ..kubelet import mpscontrol
from ..records import record, replace
from . import opaque

DIRECTORY = "mps"
CONTAINER_PIPE = "/tmp/nvidia-mps"


@record
class Plan(mpscontrol.Paths):
    state_dir: str
    uid: str
    uuids: tuple[str, ...]                  # what the daemon sees, in order
    threads: int | None                     # default active-thread percentage
    limits: tuple[tuple[int, int], ...]     # (device number, MiB) pinned memory limits

    @property
    def directory(self) -> str:
        return directory(self.state_dir, self.uid)


def directory(state_dir: str, uid: str) -> str:
    return os.path.join(state_dir, DIRECTORY, uid)


def plan(state_dir: str, uid: str, devices: list[dict], label: str) -> Plan | None:
    """The daemon of a claim whose record's ``devices`` ask MPS, or None when none asks it."""
    asking = [d["sharing"] for d in devices if (d.get("sharing") or {}).get("strategy") == "MPS"]
    if not asking:
        return None
    order = [d["uuid"] for d in devices]
    uuids = tuple(dict.fromkeys(order))
    threads = {s.get("activeThreads") for s in asking} - {None}
    if len(threads) > 1:
        raise NvcError("input", f"claim {escape(label, 200)}: its devices' MPS configurations ask different "
                                f"active-thread percentages ({', '.join(map(str, sorted(threads)))}); one MPS "
                                "daemon serves the claim")
    limits: dict[int, int] = {}
    for s in asking:
        if s.get("pinnedLimit") is not None:
            limits.update({i: s["pinnedLimit"] for i in range(len(uuids))})
    for s in asking:
        for key, amount in s.get("perDeviceLimits") or ():
            index = opaque.device_index(key)
            uuid = order[index] if index is not None and index < len(order) else key
            if uuid in uuids:
                limits[uuids.index(uuid)] = amount
    return Plan(state_dir, uid, uuids, threads.pop() if threads else None,
                tuple((i, amount >> 20) for i, amount in sorted(limits.items())))


def commands(p: Plan) -> tuple[str, ...]:
    """What the daemon is told once started (NVIDIA's order: memory, then threads)."""
    out = [f"set_default_device_pinned_mem_limit {i} {mib}M" for i, mib in p.limits]
    if p.threads is not None:
        out.append(f"set_default_active_thread_percentage {p.threads}")
    return tuple(out)


def client_env(p: Plan) -> tuple[str, ...]:
    env = [f"{mpscontrol.PIPE_ENV}={CONTAINER_PIPE}"]
    if p.threads is not None:
        env.append(f"{mpscontrol.THREADS_ENV}={p.threads}")
    if p.limits:
        env.append(f"{mpscontrol.MEMORY_ENV}=" + ",".join(f"{i}={mib}M" for i, mib in p.limits))
    return tuple(env)


def reaching(spec: Spec, p: Plan) -> Spec:
    """``spec`` with the claim's containers sent to its daemon: the pipe directory mounted in
    place of the host's default one (which the driver's files bring), and the clients' env."""
    mounts = tuple(m for m in spec.edits.mounts if m.container_path != CONTAINER_PIPE)
    return replace(spec, edits=replace(spec.edits, env=spec.edits.env + client_env(p),
                                       mounts=mounts + (Mount(p.pipe, CONTAINER_PIPE, BIND_OPTIONS),)))


def control(where: str, uuids, binary: str, deadline: float, label: str) -> mpscontrol.Control:
    return mpscontrol.Control(f"MPS daemon of claim {label}", where, ",".join(uuids), binary, deadline)


def start(p: Plan, binary: str, deadline: float, label: str) -> None:
    """The claim's daemon running and told its limits, kept when one already answers (a
    repeated prepare, a restarted plugin); an error naming the claim, with its directory
    removed, when it does not start."""
    daemon = control(p.directory, p.uuids, binary, deadline, label)
    if os.path.isdir(p.directory) and not os.path.islink(p.directory) and not daemon.answers():
        return
    try:
        why = daemon.start(commands(p))
    except NvcError as exc:
        why = exc.detail
    except OSError as exc:
        why = escape(exc.strerror or str(exc))
    if why:
        stop(p.state_dir, p.uid, binary, deadline, label)
        raise NvcError("device", f"claim {escape(label, 200)}: its MPS daemon did not start: {why}")


def stop(state_dir: str, uid: str, binary: str | None, deadline: float, label: str) -> str:
    """The claim's daemon told to quit and its directory removed (``mps/`` too when it is
    left empty); '' or why quitting failed. Nothing there is not an error."""
    where = directory(state_dir, uid)
    if not os.path.lexists(where):
        return ""
    daemon = control(where, (), binary or "/nonexistent", deadline, label)
    why = daemon.stop() if binary else (daemon.clear() or "")
    try:
        os.rmdir(os.path.join(state_dir, DIRECTORY))
    except OSError:
        pass                 # another claim's daemon is still there
    return why
