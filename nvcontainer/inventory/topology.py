"""How the GPUs are connected: NUMA nodes from sysfs, NVLink and PCIe from NVML.

Why two sources: a GPU's NUMA node is a fact of the PCI device that the kernel publishes in
``/sys/bus/pci/devices/<address>/numa_node``, readable without loading any vendor code, so the
kubelet's topology manager gets it in ``Device.topology`` from the first ``ListAndWatch``. NVLink
and the PCIe switch hierarchy only NVML knows; the health watcher asks it once when it starts and
reports pairs of UUIDs, which :func:`from_report` turns into GPU indexes. Until that report
arrives (or when NVML cannot answer), preferred allocation works from the NUMA nodes alone, as
the hook's ``free:N`` always does (it never calls NVML on a start).

Here, below the request layer, so the device plugin and the lease allocator share one model
(:mod:`nvcontainer.health.topology` turns the watcher's report into it).
"""

from __future__ import annotations

import os

from .. import log
from ..errors import escape
from ..records import field, record
from .model import Inventory

SYSTEM = 50            # NVML_TOPOLOGY_SYSTEM: the farthest two GPUs can be
MAX_NUMA = 1 << 16


@record
class Topology:
    """``numa``: GPU index → NUMA node (absent: unknown). ``links``: (i, j) with i < j → the
    number of NVLinks between GPUs i and j. ``pcie``: (i, j) → NVML's common-ancestor level
    (0 the same board … 50 across CPU sockets)."""

    numa: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)
    pcie: dict = field(default_factory=dict)

    def link_count(self, a: int, b: int) -> int:
        return self.links.get((min(a, b), max(a, b)), 0)

    def pcie_level(self, a: int, b: int) -> int:
        return 0 if a == b else self.pcie.get((min(a, b), max(a, b)), SYSTEM)


def sysfs_address(bus_id: str) -> str:
    """``00000000:07:00.0`` (the inventory's form) → ``0000:07:00.0`` (sysfs's, 16-bit domain)."""
    domain, _, rest = bus_id.partition(":")
    value = int(domain, 16) if domain else 0
    return f"{value:04x}:{rest}" if value <= 0xFFFF else f"{value:08x}:{rest}"


def numa_nodes(sysfs: str, inv: Inventory) -> dict[int, int]:
    """GPU index → NUMA node, for the GPUs whose node sysfs knows (``-1`` there: none)."""
    out = {}
    for gpu in inv.gpus:
        path = os.path.join(sysfs, "bus/pci/devices", sysfs_address(gpu.bus_id), "numa_node")
        try:
            with open(path, "rb") as f:
                text = f.read(32)
            node = int(text.strip())
        except (OSError, ValueError) as exc:
            log.info(f"no NUMA node for GPU {gpu.index}: {escape(path)}: {escape(exc)}")
            continue
        if 0 <= node < MAX_NUMA:
            out[gpu.index] = node
    return out
