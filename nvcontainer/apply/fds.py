"""File descriptor chores of a forked worker: which fds it keeps, and on which numbers.

Why a module of its own: every process this project forks to touch a container (a worker, a
standby worker taking its job, the ldconfig sandbox) must hold only the fds it was given, on
the numbers it expects, with stdio pointing somewhere harmless; a stray host fd inherited into
a process that enters a container is the CVE-2024-21626 class of bug. The three callers share
these few lines instead of each closing fds its own way.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import resource

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:   # annotations only: collections.abc imports collections, a start's 1 ms
    from collections.abc import Iterable

_NR_CLOSE_RANGE = 436  # the same on every architecture (post-5.1 syscall table)

# Loaded here, at import, so every forked worker inherits it instead of loading libc again.
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


def move_above(fd: int, floor: int) -> int:
    """``fd`` moved to the lowest free number at or above ``floor`` (close-on-exec)."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)
    os.close(fd)
    return new


def stdio_to_devnull(keep: list[int]) -> None:
    """Point fds 0-2 at /dev/null rather than closing them: a closed stdio number is handed to
    the next ``open()``, and a stray ``print`` would then write into that file."""
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    for fd in (0, 1, 2):
        if fd not in keep and fd != null:
            os.dup2(null, fd)
    if null > 2:
        os.close(null)


def close_fds_except(keep: Iterable[int]) -> None:
    """Close every fd from 3 up except ``keep`` (fds 0-2 are left alone)."""
    low = 3
    for fd in sorted({fd for fd in keep if fd >= 3}):
        if fd > low:
            _close_range(low, fd - 1)
        low = fd + 1
    _close_range(low, 0xFFFFFFFF)


def _close_range(first: int, last: int) -> None:
    ret = _libc.syscall(ctypes.c_long(_NR_CLOSE_RANGE), ctypes.c_uint(first), ctypes.c_uint(last), ctypes.c_uint(0))
    if ret == 0:
        return
    err = ctypes.get_errno()
    if err != errno.ENOSYS:
        raise OSError(err, f"close_range: {os.strerror(err)}")
    # Kernels before 5.9: no fd can be at or above the hard limit, so that bounds the loop.
    os.closerange(first, min(last, resource.getrlimit(resource.RLIMIT_NOFILE)[1]) + 1)
