"""Directories and locks of our own that a hostile process may race: a root directory opened
without following a symlink and checked to be ours alone, and ``flock`` waited for with a deadline.

Why here: the driver volumes (``apply/volume.py``), the inventory cache and the lease file
(``leases/store.py``) keep files that decide what containers get; each must refuse a directory
someone else could write, and none may wait on another process's lock for ever.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time

from ..errors import NvcError, escape


def open_private_dir(path: str, category: str, *, create: bool) -> int:
    """An fd of ``path``: a real directory (not a symlink), owned by this uid and writable by it
    only; made 0700 (with its parents) when missing and ``create``."""
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise NvcError(category, f"cannot create {escape(path)}: {exc.strerror}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise NvcError(category, f"cannot open {escape(path)}: {exc.strerror}") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise NvcError(category, f"{escape(path)}: must be owned by uid {os.geteuid()} and writable by it only "
                                 f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
    return fd


def flock_within(fd: int, seconds: float, first_pause: float = 0.001, longest_pause: float = 0.02) -> bool:
    """Take ``flock(LOCK_EX)`` on ``fd``, trying with growing pauses; False if ``seconds`` pass."""
    end, pause = time.monotonic() + seconds, first_pause
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if time.monotonic() >= end:
            return False
        time.sleep(pause)
        pause = min(pause * 2, longest_pause)
