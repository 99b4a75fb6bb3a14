"""The ldconfig sandbox: where the host's ldconfig runs against a container's files.

Everything here runs in forked processes. The worker (already in the container's mount
namespace) leaves it for a private copy, takes the rootfs lock and forks the sandbox's init:
new PID, network, IPC and UTS namespaces, the rootfs as ``/`` through a private nosuid/nodev
bind, a fresh procfs, ``/sys`` and ``/dev`` covered, every mount below the rootfs read-only,
no capabilities, ``no_new_privs``, rlimits, an empty environment and only the fds it needs,
the image's ``ld.so.conf`` read by us and flattened into a file of the ``/dev`` cover
(:mod:`.ldsoconf`), library links checked for FIFOs, then the seccomp filter (:mod:`.seccomp`)
and ``execve`` of the sealed copy (:mod:`.sealed`). See :mod:`.ldconfig` for why each step.
"""

from __future__ import annotations

import fcntl
import os
import resource
import signal

import prctl

from ..errors import NvcError, escape
from ..fs import syscalls as sc
from . import ldsoconf, ns, worker
from .seccomp import Installer

MAX_OUTPUT = 64 << 10      # ldconfig output kept for the debug log and the error message
MAX_SETUP_ERROR = 4096

SANDBOX_NAMESPACES = ns.CLONE_NEWNS | ns.CLONE_NEWPID | ns.CLONE_NEWNET | ns.CLONE_NEWIPC | ns.CLONE_NEWUTS

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

# Fixed fd layout of the sandboxed process right before exec.
_FD_STDIN, _FD_STDOUT, _FD_STDERR, _FD_EXE, _FD_SETUP_ERR = 0, 1, 2, 3, 4

_SECUREBITS = (
    1 << 0  # SECBIT_NOROOT: exec as uid 0 does not grant capabilities
    | 1 << 1  # SECBIT_NOROOT_LOCKED
    | 1 << 2  # SECBIT_NO_SETUID_FIXUP: we drop capabilities explicitly instead
    | 1 << 3  # SECBIT_NO_SETUID_FIXUP_LOCKED
    | 1 << 5  # SECBIT_KEEP_CAPS_LOCKED (KEEP_CAPS stays off)
)





def enter_and_sandbox(mntns_fd: int, job) -> dict:
    """:func:`.ldconfig.run_ldconfig`'s worker: into the container's mount namespace, then the sandbox."""
    try:
        ns.setns_mount(mntns_fd)
        os.close(mntns_fd)
    except OSError as exc:
        raise NvcError("ldcache", f"cannot create the ldconfig sandbox: {exc.strerror}") from None
    return sandbox(job)


def sandbox(job) -> dict:
    """In a worker that is in the container's mount namespace and holds ``job.exe``: run
    ldconfig in its sandbox and return what :func:`report` takes. The worker must hold no other
    fd of the host's (the sandbox's init inherits everything until it arranges its fds) and
    must act as root on the filesystem (fsuid 0: the rootfs is opened and locked by path).

    Leaves the container's namespace for a private copy of it first, so the pivot and mounts
    below never show in the container (or, through shared propagation, on the host). New
    PID/net/IPC/UTS namespaces apply to the child forked next.
    """
    rootfs, exe = job.rootfs, job.exe
    try:
        ns.unshare(SANDBOX_NAMESPACES)
    except OSError as exc:
        raise NvcError("ldcache", f"cannot create the ldconfig sandbox: {exc.strerror}") from None
    _lock_rootfs(rootfs)
    # stdin: a pipe with no writer (reads give EOF) rather than a host /dev/null fd.
    stdin_r, stdin_w = os.pipe()
    os.close(stdin_w)
    out_r, out_w = os.pipe()
    # Setup errors go on a close-on-exec pipe: empty at EOF means exec succeeded.
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _sandbox_init(rootfs, job.argv, exe, job.uid, job.gid, job.cap_last, stdin_r, out_w, err_w,
                          Installer(job.seccomp))
        finally:
            os._exit(126)  # only reached if execve did not happen
    for fd in (exe, stdin_r, out_w, err_w):
        os.close(fd)
    setup_error = _read_tail(err_r, MAX_SETUP_ERROR)
    output = _read_tail(out_r, MAX_OUTPUT)
    _, status = os.waitpid(pid, 0)
    return {
        "setup_error": setup_error.decode("utf-8", "backslashreplace"),
        "status": os.waitstatus_to_exitcode(status),
        "output": output.decode("utf-8", "backslashreplace"),
    }


