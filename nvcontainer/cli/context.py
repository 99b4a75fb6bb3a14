"""What every ``nvcontainer`` subcommand shares: the configuration and inventory of this run,
and the parsing of options that more than one command takes."""

from __future__ import annotations

import sys

from .. import __version__, log
from ..errors import NvcError, escape

PROG = "nvcontainer"
CDI_DIRS_HELP = "A CDI spec directory, lowest priority first (repeatable). [default: /etc/cdi, /var/run/cdi]"


class Context:
    """The run's settings (global options over the config file), for the subcommands."""

    def __init__(self, config):
        self.config = config

    def inventory(self, refresh: bool = False):
        from ..inventory.cache import cached_inventory

        return cached_inventory(self.config, refresh=refresh)

    def allow_list(self, inv):
        """The config's ``allowed-devices`` against ``inv``; what it holds back goes to the debug
        log (info's text form is upstream's and has no place for it)."""
        from ..request.selection import allow_list, held_back

        allow = allow_list(inv, self.config.allowed_devices)
        if allow is not None:
            held = held_back(inv, allow)
            log.info("allowed-devices holds back: "
                     + (", ".join([f"GPU {g.index} ({g.uuid})" for g in held.gpus]
                                  + [f"MIG device {m.parent}:{m.index} ({m.uuid})" for m in held.migs]) or "nothing"))
            for token in allow.unknown:
                log.warning(f"allowed-devices: {escape(token)} matches no device on this node")
        return allow


def open_run(*, root, ldcache, debug, user, config_path, load_kmods, no_pivot) -> Context:
    """What the global options do before any command: the configuration (the file, then the
    options over it), the ``--debug`` trace opened, and the run's Context. ``no_pivot`` is
    accepted for nvidia-container-cli and has no effect."""
    from ..config import load as configuration

    cfg = configuration.load(config_path).with_overrides(root=root, ldcache=ldcache, debug=debug, user=user)
    if cfg.debug:
        log.open_debug(cfg.debug)
        log.info(f"running {PROG} {__version__}: {' '.join(sys.argv[1:])}")
        for line in cfg.report():
            log.info(line)
    if load_kmods:
        log.warning("--load-kmods ignored: nvcontainer does not load kernel modules")
    return Context(cfg)


def parse_imex_channels(values) -> tuple[int, ...]:
    out: dict[int, None] = {}
    for value in values:
        for token in value.split(","):
            token = token.strip()
            if not token:
                continue
            if not (token.isascii() and token.isdigit()) or len(token) > 7 or int(token) >= 1 << 20:
                raise NvcError("input", f"unsupported IMEX channel value: {escape(token)}")
            out[int(token)] = None
    return tuple(out)

