"""``/proc/PID/stat``, read and split in one place: a process's state, parent and start time.

Why one reader: the pid pinning of ``configure --pid``, the leases' liveness and ``ps``'s process
tree each need a field of this line, and the line's second field is the process's own command
name (spaces, parentheses, newlines: whatever it chose), so the fields are counted from the
*last* ``)``; a reader that counted from the start would read the fields a process wrote for
itself. The read is bounded (the line is short; a hostile ``proc`` root may not be).
"""

from __future__ import annotations

import os

from .bounded import read_at_most

MAX_STAT = 4096
STATE, PPID, START_TIME = 0, 1, 19   # indexes after the command (fields 3, 4 and 22 of proc(5))


def fields(data: bytes) -> list[bytes]:
    """The fields after the command (the state first); empty when the line has no ``)``."""
    cut = data.rfind(b")")
    return [] if cut < 0 else data[cut + 1:].split()


def number(data: bytes, index: int) -> int | None:
    """Field ``index`` (after the command) as a number >= 0, or None."""
    try:
        value = int(fields(data)[index])
    except (IndexError, ValueError):
        return None
    return value if value >= 0 else None


def read(pid: int | str, proc: str = "/proc") -> bytes | None:
    """The stat line of ``pid``, None when there is no such process (or it cannot be read)."""
    try:
        fd = os.open(f"{proc}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return read_at_most(fd, MAX_STAT)[0]
    except OSError:
        return None
    finally:
        os.close(fd)
