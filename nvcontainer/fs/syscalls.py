"""Thin ctypes wrappers for the Linux syscalls that Python 3.11's ``os`` module lacks.

Why ctypes and not a C extension or a third-party package: this module sits on the hook's hot
path and must import nothing outside the standard library. libc is loaded once, on first use,
so merely importing the package costs nothing.

Every wrapper raises ``OSError`` carrying the kernel's errno, exactly like the ``os`` module,
so callers handle both the same way. File descriptors returned by raw syscalls are not managed
by Python, so every fd-returning call here forces close-on-exec: a host fd leaked into a process
that later runs container code is the CVE-2024-21626 class of bug.
"""

from __future__ import annotations

import ctypes
import errno
import os

# --- constants -------------------------------------------------------------------------------

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_REMOVEDIR = 0x200
AT_NO_AUTOMOUNT = 0x800
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000

# openat2(2) struct open_how.resolve
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
RESOLVE_CACHED = 0x20

OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC

MOVE_MOUNT_F_SYMLINKS = 0x01
MOVE_MOUNT_F_AUTOMOUNTS = 0x02
MOVE_MOUNT_F_EMPTY_PATH = 0x04
MOVE_MOUNT_T_SYMLINKS = 0x10
MOVE_MOUNT_T_AUTOMOUNTS = 0x20
MOVE_MOUNT_T_EMPTY_PATH = 0x40

MOUNT_ATTR_RDONLY = 0x01
MOUNT_ATTR_NOSUID = 0x02
MOUNT_ATTR_NODEV = 0x04
MOUNT_ATTR_NOEXEC = 0x08
MOUNT_ATTR_NOSYMFOLLOW = 0x200000

FSOPEN_CLOEXEC = 0x01
FSMOUNT_CLOEXEC = 0x01

FSCONFIG_SET_FLAG = 0
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6

# mount(2) flags; MS_PRIVATE etc. double as struct mount_attr.propagation values.
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_UNBINDABLE = 1 << 17
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20

MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8

# inotify_init1(2) flags: the kernel's values are those of O_CLOEXEC and O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
IN_NONBLOCK = os.O_NONBLOCK

RENAME_NOREPLACE = 0x1
RENAME_EXCHANGE = 0x2

CLONE_NEWNS = 0x20000

# statfs(2) f_type values used to verify what an fd really points at.
PROC_SUPER_MAGIC = 0x9FA0
TMPFS_MAGIC = 0x01021994
CGROUP_SUPER_MAGIC = 0x27E0EB
CGROUP2_SUPER_MAGIC = 0x63677270
OVERLAYFS_SUPER_MAGIC = 0x794C7630
SYSFS_MAGIC = 0x62656572

# Syscall numbers. The post-5.1 syscalls share one number on every architecture; the older ones
# differ, so only the two architectures the project ships for are listed.
_NR_COMMON = {
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "openat2": 437,
    "mount_setattr": 442,
}
_NR_BY_ARCH = {
    "x86_64": {"renameat2": 316},
    "aarch64": {"renameat2": 276},
}

# Tests (and operators debugging a kernel problem) set this to exercise the openat(2) walker
# even where openat2(2) exists.
FORCE_NO_OPENAT2 = False

_libc = None
_openat2_works: bool | None = None


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL("libc.so.6", use_errno=True)
        lib.syscall.restype = ctypes.c_long
        lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        lib.mount.restype = ctypes.c_int
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.umount2.restype = ctypes.c_int
        lib.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.fstatfs.restype = ctypes.c_int
        lib.unshare.argtypes = [ctypes.c_int]
        lib.unshare.restype = ctypes.c_int
        _libc = lib
    return _libc


def _nr(name: str) -> int:
    if name in _NR_COMMON:
        return _NR_COMMON[name]
    table = _NR_BY_ARCH.get(os.uname().machine)
    if table is None:
        raise OSError(errno.ENOSYS, f"{name}: unsupported architecture {os.uname().machine}")
    return table[name]


def _path(value: str | bytes | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def _check(ret: int, what: str, path: str | bytes | None = None) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)
    return ret


def _syscall(name: str, *args) -> int:
    return _lib().syscall(ctypes.c_long(_nr(name)), *args)


def _int(value: int) -> ctypes.c_long:
    return ctypes.c_long(value)


# --- wrappers --------------------------------------------------------------------------------


