"""Resolve and create paths inside a directory tree that an attacker controls.

The container rootfs comes from an untrusted image and, through shared volumes, can change
while we work on it. Every escape in SECURITY.md §2 came from resolving a path once and then
handing the *string* to another syscall, which resolved it again. Here a path is resolved
exactly once, into a file descriptor, and everything afterwards acts on that fd.

Two resolvers give the same answer:

* ``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)``: the kernel treats the root fd as "/"
  for absolute symlinks and ``..`` and refuses procfs magic links (``/proc/self/root`` and
  friends), atomically.
* a component walk for kernels without openat2 and for the functions that need to know the
  resolved names or to create directories on the way. It opens one component at a time with
  ``O_PATH|O_NOFOLLOW`` relative to a directory fd it already holds, reads symlinks itself and
  re-walks their targets from the root (absolute) or the current directory (relative). ``..``
  never reaches the kernel: the walker keeps the fd of every directory it went through and
  simply steps back to the previous one, clamping at the root. A rename racing the walk can
  therefore not move it above the root, which is the reason the kernel version retries on
  EAGAIN. Symlinks stored on procfs are refused outright, because that is where magic links
  (which jump to arbitrary host objects) live.

Nothing here follows a symlink through the kernel, opens an existing file for writing, or
creates anything through a path that has more than one component.
"""

from __future__ import annotations

import errno
import os
import stat

from . import syscalls

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:   # annotations only: collections.abc imports collections, a start's 1 ms
    from collections.abc import Callable

MAXSYMLINKS = 40  # the kernel's own limit, so both resolvers fail on the same trees
_OPENAT2_RETRIES = 128  # EAGAIN/EXDEV come from concurrent renames/mounts; same bound as pathrs
_MKDIR_RETRIES = 128  # mkdir/open ping-pong only loops while an attacker deletes our dirs
_MAX_PATH = 4096
# The deepest a walk descends. The kernel has no such limit (40 links of up to 4095 bytes can
# name some 80,000 levels), but the walker holds an fd per level and, in mkdir mode, creates a
# directory per level: without a bound the image would decide how many of both one lookup
# costs (EMFILE under a 1024-fd hook, tens of thousands of directories under a larger one).
# Real images stay far below.
MAX_DEPTH = 256

_O_PATH_NOFOLLOW = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_O_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


def _split(path: str) -> list[str]:
    """Components of ``path``; a trailing slash keeps a final "." so the previous component is
    followed and must be a directory, as the kernel does."""
    if len(os.fsencode(path)) > _MAX_PATH:
        raise OSError(errno.ENAMETOOLONG, "path too long", path)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if parts and (path.endswith("/") or path.endswith("/.")):
        parts.append(".")
    return parts


