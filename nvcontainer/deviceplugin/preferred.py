"""``GetPreferredAllocation``: which of the available devices to give a container. Pure.

Why the plugin is asked at all: the kubelet knows which IDs are free, not how GPUs are wired.
A job on GPUs split over two CPU sockets, or on two GPUs with no NVLink between them, runs slower
than on a well-placed set, so the kubelet lets the plugin choose. Everything in ``must_include``
(the kubelet's own picks, e.g. for an init container) first; the rest as
:mod:`nvcontainer.request.placement` places them, the same choice ``free:N`` makes for a lease.
"""

from __future__ import annotations

from ..errors import escape
from ..inventory.topology import Topology
from ..request.placement import best, scorer
from .allocate import Refused, look_up
from .devices import Advertised, Resource


def preferred(available, must_include, size, resource: Resource, topology: Topology, *,
              spread: bool = False) -> list[str]:
    """IDs to allocate, ``must_include`` first. ``spread``: the IDs are time-slicing replicas."""
    avail = look_up(available, resource, "available device")
    must = look_up(must_include, resource, "must-include device")
    if type(size) is not int or not 0 < size <= len(avail) or size < len(must):
        raise Refused("invalid", f"allocation size {escape(size, 20)} for {len(avail)} available and "
                                 f"{len(must)} required {resource.name} devices")
    chosen = {e.id for e in must}
    groups: dict[int, list[Advertised]] = {}
    for entry in avail:
        if entry.id not in chosen:
            groups.setdefault(entry.unit.gpu.index, []).append(entry)
    base: dict[int, int] = {}
    for entry in must:
        base[entry.unit.gpu.index] = base.get(entry.unit.gpu.index, 0) + 1
    free = {g: len(items) for g, items in groups.items()}
    for g, n in base.items():
        free[g] = free.get(g, 0) + n

    need = size - len(must)
    counts = best({g: len(items) for g, items in groups.items()}, base, need,
                  scorer(topology, free, spread))
    picked = [e.id for e in must]
    for g in sorted(counts):
        picked += [e.id for e in groups.get(g, [])[:counts[g] - base.get(g, 0)]]
    return picked

