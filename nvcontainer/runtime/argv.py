"""What an engine asks of the runtime: runc's (and crun's) command line, parsed just enough to
know the command and, for ``create`` and ``run``, the bundle.

Why so little: the shim passes the argv on unchanged, so it only has to find two things in it,
and must find them as runc does. Options come before the command (global ones: ``--root``,
``--log``, ``--log-format``, ``--systemd-cgroup`` ...) and between the command and the container
id (``create --bundle DIR --pid-file F --console-socket S ID``). Go's flag package takes
``-name`` as ``--name`` and ``--name=value`` as well as ``--name value``, and stops at the
first word that is not an option. An option this table does not know is taken as a switch (no
value): runc and crun have no other valued option an engine passes. ``native/runtime.c`` parses
with the same tables (:data:`GLOBAL_VALUED`, :data:`CREATE_VALUED`); a test holds them together.
"""

from __future__ import annotations

import os

from ..records import record

# Global options that take a value: runc's, then crun's own.
GLOBAL_VALUED = ("--log", "--log-format", "--root", "--criu", "--rootless", "--log-level", "--cgroup-manager")
# Options of create and run that take a value (crun's --config/-f names the spec file in the bundle).
CREATE_VALUED = ("--bundle", "--console-socket", "--pid-file", "--preserve-fds", "--config")
ALIASES = {"-b": "--bundle", "-f": "--config"}
EDITING = ("create", "run")


@record
class Invocation:
    command: str | None                 # None: no command (runc --version, --help)
    options: dict                       # global options given, by long name (last one wins)
    bundle: str | None = None           # create/run: the bundle directory, absolute
    spec_name: str = "config.json"      # the spec's file name in the bundle (crun --config)
    container: str = ""                 # create/run: the container id (whose lease a free:N takes)

    @property
    def edits_spec(self) -> bool:
        return self.command in EDITING

    @property
    def spec_path(self) -> str | None:
        return os.path.join(self.bundle, self.spec_name) if self.bundle else None


def _name(arg: str) -> str:
    """``-root`` is ``--root`` to Go's flag package; one-letter options keep one dash."""
    if arg.startswith("--") or len(arg) <= 2:
        return arg
    return "-" + arg


def options(args: list[str], valued: tuple[str, ...]) -> tuple[dict, int]:
    """The options at the head of ``args`` (by long name) and the index of the first other word."""
    found: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return found, i + 1
        if not arg.startswith("-") or arg == "-":
            break
        name, eq, value = arg.partition("=")
        name = ALIASES.get(name) or _name(name)
        if name in valued and not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        found[name] = value if (eq or name in valued) else True
        i += 1
    return found, i


def parse(args: list[str], cwd: str) -> Invocation:
    """``args``: the runtime's arguments (argv without argv[0]); ``cwd``: its working directory,
    where runc takes a relative or missing bundle from."""
    globals_, i = options(args, GLOBAL_VALUED)
    if i >= len(args):
        return Invocation(None, globals_)
    command = args[i]
    if command not in EDITING:
        return Invocation(command, globals_)
    own, j = options(args[i + 1:], CREATE_VALUED)
    bundle = own.get("--bundle", "")
    spec_name = own.get("--config", "") or "config.json"
    container = args[i + 1 + j] if i + 1 + j < len(args) else ""
    return Invocation(command, globals_, os.path.normpath(os.path.join(cwd, str(bundle or "."))), str(spec_name),
                      container)
