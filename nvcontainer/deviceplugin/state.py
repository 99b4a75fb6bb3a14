"""The plugin's memory while it runs: the device table, health and topology, shared by every
resource's server and outliving them.

Why one object outside the servers: a kubelet restart removes our sockets, so the gRPC servers
are torn down and started again on new ones; what the plugin knows (which GPU raised an XID ten
minutes ago, the NVLink layout) must not go with them. Everything here runs on the plugin's one
event loop, so no lock is needed; a change bumps ``version`` and wakes the ``ListAndWatch``
streams, which send the new list.
"""

from __future__ import annotations

import asyncio

from ..inventory.model import Inventory
from .devices import Resource
from .settings import Settings
from ..inventory.topology import Topology

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class PluginState:
    def __init__(self, inv: Inventory, resources: tuple[Resource, ...], settings: Settings, topology: Topology):
        self.inventory = inv
        self.resources = resources
        self.settings = settings
        self.topology = topology
        self.bad: dict[str, str] = {}            # unit UUID -> why it is unhealthy
        self.version = 0
        self.stopping = False
        self._changed = asyncio.Event()

    def unhealthy(self, resource: Resource) -> frozenset[str]:
        """IDs of ``resource`` now unhealthy: every replica of an unhealthy GPU or MIG device."""
        if not self.bad:
            return frozenset()
        return frozenset(d.id for d in resource.devices if d.unit.uuid in self.bad)

    def set_bad(self, bad: dict[str, str]) -> bool:
        """Record which units are unhealthy; True (and the streams woken) when that changed."""
        if bad == self.bad:
            return False
        self.bad = dict(bad)
        self._bump()
        return True

    def set_topology(self, topology: Topology) -> None:
        self.topology = topology

    def stop(self) -> None:
        """End every ListAndWatch stream (the plugin is shutting down)."""
        self.stopping = True
        self._bump()

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, seen: int) -> None:
        """Return once ``version`` is no longer ``seen``."""
        while self.version == seen:
            await self._changed.wait()
