"""Replacing a file that another program reads whole: a new file beside it, renamed over it.

Why one function: a bundle's spec that an engine runs, NFD's feature file, CDI specs, the
inventory cache, the leases and setup's files and records have the same readers' needs. The reader must never see half a file, so the text goes to a new hidden file in
the same directory (``O_EXCL|O_NOFOLLOW``: never someone else's file or a link), flushed, and a
rename puts it in place; the directory is held by an fd, so both ends of the rename name the
same place even if its path changes meanwhile; and a step that fails removes the new file, so
the old one stays as it was and nothing is left behind (a writer killed outright leaves a
hidden ``*.tmp``, which the inventory cache's pruning sweeps). ``sync=False`` for files on a
tmpfs that end with the boot (the leases, the cache), or that no one reads after a crash (a
bundle's spec: ``runtime/bundle.py``), where a flush is only a cost.
"""

from __future__ import annotations

import os


def replace_at(dfd: int, name: str, data: bytes, mode: int, owner: tuple[int, int] | None = None, *,
               sync: bool = True) -> None:
    """``name`` in the directory ``dfd`` now holds ``data`` with ``mode`` (and ``owner``, as
    uid and gid); OSError when it could not be done, with the old file untouched."""
    tmp = f".{name}.nvcontainer-{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if owner is not None:
                os.fchown(fd, *owner)
            os.fchmod(fd, mode)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:   # SIGTERM's exit too: nothing is left behind
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise


def replace(path: str, data: bytes, mode: int, *, sync: bool = True) -> None:
    """:func:`replace_at` by path: the directory is opened once (a link in its path followed, as
    a path is), so the new file and the rename are in the same one."""
    directory, name = os.path.split(os.path.abspath(path))
    dfd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        replace_at(dfd, name, data, mode, sync=sync)
    finally:
        os.close(dfd)
