"""Building, listing and removing consolidated driver volumes on the host (``nvcontainer volume``).

What goes in a volume is decided in :mod:`nvcontainer.plan.volume`; this module makes it so. The
directory is built under a temporary name beside the target and renamed into place, so a
container never sees a half-built volume, and a driver upgrade gives a new version directory
while running containers keep the old one. Files are hard links of the driver's own files (no
space, no copy time) or, across filesystems, copies. Every operation is relative to a file
descriptor of ``DIR`` opened without following symlinks, so nothing planted in ``DIR`` leads a
root process elsewhere.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat

from ..errors import NvcError, escape
from ..fs.private import open_private_dir
from ..inventory.model import Inventory
from ..plan.volume import MAX_ENTRIES, NAME, PREFIX, Entry, check_version, entries
from ..records import record


@record
class Result:
    path: str
    created: bool        # False: an identical volume for this version was already there
    copied: int = 0      # files copied because hard links were impossible


def open_base(base: str, *, create: bool) -> int:
    """An fd of ``base``: a real directory (not a symlink) owned by root, writable only by root."""
    if not base.startswith("/"):
        raise NvcError("input", f"volume directory must be absolute: {escape(base)}")
    return open_private_dir(base, "volume", create=create)


def create(base: str, inv: Inventory, groups: frozenset[str], compat32: bool) -> Result:
    """Build ``base/nvidia_<version>``; a no-op if an identical one exists, replaced atomically
    (``RENAME_EXCHANGE``) if one exists with other contents."""
    from ..fs import syscalls

    name = PREFIX + check_version(inv.driver_version)
    wanted = entries(inv, groups, compat32)
    if len(wanted) > MAX_ENTRIES:
        raise NvcError("volume", f"{len(wanted)} files (at most {MAX_ENTRIES})")
    fd = open_base(base, create=True)
    try:
        if _matches(fd, name, wanted):
            return Result(os.path.join(base, name), created=False)
        tmp = f".{name}.tmp-{os.getpid()}"
        _remove(fd, tmp)
        os.mkdir(tmp, 0o755, dir_fd=fd)
        os.chmod(tmp, 0o755, dir_fd=fd)   # the umask must not make the volume unreadable
        try:
            copied = _fill(fd, tmp, wanted)
            try:
                syscalls.renameat2(fd, tmp, fd, name, syscalls.RENAME_NOREPLACE)
            except OSError as exc:
                if exc.errno != errno.EEXIST:
                    raise
                syscalls.renameat2(fd, tmp, fd, name, syscalls.RENAME_EXCHANGE)   # tmp now holds the old one
        finally:
            _remove(fd, tmp)
        return Result(os.path.join(base, name), created=True, copied=copied)
    except OSError as exc:
        raise NvcError("volume", f"cannot build {escape(os.path.join(base, name))}: "
                                 f"{escape(exc.filename or '')}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _fill(fd: int, tmp: str, wanted: list[Entry]) -> int:
    copied = 0
    for sub in ("bin", "lib", "lib64"):
        os.mkdir(f"{tmp}/{sub}", 0o755, dir_fd=fd)
        os.chmod(f"{tmp}/{sub}", 0o755, dir_fd=fd)
    for e in wanted:
        dest = f"{tmp}/{e.path}"
        if e.target:
            os.symlink(e.target, dest, dir_fd=fd)
            continue
        try:
            os.link(e.source, dest, dst_dir_fd=fd, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            _copy(e.source, fd, dest)
            copied += 1
    return copied


def _copy(source: str, fd: int, dest: str) -> None:
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", source)
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            left = st.st_size
            while left > 0:
                n = os.sendfile(out, src, None, min(left, 1 << 30))
                if n == 0:
                    break
                left -= n
            os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o755)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(src)


def _matches(fd: int, name: str, wanted: list[Entry]) -> bool:
    """Whether ``name`` holds exactly ``wanted``: same links, same files (the same inode, or a copy
    of the same size and modification time)."""
    try:
        found = sorted(_walk(fd, name))
    except OSError:
        return False
    if found != sorted(e.path for e in wanted):
        return False
    for e in wanted:
        try:
            if e.target:
                if os.readlink(f"{name}/{e.path}", dir_fd=fd) != e.target:
                    return False
                continue
            have = os.stat(f"{name}/{e.path}", dir_fd=fd, follow_symlinks=False)
            src = os.stat(e.source, follow_symlinks=False)
        except OSError:
            return False
        same_inode = (have.st_dev, have.st_ino) == (src.st_dev, src.st_ino)
        same_copy = stat.S_ISREG(have.st_mode) and (have.st_size, have.st_mtime_ns) == (src.st_size, src.st_mtime_ns)
        if not (same_inode or same_copy):
            return False
    return True


def _walk(fd: int, name: str) -> list[str]:
    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, "not a directory", name)
    out = []
    top = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    try:
        subs = sorted(os.listdir(top))
    finally:
        os.close(top)
    if subs != ["bin", "lib", "lib64"]:
        raise OSError(errno.EINVAL, "unexpected layout", name)
    for sub in subs:
        dfd = os.open(f"{name}/{sub}", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        try:
            out += [f"{sub}/{n}" for n in os.listdir(dfd)]
        finally:
            os.close(dfd)
        if len(out) > MAX_ENTRIES:
            raise OSError(errno.E2BIG, "too many entries", name)
    return out


def _remove(fd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=fd)   # fd-relative and never follows symlinks
    else:
        os.unlink(name, dir_fd=fd)


@record
class Volume:
    version: str
    path: str
    files: int


def list_volumes(base: str) -> list[Volume]:
    """The version directories in ``base`` (none if it does not exist)."""
    if not os.path.lexists(base):
        return []
    fd = open_base(base, create=False)
    try:
        out = []
        for n in sorted(os.listdir(fd))[:MAX_ENTRIES]:
            m = re.fullmatch(NAME, n)
            if not m:
                continue
            try:
                count = len(_walk(fd, n))
            except OSError:
                continue
            out.append(Volume(m.group(1), os.path.join(base, n), count))
        return out
    finally:
        os.close(fd)


def remove(base: str, version: str) -> str:
    """Remove ``base/nvidia_<version>``: renamed away first, so no container can bind a half-removed
    one. Running containers keep their bind of it."""
    name = PREFIX + check_version(version)
    fd = open_base(base, create=False)
    try:
        gone = f".{name}.rm-{os.getpid()}"
        try:
            os.rename(name, gone, src_dir_fd=fd, dst_dir_fd=fd)
        except FileNotFoundError:
            raise NvcError("volume", f"no volume {escape(os.path.join(base, name))}") from None
        _remove(fd, gone)
        return os.path.join(base, name)
    except OSError as exc:
        raise NvcError("volume", f"cannot remove {escape(os.path.join(base, name))}: {exc.strerror}") from None
    finally:
        os.close(fd)
