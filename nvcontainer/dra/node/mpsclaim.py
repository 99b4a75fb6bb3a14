"""A claim's MPS control daemons: what each sees and is told, what the claim's containers are
given to reach it, and their start and stop (by :class:`~nvcontainer.mps.control.Control`).

Why one daemon per claim *and configuration group*, as NVIDIA's driver: the pods sharing a
claim are the daemon's clients, and nobody else's; the limits are one opaque configuration's,
so two claims on one GPU, or two MPS configurations in one claim (NVIDIA's gpu-test5 has a
time-sliced and an MPS GPU in one claim), each get their own daemon with their own limits, and
a device of another group (time-sliced, or unshared) is no client of any. A daemon sees exactly
its group's devices (``CUDA_VISIBLE_DEVICES`` = their UUIDs, in the claim's order, so a
per-device limit's index is the daemon's device number) and its directory is the plugin's own::

    <plugins>/gpu.nvidia.com/mps/<claim UID>/<group>/pipe/   CUDA_MPS_PIPE_DIRECTORY (``control``)
    <plugins>/gpu.nvidia.com/mps/<claim UID>/<group>/log/    CUDA_MPS_LOG_DIRECTORY
    <plugins>/gpu.nvidia.com/mps/<claim UID>/<group>/shm/    the daemon's and its clients' /dev/shm

The claim's CDI spec gives the group's *devices* (never the spec's common edits) ``pipe/`` at
``/tmp/nvidia-mps`` (CUDA's default pipe directory; the host's own, which the driver's files
bring, is dropped from the common edits), ``shm/`` at ``/dev/shm`` (the daemon runs with the
same directory as its /dev/shm: :mod:`~nvcontainer.mps.control`; one per daemon, shared
with its clients only) and ``CUDA_MPS_PIPE_DIRECTORY`` there, with the limits also as the
clients' own ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` / ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (as
the device plugin's MPS does). Everything here is decided from the claim's record (its devices'
UUIDs, sharing settings and groups), so a repeated prepare after a restart decides the same.
"""

from __future__ import annotations

import os

from ...cdi.generate import BIND_OPTIONS
from ...cdi.spec import Mount, Spec
from ...errors import NvcError, escape
from ...mps import control as mpscontrol
from ...records import record, replace
from .. import opaque
from .prepared import PreparedDevice

DIRECTORY = "mps"
CONTAINER_PIPE = "/tmp/nvidia-mps"
CONTAINER_SHM = "/dev/shm"


@record
class Plan(mpscontrol.Paths):
    state_dir: str
    uid: str
    group: str                              # the configuration that asked MPS ("config[1]")
    devices: tuple[str, ...]                # the DRA device names it serves
    uuids: tuple[str, ...]                  # what the daemon sees, in order
    threads: int | None                     # default active-thread percentage
    limits: tuple[tuple[int, int], ...]     # (device number, MiB) pinned memory limits

    @property
    def directory(self) -> str:
        return os.path.join(directory(self.state_dir, self.uid), _slug(self.group))

    @property
    def shm(self) -> str:
        return f"{self.directory}/{mpscontrol.SHM}"


def directory(state_dir: str, uid: str) -> str:
    return os.path.join(state_dir, DIRECTORY, uid)


def _slug(group: str) -> str:
    """``config[2]`` → ``config-2`` (a directory name); a record of before groups: ``claim``."""
    return group.replace("[", "-").replace("]", "") if group else "claim"


def plans(state_dir: str, uid: str, devices: tuple[PreparedDevice, ...], label: str) -> list[Plan]:
    """One daemon per configuration group whose devices (the claim's record's ``devices``) ask
    MPS; [] when none asks it."""
    groups: dict[str, list[PreparedDevice]] = {}
    for d in devices:
        if d.sharing.strategy == "MPS":
            groups.setdefault(d.group, []).append(d)
    return [_plan(state_dir, uid, group, members) for group, members in groups.items()]


