"""The ldconfig sandbox: where the host's ldconfig runs against a container's files.

Everything here runs in a worker started ``isolated`` (:mod:`.worker`): init of a new PID
namespace, in new network, IPC and UTS namespaces, all taken when it was forked (for a
resident server's standby worker, ahead of the request; under the server the network, IPC and
UTS ones are the empty set it holds, docs/security.md). Once in the container's mount
namespace it leaves for a private copy, binds the rootfs as ``/`` (nosuid, nodev, every mount
below read-only), mounts a fresh procfs, covers ``/sys`` and ``/dev``, drops every capability,
sets ``no_new_privs``, rlimits, an empty environment and only the fds ldconfig needs, with the
image's ``ld.so.conf`` read by us and flattened into a file of the ``/dev`` cover
(:mod:`.ldsoconf`), library links checked for FIFOs, then the seccomp filter (:mod:`.seccomp`),
and *becomes* ldconfig: ``execve`` of the sealed copy (:mod:`.sealed`), its output going to
the worker's reply pipe. See :mod:`.ldconfig` for why each step.

Why the worker itself and not a child of it: a fork of a Python process, its first steps on
copy-on-write pages and its exit cost about as much as everything else the sandbox does
(docs/performance.md); the namespaces were the only reason for a child, and the worker can be
born in them.
"""

from __future__ import annotations

import fcntl
import os
import resource
from _signal import SIG_DFL, SIGPIPE, SIGXFSZ, signal   # signal.py's C half (no enum)

import prctl

from ..errors import NvcError, escape
from ..fs import syscalls as sc
from . import fds, ldsoconf, ns, worker
from .seccomp import Installer

MAX_SETUP_ERROR = 4096

# Set right before the seccomp filter and execve. Memory is bounded by RLIMIT_DATA (heap and
# private writable mappings: what ldconfig allocates), not by the address space: ldconfig maps
# each library whole, read-only and shared, and a CUDA image has libraries of a GiB and more,
# which RLIMIT_AS in the tens of MiB would silently drop from the cache. A cache of 5,000
# libraries needs under 8 MiB of data. The file size is over upstream's 1 MiB: a cache listing
# a few thousand libraries is larger.
DATA_LIMIT = 32 << 20
RLIMITS = (
    (resource.RLIMIT_CPU, 10),
    (resource.RLIMIT_AS, 64 << 30),
    (resource.RLIMIT_NOFILE, 64),
    (resource.RLIMIT_FSIZE, 64 << 20),
    (resource.RLIMIT_DATA, DATA_LIMIT),
)

# ldconfig's configuration: the image's, flattened by us into the /dev cover (or /sys's, for an
# image without a /dev directory); the cover is sized for ldsoconf.MAX_TOTAL.
CONF_NAME = "ld.so.conf"
_CONF_COVER_DATA = "mode=0755,size=2m,nr_inodes=16"

# Mounts that cover parts of the rootfs: read-only, nothing executable, no devices, no set-id.
_COVER_FLAGS = sc.MS_RDONLY | sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC
_TMPFS_DATA = "mode=0755,size=4k,nr_inodes=16"

# Fixed fd layout of the sandboxed process right before exec: stdout and stderr are the
# worker's reply pipe, the program is a close-on-exec memfd, and the rootfs lock (an fd of the
# sandbox's own "/") stays open in ldconfig so the lock lasts until it exits.
_FD_STDIN, _FD_STDOUT, _FD_STDERR, _FD_EXE, _FD_LOCK = 0, 1, 2, 3, 4

_SECUREBITS = (
    1 << 0  # SECBIT_NOROOT: exec as uid 0 does not grant capabilities
    | 1 << 1  # SECBIT_NOROOT_LOCKED
    | 1 << 2  # SECBIT_NO_SETUID_FIXUP: we drop capabilities explicitly instead
    | 1 << 3  # SECBIT_NO_SETUID_FIXUP_LOCKED
    | 1 << 5  # SECBIT_KEEP_CAPS_LOCKED (KEEP_CAPS stays off)
)


def enter_and_sandbox(mntns_fd: int, job) -> dict:
    """:func:`.ldconfig.run_ldconfig`'s (isolated) worker: into the container's mount
    namespace, then the sandbox."""
    try:
        ns.setns_mount(mntns_fd)
        os.close(mntns_fd)
    except OSError as exc:
        raise NvcError("ldcache", f"cannot create the ldconfig sandbox: {exc.strerror}") from None
    return sandbox(job)


