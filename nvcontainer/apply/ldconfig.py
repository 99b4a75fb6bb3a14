"""Refresh the container's ``/etc/ld.so.cache`` by running the **host's** ldconfig in a sandbox.

ldconfig has to run against the container's files (its ``ld.so.conf``, its library dirs), and
those are attacker-controlled, so every step below removes one thing a hostile image could use
(SECURITY.md §1 CVE-2024-0135/0136/0137, CVE-2025-23267; §6 item 5):

* the program is the host's static ldconfig, copied into a sealed memfd while still in the host
  mount namespace: nothing from the image is ever executed, and nothing in the container can
  reach or modify the host binary through the running process (CVE-2019-5736, CVE-2024-0135).
  The copy is made once per process and kept while the host file's identity is unchanged
  (see :func:`prepare`): sealed, it cannot be changed by anyone, so a resident server's
  children can all run the one copy the server checked;
* it sees only the rootfs (pivot_root into a private bind mount of it), with nosuid/nodev, a
  fresh procfs of its own PID namespace (so ``/proc/1/root`` is the sandbox itself, not the
  host), and ``/sys`` and ``/dev`` covered by empty read-only tmpfs;
* it may write only to the rootfs's own filesystem: every mount below it is read-only in the
  sandbox, so a host directory bind-mounted into the container (a volume over ``/etc`` or a
  library directory) never gets a cache or a SONAME link written into it (SECURITY.md §6.7;
  ldconfig only warns about links it cannot make, and fails cleanly on a read-only ``/etc``);
* it has no network (new, empty net namespace), its own IPC/UTS namespaces, and is init of its
  own PID namespace, so killing it kills everything it could have started;
* it runs as the given uid/gid with no capabilities at all (bounding set cleared,
  ``SECBIT_NOROOT`` so exec as uid 0 grants none), ``no_new_privs``, an empty environment
  (CVE-2025-23266 was an image ``LD_PRELOAD``), only the fds it needs, and rlimits for CPU,
  memory, fds and file size.

There is no seccomp filter: the Python seccomp bindings are not in the project's environment.
The mount, pivot and capability drops above are done without them.

Runs on one rootfs are serialised with an exclusive ``flock`` on the rootfs directory, held by
the worker (outside the sandbox) until ldconfig exits: glibc's ldconfig writes its cache
through the fixed temporary name ``/etc/ld.so.cache~`` and replaces SONAME links with
unlink+symlink, so two containers started at once from one rootfs would otherwise break each
other's run. Only containers sharing that rootfs can hold the lock up, and the deadline bounds it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import resource
import signal
import stat
import struct
from dataclasses import dataclass

import prctl

from .. import log
from ..errors import NvcError, escape
from ..fs import syscalls as sc
from . import ns, worker

CONF = "/etc/ld.so.conf"
CACHE = "/etc/ld.so.cache"

MAX_BINARY = 64 << 20      # glibc's static ldconfig is about 1 MiB
MAX_OUTPUT = 64 << 10      # ldconfig output kept for the debug log and the error message
MAX_SETUP_ERROR = 4096
MAX_DIRS = 64
MAX_PATH = 4096
MAX_ID = 0xFFFFFFFE        # (uid_t)-1 means "unchanged" to setresuid

SANDBOX_NAMESPACES = ns.CLONE_NEWNS | ns.CLONE_NEWPID | ns.CLONE_NEWNET | ns.CLONE_NEWIPC | ns.CLONE_NEWUTS

# As upstream (REFERENCE §3.5), except the file size: a cache listing a few thousand libraries
# is well over upstream's 1 MiB.
RLIMITS = (
    (resource.RLIMIT_CPU, 10),
    (resource.RLIMIT_AS, 2 << 30),
    (resource.RLIMIT_NOFILE, 64),  # also ends include loops at once (SECURITY §3.2 item 11)
    (resource.RLIMIT_FSIZE, 64 << 20),
)

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


def run_ldconfig(
    mntns_fd: int,
    rootfs: str,
    directories: list[str],
    *,
    ldconfig_host_path: str = "/sbin/ldconfig",
    uid: int = 0,
    gid: int = 0,
    deadline: float = 20.0,
) -> None:
    """Run ``ldconfig -f /etc/ld.so.conf -C /etc/ld.so.cache DIR...`` inside the container.

    ``mntns_fd`` is an open ``/proc/PID/ns/mnt`` of the container; ``rootfs`` is the rootfs path
    as seen in that namespace (engine data: the bundle's root, not something from the image);
    ``directories`` are container paths that are always scanned, so their SONAME links get
    created. ``uid``/``gid`` are the host ids the process runs as: those owning the rootfs's
    ``/etc`` (0 for a normal image), since with no capabilities only the owner may write there.

    A worker of its own enters the namespace. The product's callers (a plan's apply, the CDI
    ``update-ldcache`` hook) already have a worker in it, the one that placed the mounts: they
    use :func:`prepare_run`, :func:`sandbox` in that worker (``execute.place_then_ldconfig``)
    and :func:`report` instead, and save a fork and a ``setns``.
    """
    job = prepare_run(rootfs, directories, ldconfig_host_path=ldconfig_host_path, uid=uid, gid=gid)
    try:
        result = worker.run(
            _enter_and_sandbox,
            mntns_fd,
            job,
            deadline=deadline,
            name="ldconfig",
            keep_fds=(mntns_fd, job.exe),
            category="ldcache",
        )
    finally:
        job.close()
    report(result, job.program)


@dataclass(frozen=True)
class Job:
    """One ldconfig run, checked and opened in the host process: what the sandbox needs and
    nothing it would have to look up itself."""

    rootfs: str
    argv: list[str]
    exe: int              # the sealed memfd (a worker must keep this fd)
    uid: int
    gid: int
    cap_last: int
    program: str          # the host path, for messages
    kept: bool            # exe is the process's kept copy, not to be closed

    def close(self) -> None:
        if not self.kept:
            os.close(self.exe)


def prepare_run(rootfs: str, directories: list[str], *, ldconfig_host_path: str = "/sbin/ldconfig",
                uid: int = 0, gid: int = 0) -> Job:
    """Check the arguments and open the program, in the host process: after a worker's
    ``setns`` "/sbin/ldconfig" would name the image's file. The caller closes the job."""
    argv = ldconfig_argv(directories)
    if not rootfs.startswith("/") or "\0" in rootfs:
        raise NvcError("ldcache", f"invalid rootfs path: {escape(rootfs)}")
    for value in (uid, gid):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
            raise NvcError("ldcache", f"invalid user or group id: {escape(value)}")
    cap_last = _cap_last_cap()
    exe, kept = _program(ldconfig_host_path)
    ns.load()  # in this process, so a server's children and our worker inherit it
    return Job(rootfs, argv, exe, uid, gid, cap_last, ldconfig_host_path, kept)


