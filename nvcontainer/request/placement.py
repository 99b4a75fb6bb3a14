"""Which of the free GPUs to give: the choice the device plugin's ``GetPreferredAllocation`` and
the lease allocator's ``free:N`` share. Pure.

Why one implementation: a node that places a Kubernetes pod's GPUs one way and a ``docker run``'s
another would be two policies to explain. The order, first difference wins:

1. as few NUMA nodes as possible (a job split over two CPU sockets runs slower);
2. with time-slicing, replicas spread over as many GPUs as possible (the plugin's only);
3. the most NVLinks between the chosen GPUs, then the nearest PCIe common ancestors;
4. the GPUs with the most free units (the least shared), then the lowest indexes, so the answer
   is deterministic.

Every candidate set is scored when there are few enough (a node's worth: choosing 4 of 8 GPUs is
70 sets); past that, a greedy pass adds one unit at a time by the same score.
"""

from __future__ import annotations

from itertools import combinations

from ..inventory.topology import Topology

EXHAUSTIVE_LIMIT = 20000


def scorer(topology: Topology, free: dict[int, int], spread: bool = False):
    """The key :func:`best` minimises: GPU index → units taken from it, scored as above."""
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
    return score


def choose_gpus(candidates: list[int], count: int, topology: Topology) -> list[int]:
    """``count`` of the whole GPUs ``candidates`` (indexes, each free), best placed first-come."""
    counts = best({g: 1 for g in candidates}, {}, count, scorer(topology, {g: 1 for g in candidates}))
    return sorted(g for g, n in counts.items() if n)


def best(caps: dict[int, int], base: dict[int, int], need: int, score) -> dict[int, int]:
    """How many units to take from each GPU (at most ``caps[g]``; ``base`` already taken, added)
    so that ``need`` more are taken with the lowest ``score``."""
    order = sorted(caps)
    limits = [caps[g] for g in order]
    if _count_ways(limits, need, EXHAUSTIVE_LIMIT + 1) <= EXHAUSTIVE_LIMIT:
        chosen, chosen_key = None, None
        for ways in _ways(limits, need):
            counts = dict(base)
            for g, n in zip(order, ways):
                if n:
                    counts[g] = counts.get(g, 0) + n
            key = score(counts)
            if chosen_key is None or key < chosen_key:
                chosen, chosen_key = counts, key
        return chosen if chosen is not None else dict(base)
    counts = dict(base)
    for _ in range(need):
        options = []
        for g in order:
            if counts.get(g, 0) - base.get(g, 0) < caps[g]:
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
