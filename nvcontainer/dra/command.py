"""``nvcontainer dra-driver``: from the flags to a running kubelet plugin.

Why the order below matters (as for the device plugin): the inventory is built, or read from its
cache, while this process is still single-threaded, because building it may fork the NVML
helper, and a fork is only safe before gRPC and the API client start their threads. gRPC is
imported after that. The devices a claim may name are this inventory's, through the same names
the ResourceSlices publish (:mod:`names`), less what the node's ``allowed-devices`` holds back:
a claim can only be prepared for a device this node publishes.
"""

from __future__ import annotations

import asyncio
import os

from .. import log
from ..errors import NvcError, escape

DAEMON_CHECK = 10.0        # how often the claims' MPS daemons are asked whether they answer


def device_table(inv, allow) -> dict:
    """DRA device name → (gpu, mig) for the devices this node offers (those its slices publish)."""
    from .publishing.slices import offered

    return {named.name: (named.gpu, named.mig) for named in offered(inv, allow)}


def run(config, *, node_name: str, cdi_root: str, registrar_dir: str, plugins_dir: str, kubeconfig: str | None,
        hook_path: str | None = None, taint: bool = False, sysfs: str = "/sys", host_root: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT: the kubelet side (:mod:`agent`) and the slice side
    (:mod:`keeper`) in one event loop, the slice side's health verdicts and new inventories
    handed to the preparer."""
    from ..cdi import commands, generate
    from ..inventory.cache import cached_inventory
    from ..kubelet.report import Reporter
    from ..request.selection import allow_list
    from . import names

    _check(node_name, cdi_root, registrar_dir, plugins_dir)
    os.umask(0o077)
    reporter = Reporter("dra-driver")
    reporter.take_over_logging()
    inv = cached_inventory(config)

    def allow(inventory):
        return allow_list(inventory, config.allowed_devices)

    table = device_table(inv, allow(inv))
    log.info(f"devices offered: {', '.join(table) or 'none'}")
    host_root = host_root or config.root
    opts = generate.options_for(config, hook_path=hook_path or commands.default_hook_path(),
                                ldconfig=_ldconfig(config, host_root), host_root=host_root)
    api = _api(kubeconfig)

    def get_claim(namespace: str, name: str, deadline: float) -> dict:
        return api.get_claim(namespace, name, deadline=deadline)

    from .node.agent import serve
    from .publishing.keeper import keep_published
    from .node.prepare import Preparer

    async def main() -> None:
        preparer = Preparer(inv, table, node_name, cdi_root, os.path.join(plugins_dir, names.DRIVER), opts,
                            get_claim, reporter.say)

        def new_inventory(now) -> None:
            preparer.inv, preparer.table = now, device_table(now, allow(now))

        async def watch_daemons() -> None:
            while True:
                await asyncio.sleep(DAEMON_CHECK)
                await preparer.check_daemons()

        daemons = asyncio.create_task(watch_daemons())
        slices = asyncio.create_task(keep_published(
            config, api, node_name, inv, allow=allow, taint=taint, sysfs=sysfs, say=reporter.say,
            on_health=preparer.set_unhealthy, on_inventory=new_inventory))
        try:
            await serve(preparer, names.DRIVER, registrar_dir, plugins_dir, reporter)
        finally:
            slices.cancel()
            daemons.cancel()
            await asyncio.gather(slices, daemons, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        api.close()


def _ldconfig(config, host_root: str) -> str:
    """The host's ldconfig as its runtime will run it: ``/sbin/ldconfig.real`` where the host has
    it, looked for where the host's / is visible to us (the driver root when it is the host's
    /), never in this image's own filesystem."""
    from ..config.model import host_ldconfig

    if host_root == config.root:                   # run on the host: its own filesystem is ours
        return config.ldconfig_program()
    if host_root.rstrip("/") == "":
        where = config.root.rstrip("/")
        return host_ldconfig(config.ldconfig, lambda p: os.path.exists(where + p)).removeprefix("@")
    return config.ldconfig.removeprefix("@")


def remove_slices(kubeconfig: str | None, node_name: str) -> str:
    """``--remove-slices``: this node's slices deleted; the line to print."""
    from .publishing.publish import remove_slices as remove

    if not node_name:
        raise NvcError("input", "--node-name (or NODE_NAME) is required: the node whose slices are removed")
    api = _api(kubeconfig)
    try:
        return remove(api, node_name)
    finally:
        api.close()


def _api(kubeconfig: str | None):
    from .kubeapi import KubeApi, load_config

    return KubeApi(load_config(kubeconfig))


def _check(node_name: str, *paths) -> None:
    if not node_name:
        raise NvcError("input", "--node-name (or NODE_NAME) is required: the pool this node's devices are in")
    flags = ("--cdi-root", "--kubelet-registrar-directory-path", "--kubelet-plugins-directory-path")
    for flag, path in zip(flags, paths):
        if not os.path.isabs(path):
            raise NvcError("input", f"{flag} {escape(path)}: must be an absolute path")