def _plan(state_dir: str, uid: str, group: str, members: list[PreparedDevice]) -> Plan:
    sharing = members[0].sharing               # one configuration: the same settings on each
    uuids = tuple(dict.fromkeys(d.uuid for d in members))
    limits: dict[int, int] = {}
    if sharing.pinned_limit is not None:
        limits.update({i: sharing.pinned_limit for i in range(len(uuids))})
    for key, amount in sharing.per_device_limits:
        index = opaque.device_index(key)
        if key in uuids:
            limits[uuids.index(key)] = amount
        elif index is not None and index < len(uuids):
            limits[index] = amount
    return Plan(state_dir, uid, group, tuple(dict.fromkeys(d.device for d in members)), uuids,
                sharing.active_threads, tuple((i, amount >> 20) for i, amount in sorted(limits.items())))


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


def reaching(spec: Spec, uid: str, every: list[Plan]) -> Spec:
    """``spec`` with each group's devices sent to its daemon: its pipe directory and /dev/shm
    mounted and the clients' env, on those devices' own edits. The host's default pipe
    directory (which the driver's files bring) leaves the common edits: no container of the
    claim reaches a daemon that is not its group's."""
    mounts = tuple(m for m in spec.edits.mounts if m.container_path != CONTAINER_PIPE)
    by_name = {f"{uid}-{device}": p for p in every for device in p.devices}
    devices = []
    for d in spec.devices:
        p = by_name.get(d.name)
        if p is not None:
            d = replace(d, edits=replace(d.edits, env=d.edits.env + client_env(p), mounts=d.edits.mounts + (
                Mount(p.pipe, CONTAINER_PIPE, BIND_OPTIONS), Mount(p.shm, CONTAINER_SHM, BIND_OPTIONS))))
        devices.append(d)
    return replace(spec, edits=replace(spec.edits, mounts=mounts), devices=tuple(devices))


def control(where: str, uuids, binary: str, deadline: float, label: str) -> mpscontrol.Control:
    return mpscontrol.Control(f"MPS daemon of claim {label}", where, ",".join(uuids), binary, deadline, shm=True)


def start(p: Plan, binary: str, deadline: float, label: str) -> None:
    """The group's daemon running and told its limits, kept when one already answers (a
    repeated prepare, a restarted plugin); an error naming the claim and group, with the
    claim's daemons stopped and its directory removed, when it does not start."""
    daemon = control(p.directory, p.uuids, binary, deadline, label)
    if daemon.ours() and not daemon.answers():
        return
    try:
        why = daemon.start(commands(p))
    except NvcError as exc:
        why = exc.detail
    except OSError as exc:
        why = escape(exc.strerror or str(exc))
    if why:
        stop(p.state_dir, p.uid, binary, deadline, label)
        raise NvcError("device", f"claim {escape(label, 200)}: the MPS daemon of {p.group or 'its devices'} did "
                                 f"not start: {why}")


def stop(state_dir: str, uid: str, binary: str | None, deadline: float, label: str) -> str:
    """Each of the claim's daemons told to quit and its directory removed (``mps/`` too when
    it is left empty); '' or why quitting failed. Nothing there is not an error. Only real
    directories of ours are entered: a link in a daemon's place is removed, never followed."""
    where = directory(state_dir, uid)
    whys = []
    try:
        names = sorted(os.listdir(where)) if mpscontrol.is_own_dir(where) else []
    except OSError:
        names = []
    for name in names:
        daemon = control(os.path.join(where, name), (), binary or "/nonexistent", deadline, label)
        why = daemon.stop() if binary else (daemon.clear() or "")
        if why:
            whys.append(f"{name}: {why}")
    mpscontrol.Control("", where, "", "/nonexistent", deadline).clear()
    try:
        os.rmdir(os.path.join(state_dir, DIRECTORY))
    except OSError:
        pass                 # another claim's daemon is still there
    return "; ".join(whys)
