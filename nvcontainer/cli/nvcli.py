"""``nvidia-container-cli``: upstream's name, which an engine may run on every container start
(containerd's ``ctr --gpus`` hook: ``nvidia-container-cli --load-kmods [--ldcache=FILE]
configure --device=IDS --compute ... --pid=PID ROOTFS``).

Why a module of its own: the operator's command line is click's, and importing click costs a
start about 30 ms, most of the command line's imports, before a line of ours runs. The argv
engines write, every value attached (``--name=value``) and nothing but ``configure``, is read
here without click, into exactly the values click would pass to :func:`.inject.configure` (a
test compares the two on generated argv). Any other argv (a separated value, a short option,
``--help``, ``--dry-run``, another command, a value click would refuse or convert) goes to the
click command line, which reads and judges it as before.
"""

from __future__ import annotations

import errno
import os
import sys

from .. import log
from ..errors import NvcError

PROG = "nvidia-container-cli"

# The options of the group and of ``configure`` (cli/main.py, cli/configure.py), as click
# passes them: name -> parameter. tests/test_hook_start.py checks these against the declarations.
GLOBAL_VALUES = {"--root": "root", "--ldcache": "ldcache", "--debug": "debug", "--user": "user",
                 "--config": "config_path"}
GLOBAL_FLAGS = {"--load-kmods": "load_kmods", "--no-pivot": "no_pivot"}
VALUES = {"--pid": "pid", "--ldconfig": "ldconfig", "--mig-config": "mig_config", "--mig-monitor": "mig_monitor",
          "--cuda-compat-mode": "cuda_compat_mode"}
REPEATED = {"--device": "devices", "--require": "requirements", "--imex-channel": "imex"}
FLAGS = {f"--{name.replace('_', '-')}": name for name in (
    "compute", "utility", "video", "graphics", "display", "ngx", "compat32", "no_cgroups", "no_devbind",
    "no_persistenced", "no_fabricmanager", "no_gsp_firmware", "no_cntlibs")}
COMPAT_MODES = ("ldconfig", "disabled")


def read_argv(args: list[str]) -> tuple[dict, dict] | None:
    """(the group's parameters, configure's) as click would pass them, for an argv of attached
    values and flags running ``configure`` (not ``--dry-run``); None for anything else."""
    group = {**dict.fromkeys(GLOBAL_VALUES.values()), **dict.fromkeys(GLOBAL_FLAGS.values(), False)}
    params: dict = {**dict.fromkeys(VALUES.values()), **dict.fromkeys(REPEATED.values(), ()),
                    **dict.fromkeys(FLAGS.values(), False), "dry_run": False, "as_json": False}
    if "configure" not in args:
        return None
    at = args.index("configure")
    for arg in args[:at]:
        name, eq, value = arg.partition("=")
        if eq and name in GLOBAL_VALUES:
            group[GLOBAL_VALUES[name]] = value
        elif arg in GLOBAL_FLAGS:
            group[GLOBAL_FLAGS[arg]] = True
        else:
            return None
    rootfs = []
    for arg in args[at + 1:]:
        name, eq, value = arg.partition("=")
        if eq and name in VALUES:
            params[VALUES[name]] = value
        elif eq and name in REPEATED:
            params[REPEATED[name]] += (value,)
        elif arg in FLAGS:
            params[FLAGS[arg]] = True
        elif arg.startswith("-"):
            return None
        else:
            rootfs.append(arg)
    pid, mode = params["pid"], params["cuda_compat_mode"]
    if len(rootfs) != 1 or (pid is not None and not (pid.isascii() and pid.isdigit())) \
            or (mode is not None and mode not in COMPAT_MODES):
        return None   # click says what is wrong, or converts as only it does
    params["pid"] = None if pid is None else int(pid)
    params["rootfs"] = rootfs[0]
    return group, params


def main_nvidia_container_cli(argv: list[str] | None = None) -> int:
    """The ``nvidia-container-cli`` drop-in: an engine's ``configure`` here, the rest by click."""
    args = list(sys.argv[1:] if argv is None else argv)
    read = None if os.environ.get("_NVIDIA_CONTAINER_CLI_COMPLETE") else read_argv(args)
    if read is None:   # (click's shell completion asks by that variable)
        from .main import main

        return main(args, prog=PROG)
    group, params = read
    try:
        from .context import open_run
        from .inject import configure

        configure(open_run(**group), **params)
    except NvcError as exc:
        return log.fail(exc, PROG)
    except (EOFError, KeyboardInterrupt):   # as click's main and ours report them
        sys.stderr.write(f"\n{PROG}: interrupted\n")
        return 1
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
        return 1   # click's exit status for a closed output
    finally:
        log.close()
    return 0
