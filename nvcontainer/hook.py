"""``nvcontainer-hook``: the OCI prestart hook.

The runtime runs it with the container's state on stdin, in the runtime's environment, while
the container is created but not started: every millisecond here delays every container start,
so this module imports only what the request needs (no click, no pynvml in this process, no
pyelftools). It reads the bundle's ``config.json``, decides from the image's ``NVIDIA_*``
variables, and runs the same code path as ``nvcontainer configure``.
"""

from __future__ import annotations

import gc
import sys
import time

from .hookclient import OPTIONS, forward

PROG = "nvcontainer-hook"

USAGE = f"""usage: {PROG} [--root PATH] [--ldcache FILE] [--debug FILE] [--user UID[:GID]] [--config FILE]
                        [--socket PATH] [--dry-run] prestart|poststart|poststop

Reads the OCI state on stdin and injects the GPUs the container's NVIDIA_VISIBLE_DEVICES asks for.
--dry-run prints the plan as JSON ({{"gpu": false}} when the container asks for no GPU).
--socket: where a resident `nvcontainer serve` listens (default /run/nvcontainer/hook.sock; '' for
none); when one does, it does the run, with the same result, warm.

CDI hooks (named in specs from `nvcontainer cdi generate`; see their --help):
       {PROG} create-symlinks|update-ldcache|disable-device-node-modification ...
"""
CDI_HOOKS = ("create-symlinks", "update-ldcache", "disable-device-node-modification")

# Set in a child of ``nvcontainer serve`` to the server's PID, for the trace.
SERVED_BY: int | None = None

_VALUED = {name: name[2:] for name in OPTIONS}
_SHORT = {short: name for name, short in OPTIONS.items() if short}


class Usage(Exception):
    """A usage error of the hook or one of its CDI sub-hooks; an empty message asks for the
    usage text (``--help``)."""


def usage_status(exc: Usage, usage: str) -> int:
    """What a usage error becomes: one line and exit status 2, or the usage text and 0."""
    if str(exc):
        sys.stderr.write(f"{PROG}: input error: {exc}\n")
        return 2
    sys.stdout.write(usage)
    return 0


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
    from . import config as configuration
    from . import log, oci
    from .request import request_from_env

    started = time.monotonic()  # one deadline for the whole run: NVML, mounts, cgroup, ldconfig
    cfg = configuration.load(opts.get("config")).with_overrides(
        root=opts.get("root"), ldcache=opts.get("ldcache"), debug=opts.get("debug"), user=opts.get("user"))
    if cfg.debug:
        log.open_debug(cfg.debug)
    state = oci.read_state(sys.stdin.fileno())
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
    from .configure import options_from_config, plan_for

    rootfs = state.root or spec.rootfs
    plan = plan_for(request, cfg, rootfs, state.pid, options_from_config(cfg))
    if dry_run:
        sys.stdout.write(plan.dumps())
        return 0
    from .apply.execute import apply

    apply(plan, deadline=cfg.deadline - (time.monotonic() - started))
    log.info("prestart done")
    return 0


def main(argv: list[str] | None = None, *, serve: bool = True) -> int:
    """``serve``: first offer the run to a resident ``nvcontainer serve`` (:mod:`.hookclient`);
    false in the server's own children and where the caller already asked it."""
    argv = sys.argv[1:] if argv is None else argv
    if serve and argv[-1:] == ["prestart"]:
        status = forward(argv)
        if status is not None:
            return status
    # A hook run is short and leaves no cycles worth collecting, yet the collector would walk the
    # tens of thousands of objects the imports create, again and again (about 5% of a run).
    gc.disable()
    from .errors import NvcError

    if argv and argv[0] in CDI_HOOKS:
        from .cdi_hooks import main as cdi_hook

        return cdi_hook(argv)
    try:
        opts, dry_run, stage = parse_args(argv)
    except Usage as exc:
        return usage_status(exc, USAGE)
    if stage in ("poststart", "poststop"):
        return 0
    if stage != "prestart":
        from .errors import escape

        sys.stderr.write(f"{PROG}: input error: unknown stage {escape(stage)} (prestart, poststart or poststop)\n")
        return 2
    from . import log

    try:
        return prestart(opts, dry_run)
    except NvcError as exc:
        return log.fail(exc, PROG)
    finally:
        log.close()


def main_nvidia_container_runtime_hook(argv: list[str] | None = None) -> int:
    """The ``nvidia-container-runtime-hook`` drop-in: what ``docker run --gpus`` looks up in
    PATH and runs as ``nvidia-container-runtime-hook prestart``. Upstream's single-dash flags
    (``-config FILE``, ``-debug``, ``-version``) are mapped onto ours."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mapped: list[str] = []
    while argv:
        arg = argv.pop(0)
        if arg in ("-version", "--version"):
            from . import __version__

            sys.stdout.write(f"NVIDIA Container Runtime Hook version {__version__} (nvcontainer)\n")
            return 0
        if arg in ("-debug", "--debug"):
            mapped += ["--debug", "/dev/stderr"]
        elif arg in ("-config", "--config") and argv:
            mapped += ["--config", argv.pop(0)]
        elif arg.startswith("-config="):
            mapped += ["--config", arg.split("=", 1)[1]]
        else:
            mapped.append(arg)
    return main(mapped)


if __name__ == "__main__":
    # ``python -m nvcontainer.hook``: what hookclient runs when no server took the request
    sys.exit(main(serve=False))