def sandbox(job) -> dict:
    """In a worker started isolated, in the container's mount namespace, holding ``job.exe``
    and acting as root on the filesystem (fsuid 0: the rootfs is opened by path): become
    ldconfig in its sandbox. Returns, as the worker's answer, only if the sandbox could not be
    made (``{"setup_error", "status", "output"}``); otherwise the worker's parent gets
    ldconfig's exit status and output (:func:`.worker.output_follows`). Either is what
    :func:`.ldconfig.report` takes.

    Leaves the container's namespace for a private copy of it first, so the pivot and mounts
    below never show in the container (or, through shared propagation, on the host).
    """
    if os.getpid() != 1:   # the PID namespace, and with it the others, came with the fork
        raise NvcError("internal", "ldconfig sandbox: its worker was not started isolated")
    try:
        ns.unshare(ns.CLONE_NEWNS)
    except OSError as exc:
        raise NvcError("ldcache", f"cannot create the ldconfig sandbox: {exc.strerror}") from None
    shown: list[str] = []
    at = _At()
    try:
        _become_ldconfig(job, shown, at)
    except BaseException as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        message = f"{at.step}: {detail}" if at.step != "image" else f"image: {detail}"
        if at.raw:   # the parent reads ldconfig's output now, not an answer: say it there
            os.write(_FD_STDOUT, f"nvcontainer: {message}\n".encode("utf-8", "backslashreplace"))
            os._exit(126)
        return {"setup_error": message[:MAX_SETUP_ERROR], "status": 126, "output": "".join(shown)}
    os._exit(126)  # not reached: _become_ldconfig ends in execve or raises


class _At:
    """Where the sandbox is, for its one-line error: the step, and whether the parent was
    told that ldconfig's output follows (a failure then goes into that output)."""

    __slots__ = ("step", "raw")

    def __init__(self):
        self.step, self.raw = "start", False


def _become_ldconfig(job, shown: list[str], at: _At) -> None:
    rootfs, argv = job.rootfs, job.argv
    seccomp = Installer(job.seccomp)   # built now: nothing after the rlimits may allocate much
    # Nothing below may propagate to the container's or the host's mounts.
    at.step = "make / private"
    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)

    # A bind mount of the rootfs onto itself is a mount point pivot_root can use, and a
    # mount whose flags we may change without touching the container's. Opened O_NOFOLLOW
    # and mounted through the fd, so the path is resolved once.
    at.step = "open rootfs"
    old = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    at.step = "bind rootfs"
    sc.mount(_fdpath(old), _fdpath(old), None, sc.MS_BIND | sc.MS_REC)
    # The old fd still names the covered directory; only a new lookup sees the new mount.
    at.step = "reopen rootfs"
    root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    before, after = os.fstat(old), os.fstat(root)
    if (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino):
        raise OSError(0, "rootfs changed while it was being mounted")
    # nosuid,nodev on the rootfs and every mount below it (volumes included), keeping each
    # mount's other flags; read-only too, except the rootfs mount itself when it was
    # writable (a read-only rootfs stays read-only).
    at.step = "set nosuid,nodev,ro"
    writable = not os.fstatvfs(root).f_flag & os.ST_RDONLY
    sc.mount_setattr(root, "", sc.AT_EMPTY_PATH | sc.AT_RECURSIVE,
                     sc.MOUNT_ATTR_NOSUID | sc.MOUNT_ATTR_NODEV | sc.MOUNT_ATTR_RDONLY)
    if writable:
        at.step = "keep the rootfs writable"
        sc.mount_setattr(root, "", sc.AT_EMPTY_PATH, 0, sc.MOUNT_ATTR_RDONLY)
    at.step = "chdir rootfs"
    os.fchdir(root)

    # All covering mounts happen before pivot_root, while the namespace's own /proc still
    # provides /proc/self/fd for mounting through fds. Each target must be a real directory
    # of the rootfs (O_NOFOLLOW|O_DIRECTORY); a symlink or file there is left alone: after
    # pivot_root it can only lead to another place inside the rootfs.
    # A fresh procfs belongs to our new PID namespace: /proc/1 is this process, not the
    # host's init, and no other process is visible.
    at.step = "mount /proc"
    _mount_on_dir(root, "proc", "proc", "proc", _COVER_FLAGS, None)
    # /dev and /sys: empty tmpfs, except ldconfig's configuration (read from the image by
    # us, bounded, in-root: see ldsoconf), written into the first of them before it is
    # made read-only like the other.
    at.step = "read ld.so.conf"
    flat = ldsoconf.Flattener(root)
    conf = flat.flatten()
    # into ldconfig's output (the --debug trace); a few lines
    shown += [f"nvcontainer: {escape(line, 300)}\n" for line in flat.warnings[:16]]
    if len(flat.warnings) > 16:
        shown.append(f"nvcontainer: {len(flat.warnings) - 16} more configuration warnings\n")
    conf_path = None
    for name in ("dev", "sys"):
        at.step = f"cover /{name}"
        if conf_path is None and _cover_with_file(root, name, CONF_NAME, conf):
            conf_path = f"/{name}/{CONF_NAME}"
        else:
            _mount_on_dir(root, name, "tmpfs", "tmpfs", _COVER_FLAGS, _TMPFS_DATA)
    if conf_path is None:
        raise OSError(0, "the rootfs has neither /dev nor /sys as a directory to hold ldconfig's configuration")
    argv = [argv[0], "-f", conf_path, *argv[3:]]

    # Swap roots and drop the old one entirely: afterwards no path leads out of the rootfs.
    at.step = "pivot_root"
    ns.pivot_root(".", ".")
    at.step = "detach old root"
    sc.umount2(".", sc.MNT_DETACH)
    at.step = "chdir /"
    os.chdir("/")
    if os.getcwd() != "/":  # CVE-2024-21626: a cwd outside the new root reads "(unreachable)"
        raise OSError(0, "working directory is outside the new root")

    # Wait for any other ldconfig run on this rootfs (see the ldconfig module's docstring): the
    # lock is on the rootfs's directory, "/" here, and lasts while ldconfig holds the fd.
    at.step = "lock the rootfs"
    lock = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(lock, fcntl.LOCK_EX)

    # Fixed fd layout: everything else, including the worker's other fds, is closed.
    at.step = "arrange fds"
    _arrange_fds(lock, job.exe)

    # ldconfig opens, blocking, what a library-named link leads to: a FIFO there would hold
    # it until the deadline. Refused now, in one line (the kernel resolves in the new root,
    # with the fds ldconfig will have: /proc/self/fd/1 is its output pipe).
    at.step = "check library links"
    scanned = [os.fsencode(d) for d in argv[5:]] + ldsoconf.directories(flat.lines) + _system_dirs()
    problem = ldsoconf.blocking_link(scanned)
    if problem:
        at.step = "image"
        raise OSError(0, problem)

    # Python ignores these two; ldconfig should die of them as any program would.
    signal(SIGPIPE, SIG_DFL)
    signal(SIGXFSZ, SIG_DFL)

    # Capabilities. The securebits and the bounding set need CAP_SETPCAP and the id changes
    # CAP_SETUID/CAP_SETGID, so they come before the capability sets are emptied; clearing
    # permitted and inheritable empties the ambient set too (all three in one capset).
    at.step = "set securebits"
    prctl.set_securebits(_SECUREBITS)
    at.step = "clear bounding set"
    for cap in range(job.cap_last + 1):
        prctl.capbset_drop(cap)
    at.step = "drop groups"
    os.setgroups([])
    at.step = "set gid"
    os.setresgid(job.gid, job.gid, job.gid)
    at.step = "set uid"
    os.setresuid(job.uid, job.uid, job.uid)
    at.step = "clear capabilities"
    ns.clear_capabilities()
    at.step = "set no_new_privs"
    prctl.set_no_new_privs(True)

    # Last, as nothing after them may need more memory or another system call.
    at.step = "set rlimits"
    for which, value in RLIMITS:
        resource.setrlimit(which, (value, value))
    at.step = "install seccomp filter"
    seccomp.install()
    at.step = "execve"
    worker.output_follows()
    at.raw = True
    if shown:
        os.write(_FD_STDOUT, "".join(shown).encode("utf-8", "backslashreplace"))
    os.execve(_FD_EXE, argv, {})


