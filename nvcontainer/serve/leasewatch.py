"""The server's watch over the leases: a pidfd per leased container's init, so a lease ends
within a poll of its container's end, not at the next request.

Why pidfds: a pidfd polls readable the moment its process exits, zombie or not, and cannot be
fooled by a reused pid (it names the process, not the number). The watch learns of new leases
from the file itself, so the leases the in-process hook and the runtime shim take are watched
too: an inotify watch of the file's directory (:mod:`..fs.dirwatch`) wakes the server the moment
the file is replaced, and nothing else does, so a node that never leases never wakes the server
for it. Where inotify cannot be had (a limit reached, the directory removed under the server)
the file is looked at on every loop turn and at least every :data:`RESCAN` seconds, and the
watch is tried again as often. At start it reconciles: leases of containers that ended while no
server ran are released, the others kept and watched.
"""

from __future__ import annotations

import os
import time

from .. import log
from ..errors import NvcError, escape
from ..fs.dirwatch import DirWatch
from ..fs.private import open_private_dir
from ..leases import liveness, store
from ..leases.grant import reconcile
from ..leases.model import PENDING_S

RESCAN = 0.5   # seconds: without inotify, a lease the in-process hook took is watched within this


class LeaseWatch:
    def __init__(self, path: str):
        self.path = path
        self.watched: dict[int, tuple[int, int]] = {}   # pidfd → (pid, start)
        self.seen: tuple | None = None
        self.pending_until: float | None = None   # when the first pending lease (pid 0) expires
        self.enabled = True
        self.dirwatch: DirWatch | None = None
        self.dirty = True          # the file may have changed since it was last looked at
        self.next_arm = 0.0        # without inotify: when to try it again (monotonic)
        self.without: str | None = None   # why there is no inotify watch, as last logged

    def start(self) -> None:
        try:
            kept, released = reconcile(self.path)
            log.info(f"leases: {kept} kept, {released} of ended containers released")
        except store.Closed as exc:
            # a file that cannot be read stays where it is (no lease is granted meanwhile): the
            # watch goes on, and reads it again once an operator has moved it aside
            log.warning(f"leases: {exc.detail}")
        except NvcError as exc:
            log.warning(f"leases not watched: {exc.detail}")
            self.enabled = False
            return
        self.arm()   # after the reconcile made the directory, before the first look at the file
        self.refresh()

    def arm(self) -> None:
        """Watch the file's directory with inotify, or say once why not (and rescan)."""
        self.next_arm = time.monotonic() + RESCAN
        directory = os.path.dirname(self.path) or "."
        try:
            dfd = open_private_dir(directory, "leases", create=False)
        except NvcError as exc:
            return self._without(exc.detail)
        try:
            self.dirwatch = DirWatch(dfd, os.path.basename(self.path))
        except OSError as exc:
            return self._without(exc.strerror)
        finally:
            os.close(dfd)
        self.dirty = True
        self.without = None
        log.info(f"leases: {escape(directory)} watched with inotify")

    def _without(self, why: str) -> None:
        if why != self.without:
            log.info(f"leases: no inotify watch ({why}): the file is looked at every {RESCAN:g} s")
            self.without = why

    def fds(self) -> list[int]:
        if not self.enabled:
            return []
        return [*self.watched, *([self.dirwatch.fileno()] if self.dirwatch else [])]

    def timeout(self) -> float | None:
        """Seconds until :meth:`refresh` must run though none of :meth:`fds` fired: None with
        inotify and no pending lease (nothing to wait for but the fds)."""
        if not self.enabled:
            return None
        waits = [] if self.dirwatch else [RESCAN]
        if self.pending_until is not None:
            waits.append(max(0.0, self.pending_until - time.time()))
        return min(waits, default=None)

    def refresh(self) -> None:
        """Watch every lease in the file (once it changed); release those already ended. With
        inotify, the file is looked at only after an event said it may have changed."""
        if not self.enabled:
            return
        if self.dirwatch is None and time.monotonic() >= self.next_arm:
            self.arm()
        if self.dirwatch is not None and not self.dirty:
            key = self.seen
        else:
            self.dirty = False
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
            log.info(f"leases: watching init {lease.pid} of container {escape(lease.container, 80)}")
        if ended:
            self.release()

    def fired(self, fd: int) -> bool:
        """``fd`` is one of ours: the directory's watch (the file is looked at on the next
        :meth:`refresh`), or a pidfd whose process exited (its leases are released)."""
        if self.dirwatch is not None and fd == self.dirwatch.fileno():
            changed, lost = self.dirwatch.drain()
            if lost:   # the directory was removed or moved: watch whatever is there now
                self.dirwatch.close()
                self.dirwatch = None
                self.next_arm = 0.0
            self.dirty = self.dirty or changed or lost
            return True
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
        self.dirty = True   # our own write: looked at now, not when its event comes
        self.refresh()

    def close(self) -> None:
        for fd in self.watched:
            os.close(fd)
        self.watched.clear()
        if self.dirwatch is not None:
            self.dirwatch.close()
            self.dirwatch = None
