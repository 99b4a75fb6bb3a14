"""One name in one directory, watched with inotify: an fd that polls readable when that file is
written, replaced, created or removed, so a resident process can sleep until it changes.

Why inotify and not a periodic ``stat``: a server that looks at a file every half second wakes
twice a second for ever on a node where the file never changes. Why a directory watch and not
one on the file: the file is replaced by a rename, which a watch on the old inode never sees,
and it may not exist yet.

The directory is watched through ``/proc/self/fd/N`` of an fd the caller opened and checked
(no symlink followed, owner and mode: :func:`.private.open_private_dir`), so the watch is on the
very inode that was checked, not on whatever the path names a moment later. The events only
say "look again": the caller rereads the file with its own bounded, checked read, so an event
it did not expect costs a read, never trust. The event fd is read in bounded chunks; what is
left keeps it readable for the next turn of the caller's loop.
"""

from __future__ import annotations

import os
import struct

from . import syscalls

IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000

# The file written in place and closed, renamed in (an atomic replace), created, removed, or
# renamed away (a reader that sets a bad file aside); the directory itself removed or moved.
MASK = IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_DELETE_SELF | IN_MOVE_SELF
LOST = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_IGNORED   # the watch no longer names the directory

_HEAD = struct.Struct("=iIII")   # struct inotify_event: wd, mask, cookie, len; then len bytes of name
READ_SIZE = 16384                # holds at least one event with the longest name (16 + 256 bytes)
MAX_READS = 4                    # per drain: a flood is read on the next turn, not all at once


def parse(data: bytes) -> list[tuple[int, int, bytes]]:
    """(wd, mask, name) of every whole event in ``data``; a torn tail is ignored. Pure."""
    events, at = [], 0
    while at + _HEAD.size <= len(data):
        wd, mask, _, size = _HEAD.unpack_from(data, at)
        at += _HEAD.size
        if at + size > len(data):
            break
        events.append((wd, mask, data[at:at + size].rstrip(b"\0")))
        at += size
    return events


def verdict(events: list[tuple[int, int, bytes]], wd: int, name: bytes) -> tuple[bool, bool]:
    """(``name`` may have changed, the watch is lost) after ``events``. A lost event queue
    (``IN_Q_OVERFLOW``) counts as a change: what it held is unknown. Pure."""
    changed = lost = False
    for ev_wd, mask, ev_name in events:
        if mask & IN_Q_OVERFLOW:
            changed = True
        elif ev_wd != wd:
            continue
        elif mask & LOST:
            changed = lost = True
        elif ev_name == name:
            changed = True
    return changed, lost


class DirWatch:
    """``name`` in the directory open as ``dfd`` (the caller keeps and closes ``dfd``).
    Raises ``OSError`` when inotify cannot be had (no inotify, a limit reached, no /proc)."""

    def __init__(self, dfd: int, name: str):
        self.name = os.fsencode(name)
        self.fd = syscalls.inotify_init1(syscalls.IN_NONBLOCK)
        try:
            self.wd = syscalls.inotify_add_watch(self.fd, f"/proc/self/fd/{dfd}", MASK | IN_ONLYDIR)
        except OSError:
            os.close(self.fd)
            raise

    def fileno(self) -> int:
        return self.fd

    def drain(self) -> tuple[bool, bool]:
        """Read what is queued (bounded): (the file may have changed, the watch is lost; the
        caller then closes this one and looks at the directory afresh)."""
        changed = lost = False
        for _ in range(MAX_READS):
            try:
                data = os.read(self.fd, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            more_changed, more_lost = verdict(parse(data), self.wd, self.name)
            changed, lost = changed or more_changed, lost or more_lost
        return changed, lost

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