def _fdpath(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _arrange_fds(lock: int, exe: int) -> None:
    """stdin (a pipe with no writer: reads give EOF), stdout and stderr (the worker's reply
    pipe), the program at 3 (close-on-exec, fine for fexecve of an ELF file) and the lock at 4
    (inherited). The sources first move above the target numbers so no dup2 overwrites one
    still needed; then the reply is told where it went, and everything else is closed."""
    stdin, stdin_w = os.pipe()
    os.close(stdin_w)
    stdin, out, exe, lock = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (stdin, worker.reply_fd(), exe, lock))
    os.dup2(stdin, _FD_STDIN)
    os.dup2(out, _FD_STDOUT)
    os.dup2(out, _FD_STDERR)
    worker.move_reply(_FD_STDOUT)
    os.dup2(exe, _FD_EXE, inheritable=False)
    os.dup2(lock, _FD_LOCK, inheritable=True)
    fds.close_fds_except([_FD_EXE, _FD_LOCK])


def _system_dirs() -> list[bytes]:
    """ldconfig's built-in directories (and the multiarch pair a Debian glibc adds)."""
    triplet = f"{os.uname().machine}-linux-gnu".encode()
    return [*ldsoconf.SYSTEM_DIRS, b"/lib/" + triplet, b"/usr/lib/" + triplet]


def _cover_with_file(root: int, name: str, filename: str, content: bytes) -> bool:
    """Cover the directory ``name`` of the rootfs with a tmpfs holding one read-only file,
    then make the tmpfs read-only; False (nothing done) when ``name`` is not a directory."""
    try:
        target = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        sc.mount("tmpfs", _fdpath(target), "tmpfs", _COVER_FLAGS & ~sc.MS_RDONLY, _CONF_COVER_DATA)
        cover = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
        try:
            fd = os.open(filename, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444,
                         dir_fd=cover)
            try:
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            sc.mount_setattr(cover, "", sc.AT_EMPTY_PATH, sc.MOUNT_ATTR_RDONLY)
        finally:
            os.close(cover)
    finally:
        os.close(target)
    return True


def _mount_on_dir(root: int, name: str, source: str, fstype: str, flags: int, data: str | None) -> None:
    try:
        target = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        sc.mount(source, _fdpath(target), fstype, flags, data)
    finally:
        os.close(target)
