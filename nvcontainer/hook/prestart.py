"""``nvcontainer-hook``: the OCI prestart hook.

The runtime runs it with the container's state on stdin, in the runtime's environment, while
the container is created but not started: every millisecond here delays every container start,
so this module imports only what the request needs (no click, no pynvml in this process, no
pyelftools). It reads the bundle's ``config.json``, decides from the image's ``NVIDIA_*``
variables, and runs the same code path as ``nvcontainer configure``.
"""

from __future__ import annotations

import sys
import time

from ..request.free import asked as leases_wanted
from .client import OPTIONS
from .usage import PROG, Usage, usage_status

USAGE = f"""usage: {PROG} [--root PATH] [--ldcache FILE] [--debug FILE] [--user UID[:GID]] [--config FILE]
                        [--socket PATH] [--dry-run] prestart|poststart|poststop|bind-lease

Reads the OCI state on stdin and injects the GPUs the container's NVIDIA_VISIBLE_DEVICES asks for.
--dry-run prints the plan as JSON ({{"gpu": false}} when the container asks for no GPU).
--socket: where a resident `nvcontainer serve` listens (default /run/nvcontainer/hook.sock; '' for
none); when one does, it does the run, with the same result, warm.
bind-lease: binds the GPUs the runtime shim leased at create (CDI mode, free:N) to the container's init.

CDI hooks (named in specs from `nvcontainer cdi generate`; see their --help):
       {PROG} create-symlinks|update-ldcache|disable-device-node-modification ...
"""

# Set in a child of ``nvcontainer serve`` to the server's PID, for the trace.
SERVED_BY: int | None = None

_VALUED = {name: name[2:] for name in OPTIONS}
_SHORT = {short: name for name, short in OPTIONS.items() if short}


def parse_args(argv: list[str]) -> tuple[dict, bool, str]:
    """Global options (before the stage word, like the CLI), ``--dry-run``, and the stage."""
    opts: dict = {}
    dry_run = False
    args = list(argv)
    while args:
        arg = args.pop(0)
        name, eq, value = arg.partition("=")
        name = _SHORT.get(name, name)
        if name in _VALUED:
            if not eq:
                if not args:
                    raise Usage(f"{name} needs a value")
                value = args.pop(0)
            opts[_VALUED[name]] = value
        elif arg == "--dry-run":
            dry_run = True
        elif arg in ("-h", "--help"):
            raise Usage("")
        elif arg.startswith("-"):
            raise Usage(f"unknown option {arg}")
        else:
            if args:
                raise Usage(f"unexpected argument after {arg}")
            return opts, dry_run, arg
    raise Usage("missing stage (prestart, poststart or poststop)")


def prestart(opts: dict, dry_run: bool) -> int:
    from ..config import load as configuration
    from .. import log
    from ..request import oci
    from ..request.decide import request_from_env

    started = time.monotonic()  # one deadline for the whole run: NVML, mounts, cgroup, ldconfig
    cfg = configuration.load(opts.get("config")).with_overrides(
        root=opts.get("root"), ldcache=opts.get("ldcache"), debug=opts.get("debug"), user=opts.get("user"))
    if cfg.debug:
        log.open_debug(cfg.debug)
        for line in cfg.report():
            log.info(line)
    state = oci.read_state_from_stdin()
    spec = oci.read_spec(state.bundle)
    served = f" (served by nvcontainer serve, pid {SERVED_BY})" if SERVED_BY else ""
    log.info(f"prestart: pid {state.pid}, bundle {state.bundle}{served}")
    request = request_from_env(spec.environ(), cfg, privileged=spec.privileged, mounts=spec.mounts,
                               annotations=spec.annotations)
    if not request.gpu and not dry_run:
        # most containers on a shared node: done before the planning modules are even imported
        for w in request.warnings:
            log.warning(w)
        log.info("not a GPU container")
        return 0
    from ..plan.gather import options_from_config, plan_for

    rootfs = state.root or spec.rootfs
    leased = inventory = None
    if dry_run and leases_wanted(request.devices):
        from ..inventory.cache import cached_inventory
        from ..leases.grant import preview

        inventory = cached_inventory(cfg)
        request = preview(request, inventory, cfg)
    elif not dry_run and (cfg.exclusive_gpus or leases_wanted(request.devices)):
        from ..inventory.cache import cached_inventory
        from ..leases.grant import acquire

        inventory = cached_inventory(cfg)
        waited = time.monotonic()
        leased = state.id or f"pid-{state.pid}"
        request = acquire(request, inventory, cfg, leased, state.pid, state.bundle)
        started += time.monotonic() - waited   # the wait for a GPU is not the run's deadline's
    try:
        plan = plan_for(request, cfg, rootfs, state.pid, options_from_config(cfg), inventory=inventory)
        if dry_run:
            sys.stdout.write(plan.dumps())
            return 0
        from ..apply.execute import apply

        apply(plan, deadline=cfg.deadline - (time.monotonic() - started))
    except BaseException:
        if leased is not None:   # the container will not start: its GPUs are free again
            from ..leases.grant import release

            release(cfg, leased)
        raise
    log.info("prestart done")
    return 0


BIND = "bind-lease"


def bind_lease(opts: dict) -> int:
    """``bind-lease``: the hook the runtime shim adds in CDI mode to a container whose GPUs it
    leased at create (``free:N``), before the init existed: the lease is bound to the init now."""
    from ..config import load as configuration
    from .. import log
    from ..leases.grant import bind
    from ..request import oci

    cfg = configuration.load(opts.get("config")).with_overrides(debug=opts.get("debug"))
    if cfg.debug:
        log.open_debug(cfg.debug)
    state = oci.read_state_from_stdin()
    lease = bind(cfg, state.id, state.pid)
    log.info(f"bind-lease: {lease.holder() if lease else 'no pending lease'} for {state.id}")
    return 0


def run(argv: list[str]) -> int:
    """One prestart (or no-op poststart/poststop) run in this process: exit status 0, 1 with
    one line on stderr, or 2 for a usage error."""
    from ..errors import NvcError

    try:
        opts, dry_run, stage = parse_args(argv)
    except Usage as exc:
        return usage_status(exc, USAGE)
    if stage in ("poststart", "poststop"):
        return 0
    if stage not in ("prestart", BIND):
        from ..errors import escape

        sys.stderr.write(f"{PROG}: input error: unknown stage {escape(stage)} (prestart, poststart or poststop)\n")
        return 2
    from .. import log
    from ..errors import escape

    try:
        return bind_lease(opts) if stage == BIND else prestart(opts, dry_run)
    except NvcError as exc:
        return log.fail(exc, PROG)
    except Exception as exc:  # a bug of ours: still one line, never a traceback in the runtime's error
        return log.fail(NvcError("internal", f"{type(exc).__name__}: {escape(exc)}"), PROG)
    finally:
        log.close()
