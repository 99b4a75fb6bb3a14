"""The health watcher's topology report → a :class:`~nvcontainer.inventory.topology.Topology`.

Why here: the report is the device plugin's (its watcher child asks NVML once); the model and the
NUMA reader are below, in :mod:`nvcontainer.inventory.topology`, shared with the lease allocator.
"""

from __future__ import annotations

from ..inventory.model import Inventory
from ..inventory.topology import SYSTEM, Topology


def from_report(report: dict, inv: Inventory, numa: dict) -> Topology:
    """The watcher's ``topology`` line (pairs of GPU UUIDs) in GPU indexes; unknown UUIDs and
    malformed entries are dropped (the report is data from a child, not trusted to be well formed)."""
    index = {g.uuid: g.index for g in inv.gpus}

    def pairs(key: str, low: int, high: int) -> dict:
        out = {}
        items = report.get(key)
        for item in items if isinstance(items, list) else ():
            if not (isinstance(item, list) and len(item) == 3):
                continue
            a, b, value = (index.get(item[0]) if isinstance(item[0], str) else None,
                           index.get(item[1]) if isinstance(item[1], str) else None, item[2])
            if a is None or b is None or a == b or type(value) is not int or not low <= value <= high:
                continue
            out[(min(a, b), max(a, b))] = value
        return out

    return Topology(numa=dict(numa), links=pairs("nvlink", 1, 64), pcie=pairs("pcie", 0, SYSTEM))
