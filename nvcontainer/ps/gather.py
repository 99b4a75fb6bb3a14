"""``nvcontainer ps``'s shell: the facts read once (inventory, NVML's processes through the
inventory's child, the running containers, the runtimes' state, the leases), then assembled.

NVML is never loaded here: :func:`..inventory.nvml.activity` asks it in the same short-lived,
unprivileged child as every other NVML question, with the library the inventory found.
"""

from __future__ import annotations

import os

from ..errors import NvcError
from ..inventory.model import NVIDIA_MAJOR
from ..records import replace
from . import ocistate, scan
from .assemble import assemble
from .identity import from_cgroup, from_kernel
from .model import Container, Lease, Process


def nvml_library(inventory) -> str:
    for lib in inventory.libraries:
        if lib.soname == "libnvidia-ml.so.1" or os.path.basename(lib.path).startswith("libnvidia-ml.so."):
            return os.path.join(inventory.root, lib.path.lstrip("/"))
    raise NvcError("initialization", "nvml error: the inventory holds no libnvidia-ml.so.1")


def identify(c: Container, states: dict, proc: str = "/proc") -> Container:
    """The engine's ID and name for a container; where none says, what the kernel shows (the
    cgroup's last component, the init's command line)."""
    engine, found = from_cgroup(c.cgroup)
    runtime, state_id, name = states.get(c.pid, ("", "", ""))
    container_id = found or state_id or from_kernel(c.cgroup)
    if not name and engine == "docker":
        name = ocistate.docker_name(container_id)
    command = "" if name else scan.cmdline(c.pid, proc)
    return replace(c, id=container_id, name=name, engine=engine or runtime, command=command)


def containers(minors, proc: str = "/proc", roots=ocistate.ROOTS) -> list[Container]:
    states = ocistate.states(roots)
    found = []
    for pid, space in scan.container_inits(proc):
        c = scan.read_container(pid, space, minors, NVIDIA_MAJOR, proc)
        if c is not None:
            found.append(identify(c, states, proc))
    seen = {c.pid for c in found}
    for pid in sorted(set(states) - seen):
        # a container sharing the host's pid namespace: found by its runtime's state alone
        c = scan.read_container(pid, "", minors, NVIDIA_MAJOR, proc)
        if c is not None:
            found.append(identify(c, states, proc))
    return found


def processes(activity: dict, proc: str = "/proc") -> list[Process]:
    out = []
    for gpu in activity["gpus"]:
        for p in gpu["processes"]:
            where = scan.cgroup_of(p["pid"], proc)
            if where is None:   # exited since NVML listed it
                continue
            out.append(Process(pid=p["pid"], gpu=gpu["uuid"], memory=p["memory"], kinds=tuple(p["kinds"]),
                               sm=p["sm"], cgroup=where[1], pidns=scan.pidns(p["pid"], proc),
                               command=scan.command(p["pid"], proc)))
    return out


def lease_facts(config, proc: str = "/proc") -> tuple[list[Lease], str | None]:
    """The recorded leases with whether each container still runs, and a one-line warning: a
    lease file that cannot be trusted gives no leases; entries that are not leases are named
    (each holds GPUs until its container is known to have ended)."""
    from ..errors import escape
    from ..leases import liveness, store

    path = store.path_in(config.cache_dir)
    try:
        recorded, unreadable = store.load_all(path)
    except NvcError as exc:
        return [], f"leases not shown: {exc.detail}"
    held = [u for u in unreadable if liveness.may_run(u)]
    problem = None
    if held:
        problem = (f"{escape(path)}: {'; '.join(u.holder() for u in held[:4])}"
                   f"{f' and {len(held) - 4} more' if len(held) > 4 else ''}: held until its container is known to have ended")
    return [Lease(container=lease.container, pid=lease.pid, gpus=tuple(lease.gpus), start=lease.start,
                  alive=liveness.alive(lease, proc)) for lease in recorded], problem


def snapshot(config, inventory, leases: list[Lease] = (), *, proc: str = "/proc", roots=ocistate.ROOTS) -> list[dict]:
    """The per-GPU view of this host now (see :func:`.assemble.assemble`)."""
    from ..inventory import nvml
    from ..inventory.identity import parse_user

    activity = nvml.activity(nvml_library(inventory), parse_user(config.user), min(config.deadline, 30))
    running = containers([g.minor for g in inventory.gpus], proc, roots)
    found = processes(activity, proc)
    own = scan.cgroup_of(os.getpid(), proc)
    return assemble(inventory.gpus, {g["uuid"]: g for g in activity["gpus"]}, running, found, list(leases),
                    ignore_cgroup=own[1] if own else "")