def _check_name(name: str) -> None:
    """The *_at helpers act on one directory entry; a longer path would be resolved by the
    kernel without our confinement."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"not a single path component: {name!r}")


class _Walker:
    """One in-root walk. Holds ``fds[i]``, an O_PATH fd of the directory named by
    ``names[:i]``; names past ``len(fds) - 1`` do not exist (only in ``missing_ok`` mode)."""

    def __init__(self, root_fd: int, *, missing_ok: bool = False, mkdir_mode: int | None = None,
                 before_mkdir: Callable[[int], None] | None = None):
        self.fds = [os.open(".", _O_PATH_DIR, dir_fd=root_fd)]
        self.names: list[str] = []
        self.missing_ok = missing_ok
        self.mkdir_mode = mkdir_mode
        self.before_mkdir = before_mkdir
        self.links = 0

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def _to_root(self) -> None:
        for fd in self.fds[1:]:
            os.close(fd)
        del self.fds[1:]
        self.names = []

    def _up(self) -> None:
        if not self.names:
            return  # ".." at the root stays at the root, like RESOLVE_IN_ROOT
        self.names.pop()
        if len(self.fds) > len(self.names) + 1:
            os.close(self.fds.pop())

    def _open_child(self, name: str) -> int | None:
        """O_PATH|O_NOFOLLOW fd of ``name`` in the current directory, creating a directory
        there first in mkdir mode. None when it does not exist."""
        for _ in range(_MKDIR_RETRIES):
            try:
                return os.open(name, _O_PATH_NOFOLLOW, dir_fd=self.fds[-1])
            except FileNotFoundError:
                if self.mkdir_mode is None:
                    if self.missing_ok:
                        return None
                    raise
            if self.before_mkdir is not None:
                self.before_mkdir(self.fds[-1])
            try:
                os.mkdir(name, self.mkdir_mode, dir_fd=self.fds[-1])  # mkdirat never follows
            except FileExistsError:
                pass  # somebody else made it; re-open and judge what it is
        raise OSError(errno.EAGAIN, "directory keeps disappearing", name)

    def _follow(self, link_fd: int, rest: list[str]) -> list[str]:
        self.links += 1
        if self.links > MAXSYMLINKS:
            raise OSError(errno.ELOOP, "too many levels of symbolic links", "/".join(self.names))
        if syscalls.fstatfs_type(link_fd) == syscalls.PROC_SUPER_MAGIC:
            raise OSError(errno.ELOOP, "refusing to follow a symlink on procfs", "/".join(self.names))
        target = os.readlink("", dir_fd=link_fd)  # reads the very link we inspected, no re-lookup
        if not target:
            raise OSError(errno.ENOENT, "empty symlink", "/".join(self.names))
        if target.startswith("/"):
            self._to_root()
        return _split(target) + rest

    def walk(self, path: str, *, follow_last: bool) -> int | None:
        """Resolve ``path``; return an O_PATH fd of the final object (owned by the caller), or
        None when it does not exist (missing_ok mode). ``self.names`` is the resolved path."""
        todo = _split(path)
        while todo:
            name = todo.pop(0)
            last = not todo
            if name == ".":
                continue
            if name == "..":
                self._up()
                continue
            if len(self.names) >= MAX_DEPTH:
                raise OSError(errno.ENAMETOOLONG, f"path resolves deeper than {MAX_DEPTH} directories",
                              "/".join(self.names[:4]) + "/...")
            if len(self.fds) <= len(self.names):  # below a missing component
                self.names.append(name)
                continue
            fd = self._open_child(name)
            if fd is None:
                self.names.append(name)
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISLNK(st.st_mode) and (follow_last or not last):
                    todo = self._follow(fd, todo)
                    os.close(fd)
                    continue
                if not last and not stat.S_ISDIR(st.st_mode):
                    raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), "/".join(self.names + [name]))
            except BaseException:
                os.close(fd)
                raise
            self.names.append(name)
            if last:
                return fd
            self.fds.append(fd)
        if len(self.fds) <= len(self.names):
            return None
        return os.open(".", _O_PATH_DIR, dir_fd=self.fds[-1])


def _reopen(parent_fd: int, name: str, flags: int, want: os.stat_result) -> int:
    """Open an already-resolved, non-symlink entry with real access flags and prove it is the
    object the walk found: O_NOFOLLOW stops a swapped-in symlink, the inode check stops a
    swapped-in file."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    got = os.fstat(fd)
    if (got.st_dev, got.st_ino) != (want.st_dev, want.st_ino):
        os.close(fd)
        raise OSError(errno.EAGAIN, "entry changed while it was being opened", name)
    return fd


def _open_by_walk(root_fd: int, path: str, flags: int, follow_last: bool) -> int:
    walker = _Walker(root_fd)
    try:
        fd = walker.walk(path, follow_last=follow_last)
        assert fd is not None  # missing components raise in this mode
        if flags & os.O_PATH:
            if flags & os.O_DIRECTORY and not stat.S_ISDIR(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            return fd
        try:
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                raise OSError(errno.ELOOP, "final component is a symlink", path)
            if len(walker.fds) > len(walker.names):
                # the result is a directory we ended in via "." or ".." (or the root itself)
                return _reopen(fd, ".", flags, st)
            return _reopen(walker.fds[-1], walker.names[-1], flags, st)
        finally:
            os.close(fd)
    finally:
        walker.close()


def open_in_root(root_fd: int, path: str, flags: int = os.O_PATH, *, follow_last: bool = True) -> int:
    """Open ``path`` as if ``root_fd`` were "/" and return a new close-on-exec fd.

    Safe because no lookup ever leaves the tree: absolute symlinks and ``..`` stop at the root,
    procfs magic links are refused (ELOOP), and the result is an fd, not a string that could be
    re-resolved differently later. ``follow_last=False`` returns the final symlink itself (O_PATH)
    or fails with ELOOP for other flags. Creation (O_CREAT) is not offered here: use
    :func:`mkdirs_in_root` and :func:`create_file_at`, which never open an existing file.
    """
    if not path:
        raise FileNotFoundError(errno.ENOENT, "empty path", path)  # what openat2 says too
    if flags & (os.O_CREAT | os.O_TRUNC) or flags & os.O_TMPFILE == os.O_TMPFILE:
        raise ValueError("open_in_root does not create or truncate; use mkdirs_in_root/create_file_at")
    if flags & os.O_NOFOLLOW:
        follow_last = False
    if not follow_last:
        flags |= os.O_NOFOLLOW
    if syscalls.openat2_available():
        resolve = syscalls.RESOLVE_IN_ROOT | syscalls.RESOLVE_NO_MAGICLINKS
        for _ in range(_OPENAT2_RETRIES):
            try:
                return syscalls.openat2(root_fd, path, flags, resolve)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EXDEV):
                    raise
        raise OSError(errno.EAGAIN, "path kept changing during resolution", path)
    return _open_by_walk(root_fd, path, flags & ~os.O_NOFOLLOW, follow_last)