def report(result: dict, program: str) -> None:
    """In the host process, after the sandbox's worker answered: its output to the debug log,
    and ``NvcError("ldcache", ...)`` if the sandbox or ldconfig failed."""
    for line in result["output"].splitlines():
        log.info(f"ldconfig: {line}")
    problem = failure_message(result, program)
    if problem:
        raise NvcError("ldcache", problem)


def ldconfig_argv(directories: list[str]) -> list[str]:
    """The fixed command line. Directories must be absolute: one starting with ``-`` would be
    read as an option."""
    if len(directories) > MAX_DIRS:
        raise NvcError("ldcache", f"too many library directories ({len(directories)} > {MAX_DIRS})")
    for path in directories:
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > MAX_PATH:
            raise NvcError("ldcache", f"invalid library directory: {escape(path)}")
    return ["ldconfig", "-f", CONF, "-C", CACHE, *directories]


def failure_message(result: dict, program: str) -> str | None:
    """One line describing why the sandbox or ldconfig failed, or ``None`` on success."""
    if result["setup_error"]:
        return f"ldconfig sandbox setup failed: {escape(result['setup_error'], 400)}"
    status = result["status"]
    if status == 0:
        return None
    if status < 0:
        what = f"process {escape(program)} terminated with signal {-status} ({_signame(-status)})"
    else:
        what = f"process {escape(program)} failed with error code: {status}"
    text = result["output"].strip()
    # The last lines hold the fatal message; earlier ones are usually warnings.
    return f"{what}: {escape(text[-600:], 600)}" if text else what


def _signame(signo: int) -> str:
    try:
        return signal.Signals(signo).name
    except ValueError:
        return "unknown"


def static_elf_problem(data: bytes) -> str | None:
    """Why ``data`` is not a static ELF executable, or ``None`` if it is one.

    Static means no ``PT_INTERP``: a dynamic program would load its interpreter and libraries
    by path from the container's rootfs after pivot_root, i.e. run code from the image.
    """
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "not an ELF file"
    elf_class, order = data[4], data[5]
    if elf_class not in (1, 2) or order not in (1, 2):
        return "unknown ELF class or byte order"
    end = "<" if order == 1 else ">"
    if elf_class == 2:
        e_type, = struct.unpack_from(end + "H", data, 16)
        e_phoff, = struct.unpack_from(end + "Q", data, 32)
        e_phentsize, e_phnum = struct.unpack_from(end + "HH", data, 54)
        entry_fmt, min_entry = end + "I", 56
    else:
        e_type, = struct.unpack_from(end + "H", data, 16)
        e_phoff, = struct.unpack_from(end + "I", data, 28)
        e_phentsize, e_phnum = struct.unpack_from(end + "HH", data, 42)
        entry_fmt, min_entry = end + "I", 32
    if e_type not in (2, 3):  # ET_EXEC, ET_DYN (static-pie)
        return "not an executable"
    if e_phentsize < min_entry or e_phnum == 0 or e_phoff + e_phnum * e_phentsize > len(data):
        return "damaged program header table"
    types = [struct.unpack_from(entry_fmt, data, e_phoff + i * e_phentsize)[0] for i in range(e_phnum)]
    if 3 in types:  # PT_INTERP
        return "not a static executable (it has a program interpreter)"
    if 1 not in types:  # PT_LOAD
        return "has nothing to load"
    return None


