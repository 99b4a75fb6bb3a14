"""The per-GPU view of ``nvcontainer ps``, from facts alone (pure).

A container is shown under a GPU when its device cgroup allows that GPU's node by an exact
rule, when that node is mounted in it, when one of its processes runs on the GPU, or when a
lease binds the GPU to it. It is there "by lease" when a lease names it (by container ID or
init pid), "by request" otherwise. A GPU process belongs to the container whose pid namespace
it shares, else to the container whose device cgroup holds its own; the rest are the host's.
A lease whose container is gone is listed under its GPUs as not running.
"""

from __future__ import annotations

from .model import Container, Lease, Process


def owner(process: Process, containers: list[Container], ignore_cgroup: str = "") -> Container | None:
    for c in containers:
        if process.pidns and c.pidns == process.pidns:
            return c
    best = None
    for c in containers:
        if not c.cgroup or c.cgroup == ignore_cgroup or not process.cgroup:
            continue
        if process.cgroup == c.cgroup or process.cgroup.startswith(c.cgroup.rstrip("/") + "/"):
            if best is None or len(c.cgroup) > len(best.cgroup):
                best = c
    return best


def _process_entry(p: Process) -> dict:
    return {"pid": p.pid, "command": p.command, "memory": p.memory, "sm": p.sm, "kinds": list(p.kinds)}


def _holds(lease: Lease, c: Container) -> bool:
    """A live lease names its container's init by pid and start time; a lease whose init is gone
    holds nothing, even where a restarted container kept the ID."""
    return lease.alive and lease.pid == c.pid and (lease.start is None or c.start is None or lease.start == c.start)


def assemble(gpus, activity: dict, containers: list[Container], processes: list[Process],
             leases: list[Lease], *, ignore_cgroup: str = "") -> list[dict]:
    """One dict per GPU (``gpus``: the inventory's), in index order; ``activity``: UUID → the
    NVML child's utilisation entry."""
    owners = {id(p): owner(p, containers, ignore_cgroup) for p in processes}
    out = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        rates = activity.get(gpu.uuid, {})
        here = [p for p in processes if p.gpu == gpu.uuid]
        gpu_leases = [lease for lease in leases if gpu.uuid in lease.gpus]
        entries = []
        for c in containers:
            mine = [p for p in here if owners[id(p)] is c]
            held = [lease for lease in gpu_leases if _holds(lease, c)]
            evidence = [name for name, present in (
                ("cgroup", gpu.minor in c.cgroup_minors), ("mount", gpu.minor in c.mount_minors),
                ("process", bool(mine)), ("lease", bool(held))) if present]
            if not evidence:
                continue
            known = [p.memory for p in mine if p.memory is not None]
            entries.append({
                "id": c.id, "name": c.name, "command": c.command, "engine": c.engine, "pid": c.pid,
                "how": "lease" if held else "request", "running": True, "evidence": evidence,
                "memory": sum(known) if known else None,
                "processes": [_process_entry(p) for p in mine],
            })
        for lease in gpu_leases:
            if not any(_holds(lease, c) for c in containers):
                entries.append({"id": lease.container, "name": "", "command": "", "engine": "", "pid": lease.pid,
                                "how": "lease", "running": lease.alive, "evidence": ["lease"], "memory": None,
                                "processes": []})
        out.append({
            "index": gpu.index, "minor": gpu.minor, "uuid": gpu.uuid, "model": gpu.model,
            "utilization": rates.get("utilization"), "memory_utilization": rates.get("memory_utilization"),
            "containers": entries,
            "host_processes": [_process_entry(p) for p in here if owners[id(p)] is None],
        })
    return out


def select_gpu(view: list[dict], token: str) -> list[dict]:
    """The entry of one GPU by index or UUID; [] when none matches."""
    token = token.strip()
    return [g for g in view if token == g["uuid"] or (token.isascii() and token.isdigit() and int(token) == g["index"])]
