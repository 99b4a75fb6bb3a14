"""The GPUs' health for the DRA driver: the device plugin's watcher and rules, not a second set.

Why reuse and not a copy: what counts as unhealthy (critical XIDs but not the application ones,
``ignore-xids``, recovery after ``xid-recovery-seconds``, a lost GPU, a driver that stops
answering) must not differ between the two ways a node offers its GPUs, and the watcher is the
one process that holds NVML (a child program; this threaded process never loads it). So this is
below both plugins (:mod:`nvcontainer.health`), and so are the settings: the ``[device-plugin]``
table's health keys, read by :mod:`nvcontainer.health.settings` with the device plugin's checks.
"""

from __future__ import annotations

from ...health import settings as health_settings
from ...health.monitor import Monitor
from ...inventory.identity import parse_user
from ...inventory.model import nvml_path


def monitor(config, inv, publish, say, on_unmonitored=None):
    """A :class:`~nvcontainer.health.monitor.Monitor` calling ``publish({UUID: why})`` on
    every change of verdict, or None (said why) when health checks are off or NVML is absent.
    ``on_unmonitored(why)``: the driver's NVML has no event API (every device kept, unwatched).
    Run it with ``asyncio.create_task(m.run())``; end it with ``await m.close(task)``."""
    settings = health_settings.parse(config.device_plugin)
    if not settings.health_checks:
        say("health checks are off (device-plugin.health-checks = false): every device stays published")
        return None
    library = nvml_path(inv)
    if library is None:
        say("no NVML library in the inventory: health checks are off")
        return None
    return Monitor(inv, library, settings, parse_user(config.user), publish, lambda _topology: None, say,
                   start_timeout=config.deadline, on_unmonitored=on_unmonitored)
