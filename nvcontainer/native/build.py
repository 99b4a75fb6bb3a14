"""Building the native hook client (``hookclient.c``) that ``nvcontainer setup --serve`` registers.

Why a native program at all: with ``nvcontainer serve`` warm, the largest single cost left in a
served container start is the hook's interpreter starting (about 8 ms of some 30 here, see
docs/performance.md) only to pass a few fds over a socket. ``hookclient.c`` does the same in
well under a millisecond and, when no server takes the run, executes the Python hook just as
``hookclient.py`` does. Nothing else in the project is native: the work itself stays in Python.

It is built on the node, by the node's C compiler, when set-up runs, not shipped prebuilt:
the program embeds the install's interpreter path (its fallback) and the hook's option table
(``hookclient.OPTIONS``), so it always matches the code it stands in front of. Without a
compiler set-up registers ``hookclient.py`` instead; the only difference is speed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from ..hook import client as hookclient
from ..errors import NvcError, escape

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hookclient.c")
NAME = "nvcontainer-hook-client"
# The runtime shim's front (runtime.c), installed as both names.
RUNTIME_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime.c")
RUNTIME_NAMES = ("nvidia-container-runtime", "nvcontainer-runtime")
# The clean-environment front of the Python programs runtimes execute (front.c), one program
# under each of these names.
FRONT_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "front.c")
FRONT_NAMES = ("nvcontainer-hook", "nvidia-container-runtime-hook", "nvidia-container-cli")
# The first lines of every program a front starts (``python -I -S -c``): boot.py's function.
BOOT_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")
CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong")
COMPILE_TIMEOUT = 60.0


def compiler() -> str | None:
    """The C compiler set-up would use, or None. ``CC`` of the environment is not consulted:
    set-up runs as root and should not run a program named by an inherited variable."""
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
        if found:
            return found
    return None


def c_string(text: str, *, lines: bool = False) -> str:
    """A C string literal for ``text``; only printable ASCII is taken (paths of an install), and
    with ``lines`` newlines too (the boot code)."""
    if not text.isascii() or not (text.replace("\n", "") if lines else text).isprintable():
        raise NvcError("setup", f"cannot embed {escape(text)} in the native hook client")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("?", "\\?").replace("\n", "\\n") + '"'


def boot_code() -> str:
    """The Python that every front's interpreter (``-I -S -c``) runs before the program's own
    line: :mod:`boot`'s function without the module's docstring, called; its answer ("fast", or
    "site" where the install needs ``site``'s own start) left in ``_nvc_start``."""
    with open(BOOT_SOURCE, encoding="ascii") as f:
        text = f.read()
    return text[text.index("def _nvc_boot"):].rstrip() + "\n\n\n_nvc_start = _nvc_boot()\ndel _nvc_boot\n"


def boot_line() -> str:
    """:func:`boot_code` as the fronts run it: its byte code, compiled here, where the running
    interpreter's byte code is this one's (the same magic number, as for a ``.pyc``: compiling
    the source would cost a start 0.7 ms, reading the byte code 0.2); elsewhere (a wheel built
    by another Python version) ``site``'s own start, which is ``-I``'s.

    The cyclic garbage collector is off first: every program a front starts is one short run
    that leaves no cycles worth collecting, and the collector would walk the objects its
    hundred imports create again and again (1.7 ms of the 31 ms of CPU that importing the
    in-process hook's modules costs; ``hook/main.py`` turned it off only after its own imports,
    ``nvidia-container-cli`` and the runtime shim's half not at all)."""
    import marshal
    from importlib.util import MAGIC_NUMBER

    code = marshal.dumps(compile(boot_code(), "<nvcontainer boot>", "exec"))
    return ("import gc,marshal,sys\ngc.disable()\n"
            "if getattr(sys.modules.get('_frozen_importlib_external'),'MAGIC_NUMBER',0)=="
            f"bytes.fromhex('{MAGIC_NUMBER.hex()}'):\n"
            f" exec(marshal.loads(bytes.fromhex('{code.hex()}')))\n"
            "else:\n import site;site.main();_nvc_start='site'\n"
            "del gc,marshal\n")


def python_header(python: str) -> str:
    """What every front's ``nvc_config.h`` holds: the install's interpreter and the boot code."""
    return f"#define NVC_PYTHON {c_string(python)}\n#define NVC_BOOT {c_string(boot_line(), lines=True)}\n"


def config_header(python: str) -> str:
    """``nvc_config.h``: the install's interpreter and the hook's valued options."""
    valued = ", ".join(c_string(name) for name in sorted(hookclient.VALUED))
    return f"{python_header(python)}#define NVC_VALUED {valued}\n"


def runtime_header(python: str, config: str | None = None) -> str:
    """``nvc_config.h`` of the runtime front: the install's interpreter and the configuration
    file to read instead of the default ones (for a test, or an install that keeps it elsewhere)."""
    return f"{python_header(python)}#define NVC_CONFIG {c_string(config or '')}\n"


def build_runtime(dest: str, python: str, config: str | None = None, cc: str | None = None,
                  defines: tuple[str, ...] = ()) -> str:
    """Compile the runtime front (``runtime.c``) to ``dest``, as :func:`build` does the client.

    With musl's ``musl-gcc`` where the node has it (Debian's musl-tools): the front runs once
    more on every runtime call of every container, and a static musl program starts in about a
    third of the time of a static glibc one (0.12 against 0.34 ms a call, docs/performance.md)."""
    musl = shutil.which("musl-gcc", path="/usr/local/bin:/usr/bin:/bin")
    return build(dest, python, cc or musl, source=RUNTIME_SOURCE, header=runtime_header(python, config),
                 flags=tuple(f"-D{d}" for d in defines), what="runtime front")


def build_fronts(bin_dir: str, python: str = "", cc: str | None = None) -> str:
    """Compile ``front.c`` once and install it as each of :data:`FRONT_NAMES` in ``bin_dir``
    (each replaced atomically), with ``python`` embedded, or, empty, found beside the program at
    run time (a wheel does not know its venv). musl where the node has it, as the runtime front."""
    musl = shutil.which("musl-gcc", path="/usr/local/bin:/usr/bin:/bin")
    first = os.path.join(bin_dir, FRONT_NAMES[0])
    linked = build(first, python, cc or musl, source=FRONT_SOURCE,
                   header=python_header(python), what="entry front")
    with open(first, "rb") as f:
        program = f.read()
    for name in FRONT_NAMES[1:]:
        _install(program, os.path.join(bin_dir, name))
    return linked


def build_installed(bin_dir: str, python: str = "", cc: str | None = None) -> dict[str, str]:
    """The native programs a wheel installs beside the fronts, each built with ``python``
    embedded (empty: python3 beside the program, found when it runs): the runtime shim's front
    as each of :data:`RUNTIME_NAMES` and the served hook client. {name: how it was linked};
    :class:`NvcError` when one cannot be built (no compiler, or it failed)."""
    first = os.path.join(bin_dir, RUNTIME_NAMES[0])
    linked = {RUNTIME_NAMES[0]: build_runtime(first, python, cc=cc)}
    with open(first, "rb") as f:
        program = f.read()
    for name in RUNTIME_NAMES[1:]:
        _install(program, os.path.join(bin_dir, name))
        linked[name] = linked[RUNTIME_NAMES[0]]
    linked[NAME] = build(os.path.join(bin_dir, NAME), python, cc)
    return linked


def _install(program: bytes, dest: str) -> None:
    """``program`` at ``dest``, mode 0755, replacing what was there in one rename (a runtime
    that executes it meanwhile sees the old file or the new one, never half of one)."""
    staged = f"{dest}.nvcontainer-{os.getpid()}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o755)
    try:
        os.write(fd, program)
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)
    os.rename(staged, dest)