# --- the program (in the caller, host mount namespace) --------------------------------------

# path -> (identity of the host file when copied, sealed memfd, (st_dev, st_ino, st_ctime_ns) of
# the memfd once sealed). Per process; a forked child inherits both the entries and the fds.
_programs: dict[str, tuple[tuple, int, tuple[int, int, int]]] = {}
_MAX_PROGRAMS = 8
_cap_last: int | None = None

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_F_SEAL_EXEC = 0x20  # Linux >= 6.3: the exec bits cannot be changed either
_EXE_MODE = 0o555    # any uid may run it (the sandbox may run as the rootfs's owner)


def prepare(program: str = "/sbin/ldconfig") -> None:
    """Copy and check the host's ldconfig now rather than on the first container.

    For a resident process that forks per request (``nvcontainer serve``): the children
    inherit the sealed copy, so each run costs one ``stat`` of the host file instead of
    reading, checking and copying about 1 MiB. Calling it again costs as little and makes a
    new copy only if the host file changed. Raises ``NvcError`` like a run would.
    """
    _program(program)
    _cap_last_cap()
    ns.load()


def _identity(st: os.stat_result) -> tuple:
    """What changes whenever the file's content can have: replacing it changes the inode,
    writing it in place changes mtime (and ctime, which nobody can set back)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _program(program: str) -> tuple[int, bool]:
    """The sealed memfd to run for ``program``, made now or kept from an earlier run, and
    whether it is kept (else the caller closes it).

    A kept copy is used only while ``program`` still stats the same and the fd still is that
    memfd, fully sealed, its metadata untouched since: a caller may have reused the number, and
    a sandboxed uid-0 ldconfig owns its memfd enough to chmod it (the exec bits only where
    ``F_SEAL_EXEC`` is missing) or give it an ACL. The seals keep its content; any such change
    moves its ctime.
    """
    kept = _programs.pop(program, None)
    if kept is not None:
        identity, fd, memfd_id = kept
        state = _kept_state(fd, memfd_id)
        if state == "intact":
            try:
                unchanged = _identity(os.stat(program)) == identity
            except OSError:
                unchanged = False
            if unchanged:
                _programs[program] = kept
                return fd, True
        if state != "gone":
            os.close(fd)
    fd, identity = _sealed_copy(program)
    if identity is None:
        return fd, False
    if len(_programs) >= _MAX_PROGRAMS:
        for _, old, old_id in _programs.values():
            if _kept_state(old, old_id) != "gone":
                os.close(old)
        _programs.clear()
    st = os.fstat(fd)
    _programs[program] = (identity, fd, (st.st_dev, st.st_ino, st.st_ctime_ns))
    return fd, True


def _kept_state(fd: int, memfd_id: tuple[int, int, int]) -> str:
    """``intact``: still the kept memfd, all seals on, mode and ctime as they were; ``spoiled``:
    the kept memfd, changed since; ``gone``: the number names another file now, which is not
    ours to close."""
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != memfd_id[:2]:
            return "gone"
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS == _SEALS
    except OSError:
        return "gone"
    untouched = st.st_ctime_ns == memfd_id[2] and stat.S_IMODE(st.st_mode) == _EXE_MODE
    return "intact" if sealed and untouched else "spoiled"


def _sealed_copy(program: str) -> tuple[int, tuple | None]:
    """A memfd holding ``program``, sealed so nobody can change it after the check, and the
    host file's identity (``None`` if the file changed while it was copied: not kept).

    The bytes go from file to memfd in the kernel (``sendfile``); the ELF check then reads the
    sealed copy, which is exactly what will run.
    """
    try:
        src = os.open(program, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise NvcError("ldcache", f"cannot open {escape(program)}: {exc.strerror}") from None
    fd = -1
    try:
        before = os.fstat(src)
        if not stat.S_ISREG(before.st_mode):
            raise NvcError("ldcache", f"{escape(program)} is not a regular file")
        if before.st_size > MAX_BINARY:
            raise NvcError("ldcache", f"{escape(program)} is larger than {MAX_BINARY} bytes")
        fd = _memfd("ldconfig")
        try:
            size = _copy(src, fd)
            after = os.fstat(src)
        except OSError as exc:
            raise NvcError("ldcache", f"cannot copy {escape(program)}: {exc.strerror}") from None
        if size > MAX_BINARY:
            raise NvcError("ldcache", f"{escape(program)} is larger than {MAX_BINARY} bytes")
        os.fchmod(fd, _EXE_MODE)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | _F_SEAL_EXEC)
        except OSError:  # EINVAL before 6.3
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        problem = _static_elf_fd_problem(fd, size)
        if problem:
            raise NvcError("ldcache", f"{escape(program)}: {problem}")
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        os.close(src)
    unchanged = _identity(before) == _identity(after) and after.st_size == size
    return fd, _identity(after) if unchanged else None


def _copy(src: int, dst: int) -> int:
    """Copy up to ``MAX_BINARY + 1`` bytes (one more says "too large"); returns the count."""
    done = 0
    try:
        while done <= MAX_BINARY and (n := os.sendfile(dst, src, done, MAX_BINARY + 1 - done)):
            done += n
        return done
    except OSError as exc:
        if done or exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    # A filesystem without splice support: through user space.
    while done <= MAX_BINARY and (chunk := os.pread(src, min(1 << 20, MAX_BINARY + 1 - done), done)):
        view = memoryview(chunk)
        while view:
            view = view[os.pwrite(dst, view, done + len(chunk) - len(view)):]
        done += len(chunk)
    return done


def _static_elf_fd_problem(fd: int, size: int) -> str | None:
    """:func:`static_elf_problem` on the memfd's content, mapped rather than read: only the
    header pages are touched."""
    if size < 64:
        return "not an ELF file"
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
        return static_elf_problem(data)


_MFD_EXEC = 0x10  # Linux >= 6.3; needed where vm.memfd_noexec=1 makes memfds non-executable


def _memfd(name: str) -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        return os.memfd_create(name, flags | _MFD_EXEC)
    except OSError:  # EINVAL before 6.3, where every memfd is executable anyway
        return os.memfd_create(name, flags)


def _cap_last_cap() -> int:
    """Highest capability this kernel knows; may exceed what python-prctl was built with.
    Fixed while the kernel runs, so read once per process."""
    global _cap_last
    if _cap_last is None:
        try:
            with open("/proc/sys/kernel/cap_last_cap", "rb") as fh:
                value = fh.read(16).strip()
        except OSError as exc:
            raise NvcError("ldcache", f"cannot read /proc/sys/kernel/cap_last_cap: {exc.strerror}") from None
        if not value.isdigit() or not 0 < int(value) < 64:
            raise NvcError("ldcache", f"unexpected /proc/sys/kernel/cap_last_cap: {escape(value)}")
        _cap_last = int(value)
    return _cap_last


# --- worker side (forked; runs in the host mount namespace until setns) ----------------------


def _enter_and_sandbox(mntns_fd: int, job: Job) -> dict:
    """:func:`run_ldconfig`'s worker: into the container's mount namespace, then the sandbox."""
    try:
        ns.setns_mount(mntns_fd)
        os.close(mntns_fd)
    except OSError as exc:
        raise NvcError("ldcache", f"cannot create the ldconfig sandbox: {exc.strerror}") from None
    return sandbox(job)


def sandbox(job: Job) -> dict:
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
            _sandbox_init(rootfs, job.argv, exe, job.uid, job.gid, job.cap_last, stdin_r, out_w, err_w)
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
    rootfs: str, argv: list[str], exe: int, uid: int, gid: int, cap_last: int, stdin: int, out: int, err: int
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
        step = "cover /sys"
        _mount_on_dir(root, "sys", "tmpfs", "tmpfs", _COVER_FLAGS, _TMPFS_DATA)
        step = "cover /dev"
        _mount_on_dir(root, "dev", "tmpfs", "tmpfs", _COVER_FLAGS, _TMPFS_DATA)

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

        step = "set rlimits"
        for which, value in RLIMITS:
            resource.setrlimit(which, (value, value))
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

        step = "execve"
        os.execve(_FD_EXE, argv, {})
    except BaseException as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        try:
            os.write(err, f"{step}: {detail}".encode("utf-8", "backslashreplace")[:MAX_SETUP_ERROR])
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


def _mount_on_dir(root: int, name: str, source: str, fstype: str, flags: int, data: str | None) -> None:
    try:
        target = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        sc.mount(source, _fdpath(target), fstype, flags, data)
    finally:
        os.close(target)
