"""``GetPreferredAllocation``: which of the available devices to give a container. Pure.

Why the plugin is asked at all: the kubelet knows which IDs are free, not how GPUs are wired.
A job on GPUs split over two CPU sockets, or on two GPUs with no NVLink between them, runs slower
than on a well-placed set, so the kubelet lets the plugin choose. The choice, in order:

1. everything in ``must_include`` (the kubelet's own picks, e.g. for an init container);
2. as few NUMA nodes as possible;
3. with time-slicing, replicas spread over as many GPUs as possible (two replicas on one GPU
   share it; the container asked for two);
4. the most NVLinks between the chosen GPUs, then the nearest PCIe common ancestors;
5. the GPUs with the most free replicas (the least shared), then the lowest indexes, so the
   answer is deterministic.

Every candidate set is scored when there are few enough (a node's worth: choosing 4 of 8 GPUs is
70 sets); past that, a greedy pass adds one device at a time by the same score.
"""

from __future__ import annotations

from itertools import combinations

from ..errors import escape
from .allocate import Refused, look_up
from .devices import Advertised, Resource
from .topology import Topology

EXHAUSTIVE_LIMIT = 20000


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

    def score(counts: dict[int, int]):
        used = sorted(g for g, n in counts.items() if n)
        numa = {topology.numa[g] for g in used if g in topology.numa}
        pairs = list(combinations(used, 2))
        return (len(numa),
                max(counts.values(), default=0) if spread else 0,
                -sum(topology.link_count(a, b) for a, b in pairs),
                sum(topology.pcie_level(a, b) for a, b in pairs),
                -sum(free[g] for g in used),
                used)

    need = size - len(must)
    counts = _best(groups, base, need, score)
    picked = [e.id for e in must]
    for g in sorted(counts):
        picked += [e.id for e in groups.get(g, [])[:counts[g] - base.get(g, 0)]]
    return picked


def _best(groups: dict[int, list], base: dict[int, int], need: int, score) -> dict[int, int]:
    """How many to take from each group (must-include counts added) with the best score."""
    order = sorted(groups)
    caps = [len(groups[g]) for g in order]
    if _count_ways(caps, need, EXHAUSTIVE_LIMIT + 1) <= EXHAUSTIVE_LIMIT:
        best, best_key = None, None
        for ways in _ways(caps, need):
            counts = dict(base)
            for g, n in zip(order, ways):
                if n:
                    counts[g] = counts.get(g, 0) + n
            key = score(counts)
            if best_key is None or key < best_key:
                best, best_key = counts, key
        return best if best is not None else dict(base)
    counts = dict(base)
    for _ in range(need):
        options = []
        for g in order:
            if counts.get(g, 0) - base.get(g, 0) < len(groups[g]):
                trial = dict(counts)
                trial[g] = trial.get(g, 0) + 1
                options.append((score(trial), trial))
        counts = min(options, key=lambda o: o[0])[1]
    return counts


def _ways(caps: list[int], need: int, at: int = 0):
    """Every vector of counts, one per group, within ``caps``, summing to ``need``."""
    if at == len(caps):
        if need == 0:
            yield ()
        return
    room = sum(caps[at + 1:])
    for n in range(max(0, need - room), min(caps[at], need) + 1):
        for rest in _ways(caps, need - n, at + 1):
            yield (n, *rest)


def _count_ways(caps: list[int], need: int, stop: int) -> int:
    """How many vectors :func:`_ways` yields, counted only up to ``stop``."""
    ways = [1] + [0] * need          # ways[k]: vectors over the groups so far summing to k
    for cap in caps:
        new = [0] * (need + 1)
        for k in range(need + 1):
            if ways[k]:
                for n in range(min(cap, need - k) + 1):
                    new[k + n] = min(stop, new[k + n] + ways[k])
        ways = new
    return ways[need]
