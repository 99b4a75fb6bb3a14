"""``nvidia-container-runtime``'s Python half: what the native front (``native/runtime.c``) runs
when it cannot answer alone, with ``python -I`` and a fixed, clean environment.

The front passes the engine's argv after ``--`` and its own facts before it (the program name
for messages, the working directory the bundle is relative to, the configuration file it was
built with, if any). This program loads the configuration, picks the low-level runtime and, for
``create`` and ``run``, edits the bundle's spec (:mod:`.edit`, written back by :mod:`.bundle`);
then it hands the runtime's path back on ``--reply-fd`` and the front executes it with the
engine's argv and environment, which this process never sees. Run without ``--reply-fd`` (by
hand, or in a test), it executes the runtime itself.

A failure is one line on stderr, and the same line in the runtime's ``--log`` file in its
``--log-format`` (where containerd and Docker look for a runtime's error); nothing is written to
the bundle unless the whole edit succeeded.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .. import log
from ..config import load as configuration
from ..errors import NvcError, escape
from . import argv as runtime_argv
from . import lowlevel

PROG = "nvidia-container-runtime"
USAGE = (f"usage: python -I -m nvcontainer.runtime [--prog NAME] [--config FILE] [--cwd DIR] [--reply-fd N] "
         "-- RUNTIME-ARGS...")


def _own_options(argv: list[str]) -> tuple[dict, list[str]]:
    opts: dict = {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--":
            return opts, args
        if arg in ("--prog", "--config", "--cwd", "--reply-fd") and args:
            opts[arg[2:]] = args.pop(0)
            if arg == "--reply-fd" and not (opts["reply-fd"].isascii() and opts["reply-fd"].isdigit()):
                raise NvcError("input", f"--reply-fd: expected a file descriptor number, got {escape(opts['reply-fd'])}")
        else:
            raise NvcError("input", f"{USAGE} (got {escape(arg)})")
    raise NvcError("input", USAGE)


def hook_program(config, install_dir: str) -> str:
    """The prestart hook legacy mode adds: ``[nvidia-container-runtime-hook] path`` when set;
    else the served native client ``nvcontainer-hook-client`` where ``nvcontainer setup --serve``
    built it (beside this install's interpreter, or on the fixed PATH); else
    ``nvidia-container-runtime-hook``, looked up the same way."""
    search = f"{install_dir}:{lowlevel.SAFE_PATH}"
    if config.hook_path:
        names = (config.hook_path,)
    else:
        names = ("nvcontainer-hook-client", "nvidia-container-runtime-hook")
    for name in names:
        try:
            return lowlevel.find((name,), search)
        except NvcError:
            continue
    raise NvcError("runtime", f"no prestart hook found: {escape(' or '.join(names))} is not an executable file "
                              f"(looked in {escape(search)}; set path in [nvidia-container-runtime-hook])")


def _cdi_view(config):
    from ..cdi import check, store
    from .edit import CdiView

    specs, problems = store.scan(config.cdi_spec_dirs)
    now = check.running()

    def stale(spec_file):
        verdict = check.evaluate(spec_file, now, check.probe)
        if not verdict.stale:
            return None
        return (f"{escape(spec_file.path)} is stale: {verdict.problems[0]} (fix: nvcontainer cdi generate "
                f"--output {escape(spec_file.path)})")

    return CdiView(tuple(specs), tuple(problems), stale, check.probe)


def edit_bundle(inv: runtime_argv.Invocation, config, config_file: str | None) -> None:
    """Edit the bundle's spec for a create or run, or leave it untouched."""
    from . import bundle
    from .edit import World, edit

    def inventory():
        from ..inventory.cache import cached_inventory

        return cached_inventory(config)

    data, st = bundle.read(inv.spec_path)
    def hook():
        from .legacy import hook_entry

        return hook_entry(hook_program(config, os.path.dirname(sys.executable)), config_file, config.deadline)

    def lease(count: int, asked: str) -> tuple[int, ...]:
        from ..leases.grant import take

        return take(inventory(), config, inv.container or f"bundle-{inv.bundle}", 0, inv.bundle,
                    asked=asked, count=count).indexes

    def unlease() -> None:
        from ..leases.grant import release

        release(config, inv.container or f"bundle-{inv.bundle}")

    def binder() -> dict:
        from .legacy import hook_entry

        search = f"{os.path.dirname(sys.executable)}:{lowlevel.SAFE_PATH}"
        entry = hook_entry(lowlevel.find(("nvcontainer-hook",), search), config_file, config.deadline)
        entry["args"][-1] = "bind-lease"
        return entry

    world = World(hook=hook, inventory=inventory, cdi=lambda: _cdi_view(config), lease=lease, unlease=unlease,
                  binder=binder)
    result = edit(data, inv.bundle, config, world)
    for warning in result.warnings:
        log.warning(warning)
    log.info(f"{result.mode} mode: {result.summary}")
    if result.data is None:
        log.info(f"{inv.spec_path} left as it is")
        return
    bundle.write_back(inv.spec_path, result.data, st)
    log.info(f"{inv.spec_path} written")


def _runtime_log(options: dict, line: str) -> None:
    """The error in the runtime's ``--log`` file, as runc writes its own (JSON or logrus text)."""
    path = options.get("--log")
    if not isinstance(path, str) or not path:
        return
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if options.get("--log-format") == "json":
        text = json.dumps({"level": "error", "msg": line, "time": now}) + "\n"
    else:
        text = f"time={json.dumps(now)} level=error msg={json.dumps(line)}\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY, 0o600)
    except OSError:
        return
    try:
        os.write(fd, text.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def run(argv: list[str]) -> tuple[int, str | None]:
    """(exit status, the low-level runtime's path): one run, without the exec."""
    prog, options = PROG, {}
    try:
        opts, args = _own_options(argv)
        prog = opts.get("prog") or PROG
        invocation = runtime_argv.parse(args, opts.get("cwd") or os.getcwd())
        options = invocation.options
        config = configuration.load(opts.get("config"))
        if config.runtime_debug:
            log.open_debug(config.runtime_debug)
            for line in config.report():
                log.info(line)
            log.info(f"{prog}: {' '.join(escape(a) for a in args)}")
        runtime = lowlevel.find(config.runtimes)
        if invocation.edits_spec:
            edit_bundle(invocation, config, opts.get("config"))
        log.info(f"running {runtime}")
        return 0, runtime
    except (NvcError, OSError) as exc:   # an OSError here is a bug's: still one line, never a traceback
        line = f"{prog}: {exc}" if isinstance(exc, NvcError) else f"{prog}: runtime error: {escape(exc)}"
        log.info(line)
        sys.stderr.write(line + "\n")
        _runtime_log(options, line)
        return 1, None
    finally:
        log.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    status, runtime = run(argv)
    if status != 0 or runtime is None:
        return status
    opts, args = _own_options(argv)
    if "reply-fd" in opts:
        os.write(int(opts["reply-fd"]), runtime.encode() + b"\n")
        return 0
    os.execv(runtime, [runtime, *args])
    return 1
