"""Namespace system calls that Python 3.11's ``os`` module lacks (``os.setns`` and
``os.unshare`` arrived in 3.12), plus ``pivot_root`` and the credential calls a sandbox needs.

These change the calling process's view of the file system, so they are only ever called in a
forked worker (see :mod:`.worker`), never in the hook's own process: ``setns(CLONE_NEWNS)`` also
replaces root and cwd, after which every path the parent opened by name would silently resolve
in the container.
"""

from __future__ import annotations

import ctypes
import errno
import os

from ..fs.syscalls import CLONE_NEWNS, unshare

CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# pivot_root predates the unified syscall table, so its number differs per architecture.
_NR_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

_libc = None

__all__ = [
    "CLONE_NEWNS",
    "CLONE_NEWUTS",
    "CLONE_NEWIPC",
    "CLONE_NEWPID",
    "CLONE_NEWNET",
    "setns_mount",
    "setns",
    "fork_isolated",
    "empty_namespaces",
    "isolate",
    "unshare",
    "pivot_root",
    "clear_capabilities",
    "load",
]


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL("libc.so.6", use_errno=True)
        lib.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.setns.restype = ctypes.c_int
        lib.syscall.restype = ctypes.c_long
        lib.capset.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.capset.restype = ctypes.c_int
        _libc = lib
    return _libc


def _check(ret: int, what: str) -> None:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns_mount(fd: int) -> None:
    """Enter the mount namespace ``fd`` refers to. The kernel refuses (EINVAL) when the caller
    has more than one thread, and checks that ``fd`` really is a mount namespace."""
    setns(fd, CLONE_NEWNS)


def setns(fd: int, nstype: int) -> None:
    """Enter the namespaces ``fd`` names (a namespace file, or a pidfd and the types to take)."""
    _check(_lib().setns(fd, nstype), "setns")


def fork_isolated() -> tuple[int, int | None]:
    """``os.fork()`` into a new PID namespace, whose init the child is; returns the child's
    PID and None in the parent, 0 and a pidfd of the parent in the child: from a new PID
    namespace ``getppid()`` reads 0, so the child learns from that fd whether its parent is
    gone. The parent's namespace for children is
    switched for this one fork and back through the pidfd (setns with a pidfd: Linux 5.8)."""
    me = os.pidfd_open(os.getpid())
    try:
        unshare(CLONE_NEWPID)
        try:
            pid = os.fork()
        except BaseException:
            setns(me, CLONE_NEWPID)
            raise
        if pid:
            try:
                setns(me, CLONE_NEWPID)   # back to forking into our own namespace
            except BaseException:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise
    except BaseException:
        os.close(me)
        raise
    if pid:
        os.close(me)
        return pid, None
    return 0, me


def empty_namespaces(flags: int) -> list[tuple[int, int]]:
    """Fresh namespaces of the types in ``flags`` (network, IPC, UTS), empty and held by
    close-on-exec fds: ``[(fd, type), ...]``, for :func:`setns` to enter. A short-lived child
    makes them (this process stays in its own) and is reaped before this returns; an
    ``OSError`` says they could not be made. Entering a held network namespace costs a
    ``setns``; making one costs a loopback device, its sysctls and a deferred teardown (0.6-0.8
    ms of CPU with the IPC and UTS ones, and the kernel thread's share; docs/performance.md),
    which ``nvcontainer serve`` pays once instead of once per ldconfig sandbox
    (docs/security.md, "The ldconfig sandbox's namespaces")."""
    names = [(CLONE_NEWNET, "net"), (CLONE_NEWIPC, "ipc"), (CLONE_NEWUTS, "uts")]
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    done_r, done_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_r)
            os.close(done_w)
            unshare(flags)
            os.write(ready_w, b"1")
            os.read(done_r, 1)   # until the parent holds the namespaces (or is gone)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(done_r)
    held: list[tuple[int, int]] = []
    try:
        if os.read(ready_r, 1) != b"1":
            raise OSError(errno.EPERM, "the namespaces could not be made")
        for kind, name in names:
            if flags & kind:
                held.append((os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC), kind))
    except BaseException:
        for fd, _ in held:
            os.close(fd)
        raise
    finally:
        os.close(ready_r)
        os.close(done_w)
        os.waitpid(pid, 0)
    return held


# Held (fd, type) of empty network, IPC and UTS namespaces that :func:`isolate` enters instead
# of making new ones: set by ``nvcontainer serve`` (inherited by its children); empty elsewhere.
SANDBOX_NAMESPACES: list[tuple[int, int]] = []


def isolate(flags: int) -> None:
    """Leave for network, IPC and UTS namespaces (``flags``) apart from the host's: the held
    :data:`SANDBOX_NAMESPACES` when there are some (making them per start cost 0.6-0.8 ms of
    CPU, and the kernel's deferred teardown of each network namespace more; docs/security.md
    says why sharing them is safe), else new ones."""
    if SANDBOX_NAMESPACES:
        for fd, kind in SANDBOX_NAMESPACES:
            setns(fd, kind)
    else:
        unshare(flags)


def pivot_root(new_root: str, put_old: str) -> None:
    nr = _NR_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unsupported architecture {os.uname().machine}")
    ret = _lib().syscall(ctypes.c_long(nr), os.fsencode(new_root), os.fsencode(put_old))
    _check(ret, "pivot_root")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


# Built once, here, rather than in the forked process that uses them: making ctypes objects
# (and the array type) there costs more than the system call. Never written to.
_CAPS_HEADER = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
_CAPS_NONE = (_CapData * 2)()             # v3 takes two 32-bit halves, all zero here


def clear_capabilities() -> None:
    """Empty this thread's effective, permitted and inheritable sets in one ``capset``; the
    kernel then empties the ambient set too (it must stay within permitted and inheritable).

    One system call, where python-prctl's per-set ``limit()`` makes a read and a write per set
    plus the Python work of listing every capability; the bounding set is not touched (only
    ``PR_CAPBSET_DROP``, one capability a call, can shrink it).
    """
    _check(_lib().capset(ctypes.byref(_CAPS_HEADER), ctypes.byref(_CAPS_NONE)), "capset")


def load() -> None:
    """Load libc and resolve the functions above now. For a process about to fork workers
    that use them: each child then inherits the work instead of repeating it."""
    _lib()


def set_fs_identity(uid: int, gid: int) -> None:
    """Make this thread create files as ``uid``/``gid`` (setfsgid, then setfsuid).

    Entries created for a user-namespaced container must belong to its mapped root from the
    start: the kernel refuses to create an inode on a filesystem owned by that namespace (the
    runtime's /dev tmpfs) with an owner the namespace cannot map, so chown-after is not enough.
    setfs*id report the old value rather than an error, so the result is read back.
    """
    lib = _lib()
    lib.setfsgid(gid)
    lib.setfsuid(uid)
    if lib.setfsuid(-1) != uid or lib.setfsgid(-1) != gid:
        raise OSError(1, f"cannot switch the filesystem identity to {uid}:{gid}")