def build(dest: str, python: str, cc: str | None = None, *, source: str = SOURCE, header: str | None = None,
          flags: tuple[str, ...] = (), what: str = "hook client") -> str:
    """Compile the client to ``dest`` (replaced atomically, mode 0755); returns how it was linked.

    Static when the C library allows it: a static program needs no dynamic loader, which is
    most of a small program's start-up.
    """
    cc = cc or compiler()
    if cc is None:
        raise NvcError("setup", f"no C compiler (cc) found to build the native {what}")
    os.makedirs(os.path.dirname(dest) or ".", mode=0o755, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nvc-client-") as tmp:
        with open(os.path.join(tmp, "nvc_config.h"), "w") as f:
            f.write(header if header is not None else config_header(python))
        out = os.path.join(tmp, NAME)
        errors: list[str] = []
        for linking in (("-static",), ()):
            argv = [cc, *CFLAGS, *flags, *linking, "-I", tmp, "-o", out, source]
            try:
                res = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                                     timeout=COMPILE_TIMEOUT, env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise NvcError("setup", f"cannot run {escape(cc)}: {escape(exc)}") from None
            if res.returncode == 0:
                break
            errors = res.stderr.strip().splitlines()[-1:] or [f"exit status {res.returncode}"]
        else:
            raise NvcError("setup", f"building the native {what} failed: {escape(errors[0])}")
        with open(out, "rb") as f:
            _install(f.read(), dest)
    return "static" if linking else "dynamic"


if __name__ == "__main__":   # python -I -m nvcontainer.native.build BIN_DIR [PYTHON]: the entry fronts
    import sys

    try:
        how = build_fronts(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
    except (NvcError, OSError, IndexError) as exc:
        sys.exit(f"nvcontainer: cannot build the entry fronts: {escape(exc)}")
    sys.stderr.write(f"nvcontainer: entry fronts ({how}) in {escape(sys.argv[1])}: {', '.join(FRONT_NAMES)}\n")
