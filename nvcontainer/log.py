"""The ``--debug FILE`` trace: quiet unless asked, one ``write()`` per line.

The line format is glog's, as nvidia-container-cli writes it, so existing log tooling parses it:
``<L><MMDD HH:MM:SS.micro> <pid> <file>:<line>] <message>`` with L in I/W/E.
The file is opened ``O_APPEND`` so that many concurrent hooks can share it without tearing lines.
"""

from __future__ import annotations

import os
import sys
import time

from .errors import escape

BANNER = "-- WARNING, the following logs are for debugging purposes only --\n"

_fd: int | None = None
_warnings: list[str] = []


def open_debug(path: str) -> None:
    """Start the trace in ``path``. Failure to open it is reported, not fatal."""
    global _fd
    close()
    try:
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY, 0o600)
    except OSError as exc:
        sys.stderr.write(f"nvcontainer: warning: cannot open debug log {escape(path)}: {exc.strerror}\n")
        _fd = None
        return
    os.write(_fd, BANNER.encode())


def close() -> None:
    global _fd
    if _fd is not None:
        try:
            os.close(_fd)
        except OSError:
            pass
    _fd = None


def enabled() -> bool:
    return _fd is not None


def _emit(level: str, msg: str, depth: int) -> None:
    if _fd is None:
        return
    frame = sys._getframe(depth)
    now = time.time()
    lt = time.localtime(now)
    stamp = time.strftime("%m%d %H:%M:%S", lt) + f".{int((now % 1) * 1e6):06d}"
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    line = f"{level}{stamp} {os.getpid()} {where}] {escape(msg, 4000)}\n"
    try:
        os.write(_fd, line.encode("utf-8", "backslashreplace"))
    except OSError:
        pass


def info(msg: str) -> None:
    _emit("I", msg, 2)


def warning(msg: str) -> None:
    _warnings.append(msg)
    _emit("W", msg, 2)


def warnings_since(mark: int) -> list[str]:
    """Warnings logged since ``warning_count()`` returned ``mark`` (the inventory cache stores
    what a build warned about and says it again on every hit)."""
    return _warnings[mark:]


def warning_count() -> int:
    return len(_warnings)


def fail(exc, prog: str) -> int:
    """Report an ``NvcError`` the one way every entry point does: the trace, then one line on
    stderr; returns the exit status."""
    line = exc.line(prog)
    _emit("E", line, 2)
    sys.stderr.write(line + "\n")
    return 1


def error(msg: str) -> None:
    _emit("E", msg, 2)
