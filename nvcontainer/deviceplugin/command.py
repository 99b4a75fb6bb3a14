"""``nvcontainer device-plugin``: from the configuration to a running node agent.

Why the order below matters: the inventory is built (or read from its cache) first, while this
process is still single-threaded, because building it may fork the NVML helper, and a fork is
only safe before gRPC starts its threads. gRPC is imported after that. Everything the plugin will
ever advertise is decided here, once: a MIG reconfiguration or a driver upgrade means restarting
the plugin (the DaemonSet does that when the node's GPU layout changes), as with NVIDIA's.
"""

from __future__ import annotations

import asyncio
import os

from .. import log
from ..errors import escape
from ..inventory import topology
from ..kubelet.report import Reporter
from . import devices, mps, settings as settings_module

def run(config, **overrides) -> None:
    """Serve until SIGTERM/SIGINT. ``overrides``: command-line values for settings keys (None:
    not given)."""
    from ..inventory.identity import parse_user
    from ..inventory.cache import cached_inventory
    from ..request.selection import allow_list, held_back

    settings = settings_module.parse(config.device_plugin).with_overrides(**overrides)
    os.umask(0o077)
    reporter = Reporter()
    reporter.take_over_logging()
    inv = cached_inventory(config)
    allow = allow_list(inv, config.allowed_devices)
    if allow is not None:
        held = held_back(inv, allow)
        log.info("allowed-devices holds back: " + (", ".join(
            [g.uuid for g in held.gpus] + [m.uuid for m in held.migs]) or "nothing"))
        for token in allow.unknown:
            log.warning(f"allowed-devices: {escape(token)} matches no device on this node")
    numa = topology.numa_nodes(settings.sysfs, inv)
    resources = devices.advertise(inv, settings, allow, numa)
    shares = mps.shares(resources, settings)
    for share in shares:
        line = mps.rounding(share)
        if line:
            reporter.say(line)

    from .agent import serve
    from ..health.monitor import Monitor, nvml_library
    from .state import PluginState

    async def main() -> None:
        state = PluginState(inv, resources, settings, topology.Topology(numa=numa))
        state.mps = {s.uuid: s for s in shares}
        monitor = None
        library = nvml_library(inv)
        if not settings.health_checks:
            reporter.say("health checks are off (health-checks = false): every device stays Healthy")
        elif library is None:
            reporter.say("no NVML library in the inventory: health checks are off")
        else:
            def publish(bad: dict) -> None:
                before = state.marks("health")
                state.set_bad(bad)
                if before != bad:
                    _say_changes(reporter, inv, before, bad)

            monitor = Monitor(inv, library, settings, parse_user(config.user), publish, state.set_topology,
                              reporter.say, numa=numa, start_timeout=config.deadline)
        mps_watch = None
        if shares:
            from . import mpshealth

            state.set_bad(mpshealth.look(shares), source="mps")    # none advertised Healthy before
            mps_watch = asyncio.create_task(mpshealth.watch(state, shares, reporter))
        try:
            await serve(state, settings.socket_dir, reporter, monitor)
        finally:
            if mps_watch is not None:
                mps_watch.cancel()

    asyncio.run(main())


def _say_changes(reporter: Reporter, inv, before: dict, after: dict) -> None:
    names = {g.uuid: f"GPU {g.index} ({g.uuid})" for g in inv.gpus}
    names.update({m.uuid: f"MIG device {g.index}:{m.index} ({m.uuid})" for g in inv.gpus for m in g.migs})
    if len(after) == len(names) and len(set(after.values())) == 1 and len(names) > 1:
        reporter.say(f"every device unhealthy: {next(iter(after.values()))}")
        return
    for uuid in names:
        if uuid in after and before.get(uuid) != after[uuid]:
            reporter.say(f"{names[uuid]} unhealthy: {after[uuid]}")
        elif uuid in before and uuid not in after:
            reporter.say(f"{names[uuid]} healthy again")
    if not after and before:
        log.info("every device healthy")

