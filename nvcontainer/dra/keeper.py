"""The slice side of ``nvcontainer dra-driver``, running: publish, follow the inventory and the
GPUs' health, until cancelled.

Why here and not in the command: the kubelet side (registration, prepare) and the slice side
share only the process; the command starts :func:`keep_published` as one task beside its gRPC
servers and cancels it on SIGTERM. Three things feed the :class:`publish.Loop`:

* the inventory, checked every ``check_every`` seconds by the snapshot child (a driver reload,
  MIG devices created or destroyed): a new one is published, and the health watcher restarted
  on the new GPU list;
* the device plugin's health monitor (``health.py``): a verdict withdraws or taints a device;
* the resync timer inside the loop (a slice deleted by hand comes back).
"""

from __future__ import annotations

import asyncio

from .. import log
from ..errors import NvcError
from . import health, publish, snapshot

CHECK_EVERY = 10.0


async def keep_published(config, api, node: str, inv, *, allow=None, taint: bool = False, sysfs: str = "/sys",
                         proc: str = "/proc", say=log.info, check_every: float = CHECK_EVERY,
                         resync: float = publish.RESYNC, on_health=None, on_inventory=None) -> None:
    """``allow``: inventory → AllowList | None (the node's ``allowed-devices``); ``inv``: the
    inventory the command built before its threads started; ``on_health({UUID: why})`` and
    ``on_inventory(inv)``: the kubelet side's hooks (refuse to prepare an unhealthy device, offer
    the devices of a new inventory), called from the event loop."""
    loop = publish.Loop(publish.Publisher(api, node, allow=allow, taint=taint, sysfs=sysfs, say=say), resync=resync)
    loop.inventory(inv)
    running = asyncio.create_task(loop.run())
    watch = _Health(config, loop, say, on_health)
    watch.start(inv)
    failing = ""
    try:
        while True:
            await asyncio.sleep(check_every)
            try:
                now = await asyncio.to_thread(snapshot.current, config, proc=proc)
            except NvcError as exc:
                if str(exc) != failing:
                    say(f"inventory not read: {exc.detail}; the slices stay as they are")
                failing = str(exc)
                continue
            if failing:
                say("inventory read again")
                failing = ""
            if now != loop.publisher.inv:
                say(f"the inventory changed: {len(now.gpus)} GPU(s); publishing again")
                await watch.stop()
                loop.inventory(now)
                if on_inventory is not None:
                    on_inventory(now)
                watch.start(now)
    finally:
        await watch.stop()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


class _Health:
    """The monitor for the current GPU list, restarted when the list changes."""

    def __init__(self, config, loop: publish.Loop, say, also=None):
        self.config, self.loop, self.say, self.also = config, loop, say, also
        self.monitor = self.task = None

    def publish(self, bad: dict) -> None:
        self.loop.health(bad)
        if self.also is not None:
            self.also(dict(bad))

    def unmonitored(self, inv, why: str) -> None:
        """No health events from this driver: every device stays; under ``--taint-unhealthy``
        each carries NVIDIA's ``unmonitored`` taint (the slices only: prepare refuses nothing)."""
        if self.loop.publisher.taint:
            self.loop.health({u: f"unmonitored ({why})" for g in inv.gpus for u in (g.uuid, *(m.uuid for m in g.migs))})

    def start(self, inv) -> None:
        self.publish({})
        self.monitor = health.monitor(self.config, inv, self.publish, self.say,
                                      on_unmonitored=lambda why: self.unmonitored(inv, why))
        if self.monitor is not None:
            self.task = asyncio.create_task(self.monitor.run())

    async def stop(self) -> None:
        if self.task is not None:
            await self.monitor.close(self.task)
        self.monitor = self.task = None
