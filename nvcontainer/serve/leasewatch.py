"""The server's watch over the leases: a pidfd per leased container's init, so a lease ends
within a poll of its container's end, not at the next request.

Why pidfds: a pidfd polls readable the moment its process exits, zombie or not, and cannot be
fooled by a reused pid (it names the process, not the number). The watch learns of new leases
from the file itself (a stat per loop turn, and at least every :data:`RESCAN` seconds), so the
leases the in-process hook takes are watched too. At start it reconciles: leases of containers
that ended while no server ran are released, the others kept and watched.
"""

from __future__ import annotations

import os
import time

from .. import log
from ..errors import NvcError
from ..leases import liveness, store
from ..leases.grant import reconcile
from ..leases.model import PENDING_S

RESCAN = 0.5   # seconds: a lease the in-process hook took is watched within this


class LeaseWatch:
    def __init__(self, path: str):
        self.path = path
        self.watched: dict[int, tuple[int, int]] = {}   # pidfd → (pid, start)
        self.seen: tuple | None = None
        self.pending_until: float | None = None   # when the first pending lease (pid 0) expires
        self.enabled = True

    def start(self) -> None:
        try:
            kept, released = reconcile(self.path)
        except NvcError as exc:
            log.warning(f"leases not watched: {exc.detail}")
            self.enabled = False
            return
        log.info(f"leases: {kept} kept, {released} of ended containers released")
        self.refresh()

    def fds(self) -> list[int]:
        return list(self.watched) if self.enabled else []

    def refresh(self) -> None:
        """Watch every lease in the file (once it changed); release those already ended."""
        if not self.enabled:
            return
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = None
        if key == self.seen:
            if self.pending_until is not None and time.time() >= self.pending_until:
                self.pending_until = None
                self.release()   # a pending lease whose init never came
            return
        self.seen = key
        try:
            leases = store.load(self.path) if key else ()
        except NvcError as exc:
            log.warning(f"leases: {exc.detail}")
            return
        pending = [x.since + PENDING_S for x in leases if x.pid == 0]
        self.pending_until = min(pending) if pending else None
        wanted = {(x.pid, x.start): x for x in leases if x.pid}
        for fd, who in list(self.watched.items()):
            if who not in wanted:
                del self.watched[fd]
                os.close(fd)
        have = set(self.watched.values())
        ended = False
        for who, lease in wanted.items():
            if who in have:
                continue
            try:
                fd = os.pidfd_open(lease.pid)
            except OSError:
                ended = True
                continue
            if not liveness.alive(lease):   # checked after the open: the fd names this very process
                os.close(fd)
                ended = True
                continue
            self.watched[fd] = who
        if ended:
            self.release()

    def fired(self, fd: int) -> bool:
        """``fd`` is one of ours and its process exited: its leases are released."""
        if fd not in self.watched:
            return False
        pid, _ = self.watched.pop(fd)
        os.close(fd)
        log.info(f"leases: init {pid} exited")
        self.release()
        return True

    def release(self) -> None:
        try:
            _, released = reconcile(self.path)
        except NvcError as exc:
            log.warning(f"leases: {exc.detail}")
            return
        if released:
            log.info(f"leases: {released} released")
        self.refresh()

    def close(self) -> None:
        for fd in self.watched:
            os.close(fd)
        self.watched.clear()