def _lock_rootfs(rootfs: str) -> None:
    """Wait for any other ldconfig run on this rootfs (see the module docstring). The fd stays
    open, and the lock held, until this worker exits; it is close-on-exec and the sandbox
    closes every fd it does not need, so ldconfig never sees it."""
    try:
        fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        raise NvcError("ldcache", f"cannot lock {escape(rootfs)} for ldconfig: {exc.strerror}") from None


def _read_tail(fd: int, limit: int) -> bytes:
    """Read to EOF (a writer that is not drained would block), keeping the last ``limit`` bytes."""
    kept = bytearray()
    try:
        while chunk := os.read(fd, 65536):
            kept += chunk
            if len(kept) > limit:
                del kept[: len(kept) - limit]
    finally:
        os.close(fd)
    return bytes(kept)


# --- sandbox side (init of the new PID namespace; ends in execve or _exit) -------------------


def _sandbox_init(
    rootfs: str, argv: list[str], exe: int, uid: int, gid: int, cap_last: int, stdin: int, out: int, err: int,
    seccomp: Installer,
):
    step = "start"
    try:
        # Dies with the worker. getppid() cannot confirm the worker is alive (it is outside our
        # PID namespace, so it reads 0), but the worker's group is killed on any timeout.
        step = "set parent death signal"
        prctl.set_pdeathsig(signal.SIGKILL)

        # Nothing below may propagate to the container's or the host's mounts.
        step = "make / private"
        sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)

        # A bind mount of the rootfs onto itself is a mount point pivot_root can use, and a
        # mount whose flags we may change without touching the container's. Opened O_NOFOLLOW
        # and mounted through the fd, so the path is resolved once.
        step = "open rootfs"
        old = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        step = "bind rootfs"
        sc.mount(_fdpath(old), _fdpath(old), None, sc.MS_BIND | sc.MS_REC)
        # The old fd still names the covered directory; only a new lookup sees the new mount.
        step = "reopen rootfs"
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        before, after = os.fstat(old), os.fstat(root)
        if (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino):
            raise OSError(0, "rootfs changed while it was being mounted")
        # nosuid,nodev on the rootfs and every mount below it (volumes included), keeping each
        # mount's other flags; read-only too, except the rootfs mount itself when it was
        # writable (a read-only rootfs stays read-only).
        step = "set nosuid,nodev,ro"
        writable = not os.fstatvfs(root).f_flag & os.ST_RDONLY
        sc.mount_setattr(root, "", sc.AT_EMPTY_PATH | sc.AT_RECURSIVE,
                         sc.MOUNT_ATTR_NOSUID | sc.MOUNT_ATTR_NODEV | sc.MOUNT_ATTR_RDONLY)
        if writable:
            step = "keep the rootfs writable"
            sc.mount_setattr(root, "", sc.AT_EMPTY_PATH, 0, sc.MOUNT_ATTR_RDONLY)
        step = "chdir rootfs"
        os.fchdir(root)

        # All covering mounts happen before pivot_root, while the namespace's own /proc still
        # provides /proc/self/fd for mounting through fds. Each target must be a real directory
        # of the rootfs (O_NOFOLLOW|O_DIRECTORY); a symlink or file there is left alone: after
        # pivot_root it can only lead to another place inside the rootfs.
        # A fresh procfs belongs to our new PID namespace: /proc/1 is this process, not the
        # host's init, and no other process is visible.
        step = "mount /proc"
        _mount_on_dir(root, "proc", "proc", "proc", _COVER_FLAGS, None)
        # /dev and /sys: empty tmpfs, except ldconfig's configuration (read from the image by
        # us, bounded, in-root: see ldsoconf), written into the first of them before it is
        # made read-only like the other.
        step = "read ld.so.conf"
        flat = ldsoconf.Flattener(root)
        conf = flat.flatten()
        # into ldconfig's output (the --debug trace); a few lines: the pipe is read only later
        shown = [f"nvcontainer: {escape(line, 300)}" for line in flat.warnings[:16]]
        if len(flat.warnings) > 16:
            shown.append(f"nvcontainer: {len(flat.warnings) - 16} more configuration warnings")
        if shown:
            os.write(out, "".join(line + "\n" for line in shown).encode("utf-8", "backslashreplace"))
        conf_path = None
        for name in ("dev", "sys"):
            step = f"cover /{name}"
            if conf_path is None and _cover_with_file(root, name, CONF_NAME, conf):
                conf_path = f"/{name}/{CONF_NAME}"
            else:
                _mount_on_dir(root, name, "tmpfs", "tmpfs", _COVER_FLAGS, _TMPFS_DATA)
        if conf_path is None:
            raise OSError(0, "the rootfs has neither /dev nor /sys as a directory to hold ldconfig's configuration")
        argv = [argv[0], "-f", conf_path, *argv[3:]]

        # Swap roots and drop the old one entirely: afterwards no path leads out of the rootfs.
        step = "pivot_root"
        ns.pivot_root(".", ".")
        step = "detach old root"
        sc.umount2(".", sc.MNT_DETACH)
        step = "chdir /"
        os.chdir("/")
        if os.getcwd() != "/":  # CVE-2024-21626: a cwd outside the new root reads "(unreachable)"
            raise OSError(0, "working directory is outside the new root")

        # Fixed fd layout: everything else, including the worker's result pipe, is closed.
        step = "arrange fds"
        _arrange_fds(stdin, out, exe, err)
        err = _FD_SETUP_ERR

        # ldconfig opens, blocking, what a library-named link leads to: a FIFO there would hold
        # it until the deadline. Refused now, in one line (the kernel resolves in the new root,
        # with the fds ldconfig will have: /proc/self/fd/1 is its output pipe).
        step = "check library links"
        scanned = [os.fsencode(d) for d in argv[5:]] + ldsoconf.directories(flat.lines) + _system_dirs()
        problem = ldsoconf.blocking_link(scanned)
        if problem:
            step = "image"
            raise OSError(0, problem)

        # Python ignores these two; ldconfig should die of them as any program would.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)

        # Capabilities. The securebits and the bounding set need CAP_SETPCAP and the id changes
        # CAP_SETUID/CAP_SETGID, so they come before the capability sets are emptied; clearing
        # permitted and inheritable empties the ambient set too (all three in one capset).
        step = "set securebits"
        prctl.set_securebits(_SECUREBITS)
        step = "clear bounding set"
        for cap in range(cap_last + 1):
            prctl.capbset_drop(cap)
        step = "drop groups"
        os.setgroups([])
        step = "set gid"
        os.setresgid(gid, gid, gid)
        step = "set uid"
        os.setresuid(uid, uid, uid)
        step = "clear capabilities"
        ns.clear_capabilities()
        step = "set no_new_privs"
        prctl.set_no_new_privs(True)

        # Last, as nothing after them may need more memory or another system call.
        step = "set rlimits"
        for which, value in RLIMITS:
            resource.setrlimit(which, (value, value))
        step = "install seccomp filter"
        seccomp.install()
        step = "execve"
        os.execve(_FD_EXE, argv, {})
    except BaseException as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        message = f"{step}: {detail}" if step != "image" else f"image: {detail}"
        try:
            os.write(err, message.encode("utf-8", "backslashreplace")[:MAX_SETUP_ERROR])
        finally:
            os._exit(126)


def _fdpath(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _arrange_fds(stdin: int, out: int, exe: int, err: int) -> None:
    """stdin, stdout+stderr (one pipe), the program at 3 and the setup-error pipe at 4, both
    close-on-exec (a CLOEXEC fd is fine for fexecve of an ELF file). The sources are first
    moved above the target numbers so no dup2 overwrites one still needed."""
    stdin, out, exe, err = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (stdin, out, exe, err))
    os.dup2(stdin, _FD_STDIN)
    os.dup2(out, _FD_STDOUT)
    os.dup2(out, _FD_STDERR)
    os.dup2(exe, _FD_EXE, inheritable=False)
    os.dup2(err, _FD_SETUP_ERR, inheritable=False)
    worker.close_fds_except([_FD_EXE, _FD_SETUP_ERR])


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