def resolve_in_root(root: str, path: str) -> str:
    """Where ``path`` really lives inside the trusted tree ``root``, as an absolute path
    relative to ``root`` (``/usr/lib/libcuda.so.1`` → ``/usr/lib/libcuda.so.550.54.14``).

    Used for host driver trees given with ``--root``; like upstream, components that do not
    exist are accepted and kept literally, so the answer can name a file that is missing. It is
    the same confined walk as :func:`open_in_root`, so a symlink in ``root`` pointing at ``/``
    lands on ``root`` and never on the host's own files.
    """
    root_fd = os.open(root, _O_PATH_DIR)
    walker = _Walker(root_fd, missing_ok=True)
    try:
        fd = walker.walk(path, follow_last=True)
        if fd is not None:
            os.close(fd)
        return "/" + "/".join(walker.names)
    finally:
        walker.close()
        os.close(root_fd)


def mkdirs_in_root(root_fd: int, path: str, mode: int = 0o755, *,
                   before_mkdir: Callable[[int], None] | None = None) -> int:
    """``mkdir -p`` inside the root; returns an O_PATH fd of the final directory.

    Safe because each directory is created with mkdirat relative to a directory fd that the
    walk already verified, and mkdirat never follows a symlink. After EEXIST (an attacker or a
    concurrent hook) the entry is re-opened with O_NOFOLLOW and judged like any other: a
    directory is used, a symlink is resolved in-root, anything else is NotADirectoryError. The
    walk is always the component walker because it has to act between components; each step is
    already a single-component lookup, so openat2 would add nothing.

    ``before_mkdir(dir_fd)`` is called with the verified parent before each directory is
    created there; it raises (an OSError) to forbid creating anything in that directory.
    """
    walker = _Walker(root_fd, mkdir_mode=mode, before_mkdir=before_mkdir)
    try:
        fd = walker.walk(path, follow_last=True)
        assert fd is not None  # missing components are created in this mode
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        return fd
    finally:
        walker.close()


def create_file_at(dir_fd: int, name: str, mode: int) -> int:
    """Create a new regular file ``name`` in ``dir_fd`` and return it opened O_WRONLY.

    O_CREAT|O_EXCL|O_NOFOLLOW fails on anything already there (file, FIFO, device, dangling
    symlink), so the fd is always a file we just made; ``dir_fd`` may be an O_PATH fd.
    """
    _check_name(name)
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)


def mknod_at(dir_fd: int, name: str, mode: int, dev: int = 0) -> None:
    """mknodat: creates a placeholder (regular file, FIFO, device) without opening it, so
    nothing an attacker put there is ever opened; fails with EEXIST on any existing entry.
    Get an fd of the result with ``open_in_root(dir_fd, name, follow_last=False)``."""
    _check_name(name)
    os.mknod(name, mode, dev, dir_fd=dir_fd)


def symlink_at(dir_fd: int, name: str, target: str) -> None:
    """symlinkat: never follows an existing ``name`` (EEXIST instead). The target is stored,
    not resolved; readers must resolve it in-root."""
    _check_name(name)
    os.symlink(target, name, dir_fd=dir_fd)


def inspect_at(dir_fd: int, name: str) -> os.stat_result | None:
    """lstat of one entry (None if absent); never follows a symlink and never opens the entry,
    so FIFOs and device nodes in the image cannot block or act."""
    _check_name(name)
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def fd_path(fd: int) -> str:
    """What the kernel calls the object behind ``fd``; for messages and secondary checks only,
    never to be resolved again."""
    return os.readlink(f"/proc/self/fd/{fd}")
