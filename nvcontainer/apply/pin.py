"""Holding on to the container while we work on it.

A PID is only a number: the container's init can exit and the number can be reused by a host
process between our reading of ``/proc/PID`` and our use of it. So the host process pins the
process with a pidfd, opens its mount namespace, and then checks the process is still the same
one (alive, same start time). A namespace fd keeps the namespace alive on its own, so a worker
holding it can never be redirected to another process's mounts. A container that shares the
host's mount namespace is refused: "injecting" into it would mount onto the host itself. The
host is both our own namespace and that of PID 1: a runtime (and so the hook) may run in a
private namespace of its own, and a stale ``--pid`` may by then name a host process.

Anything else read through ``/proc/PID`` later must be followed by :meth:`Pinned.alive`: the
number may have been reused in between, and only a still-open pidfd proves it was not.
"""

from __future__ import annotations

import os
import select

from ..errors import NvcError
from ..fs import procstat
from ..records import record


@record(mutable=True)
class Pinned:
    pid: int
    pidfd: int
    mntns_fd: int

    def alive(self) -> bool:
        return not select.select([self.pidfd], [], [], 0)[0]

    def close(self) -> None:
        for fd in (self.mntns_fd, self.pidfd):
            try:
                os.close(fd)
            except OSError:
                pass


def parse_start_time(data: bytes) -> int | None:
    """Field 22 of a ``/proc/PID/stat`` line (:mod:`nvcontainer.fs.procstat`)."""
    return procstat.number(data, procstat.START_TIME)


def start_time(pid: int) -> int | None:
    data = procstat.read(pid)
    return None if data is None else parse_start_time(data)


def _same_namespace(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False  # e.g. no access to PID 1 in a nested setup: our own namespace still counts
    theirs = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (theirs.st_dev, theirs.st_ino)


def pin(pid: int) -> Pinned:
    before = start_time(pid)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        raise NvcError("container", f"container process {pid} is gone: {exc.strerror.lower()}") from None
    try:
        mntns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        os.close(pidfd)
        raise NvcError("container", f"cannot open /proc/{pid}/ns/mnt: {exc.strerror.lower()}") from None
    pinned = Pinned(pid, pidfd, mntns)
    if before is None or start_time(pid) != before or not pinned.alive():
        pinned.close()
        raise NvcError("container", f"container process {pid} exited during configuration")
    if _same_namespace(mntns, "/proc/self/ns/mnt") or _same_namespace(mntns, "/proc/1/ns/mnt"):
        pinned.close()
        raise NvcError("container", f"process {pid} shares the host's mount namespace: refusing to mount into it")
    return pinned
