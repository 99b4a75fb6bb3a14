"""Which container uses how much of which GPU, on any node: ``nvcontainer ps``'s own scan.

The facts are ``ps``'s (:mod:`..ps.gather`: container inits by pid namespace, their device
cgroups and mounts, the runtimes' state for names, the lease file) and the GPU processes come
from this scrape's sampler round, so one NVML reading feeds both the GPU series and the
per-container ones. :func:`..ps.assemble.assemble` decides who owns each process, as ``ps``
shows it. MPS clients (NVML's MPS process list) are processes of kind ``mps``.

Only running containers are listed, so a container's series end when it exits: the label
cardinality is bounded by what runs now, not by what ever ran.
"""

from __future__ import annotations

import os

from ..ps import gather, scan
from ..ps.assemble import assemble


def activity(entries: dict[str, dict]) -> dict:
    """The sampler's per-GPU entries as ``ps``'s NVML activity, MPS clients merged in by pid."""
    gpus = []
    for uuid, entry in entries.items():
        act = entry.get("activity")
        if not isinstance(act, dict):
            continue
        procs = {p["pid"]: dict(p, kinds=list(p["kinds"])) for p in act.get("processes", ())}
        for client in entry.get("mps", ()):
            seen = procs.setdefault(client["pid"], {"pid": client["pid"], "memory": client.get("memory"),
                                                    "kinds": [], "sm": None})
            seen["kinds"].append("mps")
        gpus.append({"uuid": uuid, "processes": list(procs.values()),
                     "utilization": act.get("utilization"), "memory_utilization": act.get("memory_utilization")})
    return {"gpus": gpus}


def view(inventory, entries: dict[str, dict], config, *, proc: str = "/proc", roots=None) -> list[dict]:
    """``ps``'s per-GPU view (see :func:`..ps.assemble.assemble`) for the GPUs that answered."""
    act = activity(entries)
    running = gather.containers([g.minor for g in inventory.gpus], proc, *([roots] if roots is not None else []))
    found = gather.processes(act, proc)
    leases, _why = gather.lease_facts(config, proc) if config is not None else ([], None)
    own = scan.cgroup_of(os.getpid(), proc)
    answered = [g for g in inventory.gpus if g.uuid in entries]
    return assemble(answered, {g["uuid"]: g for g in act["gpus"]}, running, found, leases,
                    ignore_cgroup=own[1] if own else "")
