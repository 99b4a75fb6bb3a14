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


def device_table(inv, allow) -> dict:
    """DRA device name → (gpu, mig) for the devices this node offers."""
    from . import names

    table = {}
    for named in names.devices(inv):
        if allow is None or allow.permits(named.gpu, named.mig):
            table[named.name] = (named.gpu, named.mig)
    return table


def run(config, *, node_name: str, cdi_root: str, registrar_dir: str, plugins_dir: str, kubeconfig: str | None,
        hook_path: str | None = None, poll: float | None = None) -> None:
    """Serve until SIGTERM/SIGINT."""
    from ..cdi import commands, generate
    from ..inventory.cache import cached_inventory
    from ..kubelet.report import Reporter
    from ..request.selection import allow_list
    from . import names

    if not node_name:
        raise NvcError("input", "--node-name (or NODE_NAME) is required: the pool this node's devices are in")
    for flag, path in (("--cdi-root", cdi_root), ("--kubelet-registrar-directory-path", registrar_dir),
                       ("--kubelet-plugins-directory-path", plugins_dir)):
        if not os.path.isabs(path):
            raise NvcError("input", f"{flag} {escape(path)}: must be an absolute path")
    os.umask(0o077)
    reporter = Reporter("dra-driver")
    reporter.take_over_logging()
    inv = cached_inventory(config)
    allow = allow_list(inv, config.allowed_devices)
    table = device_table(inv, allow)
    log.info(f"devices offered: {', '.join(table) or 'none'}")
    opts = generate.Options(hook_path=hook_path or commands.default_hook_path(), ldconfig=config.ldconfig_program(),
                            deadline=config.deadline)

    from .kubeapi import KubeApi, load_config
    api = KubeApi(load_config(kubeconfig))

    def get_claim(namespace: str, name: str, deadline: float) -> dict:
        return api.get_claim(namespace, name, deadline=deadline)

    from .agent import POLL, serve
    from .prepare import Preparer

    async def main() -> None:
        preparer = Preparer(inv, table, node_name, cdi_root, os.path.join(plugins_dir, names.DRIVER), opts,
                            get_claim, reporter.say)
        await serve(preparer, names.DRIVER, registrar_dir, plugins_dir, reporter, poll or POLL)

    try:
        asyncio.run(main())
    finally:
        api.close()
