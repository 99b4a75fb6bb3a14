"""Reading a bundle's spec and writing the edited one back, whole or not at all.

Read through :mod:`..request.oci` (bounded, never through a symlink or blocking on a FIFO, the
same strict JSON as the hook). Written atomically: a new file beside it in the same directory
(``O_EXCL|O_NOFOLLOW``, a name no engine reads), with the old file's mode and owner, flushed,
then renamed over it; the directory is held by an fd throughout, so both ends name the same
place. A failure at any step removes the new file and leaves the engine's as it was.
"""

from __future__ import annotations

import os
import stat

from ..errors import NvcError, escape
from ..request import oci


def read(path: str) -> tuple[bytes, os.stat_result]:
    return oci.read_spec_file(path)


def write_back(path: str, data: bytes, old: os.stat_result) -> None:
    directory, name = os.path.split(path)
    try:
        dfd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise NvcError("input", f"cannot open {escape(directory)}: {exc.strerror}") from None
    tmp = f".{name}.nvcontainer-{os.urandom(6).hex()}"
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as exc:
            raise NvcError("input", f"cannot write in {escape(directory)}: {exc.strerror}") from None
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if os.geteuid() == 0:
                    os.fchown(fd, old.st_uid, old.st_gid)
                os.fchmod(fd, stat.S_IMODE(old.st_mode))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise NvcError("input", f"cannot write {escape(path)}: {exc.strerror}") from None
    finally:
        os.close(dfd)
