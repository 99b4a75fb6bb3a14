"""Whether a lease's container still runs: its init pid, checked with its start time.

Why not ``kill -0``: an init that has exited but is not reaped yet (a zombie; a detached
container's init under a pid 1 that reaps late stays one for over a second) still answers it, and
a pid reused by an unrelated process answers it too. ``/proc/PID/stat`` says both: the state
letter (``Z`` or ``X``: gone) and the start time in clock ticks since boot, which a reused pid
does not share. Without ``nvcontainer serve`` watching pidfds, this check on the next request is
how leases end.
"""

from __future__ import annotations

import os
import time

from ..fs.bounded import read_at_most
from .model import PENDING_S, Lease, Unreadable

MAX_STAT = 4096
GONE = ("Z", "X", "x")


def stat_of(pid: int, proc: str = "/proc") -> tuple[str, int] | None:
    """(state letter, start time) of ``pid``, or None when there is no such process."""
    try:
        fd = os.open(f"{proc}/{int(pid)}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data, _ = read_at_most(fd, MAX_STAT)
    except OSError:
        return None
    finally:
        os.close(fd)
    # "pid (comm) S ppid ...": comm may hold spaces and parentheses, so split after the last ')'
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return fields[0].decode("ascii", "replace"), int(fields[19])
    except (IndexError, ValueError):
        return None


def start_time(pid: int, proc: str = "/proc") -> int | None:
    """The start time to record in a lease; None when ``pid`` is gone or already exited."""
    st = stat_of(pid, proc)
    return None if st is None or st[0] in GONE else st[1]


def alive(lease: Lease, proc: str = "/proc") -> bool:
    """The lease's init still runs: same pid, same start time, not a zombie. A pending lease
    (pid 0: the create has not started the init yet) lives :data:`PENDING_S` seconds."""
    if lease.pid == 0:
        return 0 <= time.time() - lease.since < PENDING_S
    st = stat_of(lease.pid, proc)
    return st is not None and st[0] not in GONE and st[1] == lease.start


def may_run(entry: Unreadable, proc: str = "/proc") -> bool:
    """Whether an unreadable entry's container may still run: only what was salvaged of it can
    say it ended (its init gone, or a reused pid; a pending entry past its time); an entry that
    says too little holds on (fail closed)."""
    if entry.pid == 0:
        return entry.since is None or 0 <= time.time() - entry.since < PENDING_S
    if entry.pid is None:
        return True
    st = stat_of(entry.pid, proc)
    if st is None or st[0] in GONE:
        return False
    return entry.start is None or st[1] == entry.start