def openat2(dirfd: int, path: str | bytes, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2); the kernel confines resolution according to ``resolve``."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    ret = _syscall("openat2", _int(dirfd), _path(path), ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    return _check(ret, "openat2", path)


def openat2_available() -> bool:
    """Whether openat2(2) can be used; probed once (ENOSYS on < 5.6, EPERM under some seccomp
    profiles), then cached. ``FORCE_NO_OPENAT2`` overrides the probe."""
    global _openat2_works
    if FORCE_NO_OPENAT2:
        return False
    if _openat2_works is None:
        try:
            os.close(openat2(AT_FDCWD, "/", os.O_PATH | os.O_DIRECTORY, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS))
            _openat2_works = True
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
                raise
            _openat2_works = False
    return _openat2_works


def open_tree(dirfd: int, path: str | bytes, flags: int) -> int:
    """open_tree(2); with OPEN_TREE_CLONE, a detached copy of the mount at ``path``."""
    ret = _syscall("open_tree", _int(dirfd), _path(path), ctypes.c_uint(flags | OPEN_TREE_CLOEXEC))
    return _check(ret, "open_tree", path)


def move_mount(from_dirfd: int, from_path: str | bytes, to_dirfd: int, to_path: str | bytes, flags: int) -> None:
    ret = _syscall(
        "move_mount", _int(from_dirfd), _path(from_path), _int(to_dirfd), _path(to_path), ctypes.c_uint(flags)
    )
    _check(ret, "move_mount", to_path)


def mount_setattr(
    dirfd: int, path: str | bytes, flags: int, attr_set: int, attr_clr: int = 0, propagation: int = 0
) -> None:
    attr = _MountAttr(attr_set, attr_clr, propagation, 0)
    ret = _syscall(
        "mount_setattr",
        _int(dirfd),
        _path(path),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(ret, "mount_setattr", path)


def fsopen(fsname: str, flags: int = 0) -> int:
    ret = _syscall("fsopen", _path(fsname), ctypes.c_uint(flags | FSOPEN_CLOEXEC))
    return _check(ret, "fsopen", fsname)


def fsconfig(fd: int, cmd: int, key: str | None = None, value: str | None = None, aux: int = 0) -> None:
    ret = _syscall("fsconfig", _int(fd), ctypes.c_uint(cmd), _path(key), _path(value), _int(aux))
    _check(ret, "fsconfig", key)


def fsmount(fd: int, attr_flags: int = 0) -> int:
    ret = _syscall("fsmount", _int(fd), ctypes.c_uint(FSMOUNT_CLOEXEC), ctypes.c_uint(attr_flags))
    return _check(ret, "fsmount")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """Classic mount(2). ``target`` should be ``/proc/self/fd/N`` of a verified fd."""
    ret = _lib().mount(_path(source), _path(target), _path(fstype), flags, _path(data))
    _check(ret, "mount", target)


def umount2(target: str, flags: int) -> None:
    _check(_lib().umount2(_path(target), flags), "umount2", target)


def unshare(flags: int) -> None:
    _check(_lib().unshare(flags), "unshare")


def inotify_init1(flags: int = 0) -> int:
    """inotify_init1(2): a new inotify instance, always close-on-exec."""
    return _check(_lib().inotify_init1(ctypes.c_int(flags | IN_CLOEXEC)), "inotify_init1")


def inotify_add_watch(fd: int, path: str | bytes, mask: int) -> int:
    """inotify_add_watch(2): the watch descriptor of ``path`` in instance ``fd``."""
    ret = _lib().inotify_add_watch(ctypes.c_int(fd), _path(path), ctypes.c_uint32(mask))
    return _check(ret, "inotify_add_watch", path)


def fstatfs_type(fd: int) -> int:
    """``f_type`` of the filesystem holding ``fd`` (O_PATH fds are fine).

    On every Linux ABI ``f_type`` is the first member of struct statfs and has the width of a C
    ``long``; the buffer is larger than the whole struct on all of them.
    """
    buf = ctypes.create_string_buffer(256)
    _check(_lib().fstatfs(fd, buf), "fstatfs")
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def renameat2(olddirfd: int, oldpath: str | bytes, newdirfd: int, newpath: str | bytes, flags: int) -> None:
    ret = _syscall(
        "renameat2", _int(olddirfd), _path(oldpath), _int(newdirfd), _path(newpath), ctypes.c_uint(flags)
    )
    _check(ret, "renameat2", newpath)
