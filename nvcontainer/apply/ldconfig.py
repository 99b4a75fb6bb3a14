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
  ``SECBIT_NOROOT`` so exec as uid 0 grants none), ``no_new_privs``, a deny-by-default seccomp
  filter (:mod:`.seccomp`), an empty environment (CVE-2025-23266 was an image ``LD_PRELOAD``),
  only the fds it needs, and rlimits for CPU, data memory (tens of MiB), fds and file size;
* it never reads the image's ``ld.so.conf`` or its includes: the sandbox reads them first,
  bounded and in-root, and gives ldconfig the directory lines in a file of its own
  (:mod:`.ldsoconf`), so a FIFO, a device, a link into ``/proc`` or a sparse giant there is a
  warning, not a hang; a library link to a FIFO in a scanned directory is refused in one line.

The module is the sandbox's interface: a :class:`Job` is checked and opened in the host process
(:func:`prepare_run`), run by a worker in the container's mount namespace (:func:`sandbox`) and
judged back in the host process (:func:`report`). The sealed copy of the program is
:mod:`.sealed`'s, the sandbox itself :mod:`.sandbox`'s.

Runs on one rootfs are serialised with an exclusive ``flock`` on the rootfs directory, taken
by the sandbox on its "/" and held by ldconfig itself (one fd of its own root) until it exits:
glibc's ldconfig writes its cache through the fixed temporary name ``/etc/ld.so.cache~`` and
replaces SONAME links with unlink+symlink, so two containers started at once from one rootfs
would otherwise break each other's run. Only containers sharing that rootfs can hold the lock
up, and the deadline bounds it.
"""

from __future__ import annotations

import os

from .. import log
from ..errors import NvcError, escape
from ..records import record
from . import ns, worker
from .sandbox import enter_and_sandbox, sandbox  # noqa: F401  (sandbox: what a plan's worker runs)
from .seccomp import ldconfig_filter
from .sealed import cap_last_cap, prepare, program_fd, static_elf_problem  # noqa: F401

CONF = "/etc/ld.so.conf"
CACHE = "/etc/ld.so.cache"

MAX_DIRS = 64
MAX_PATH = 4096
MAX_ID = 0xFFFFFFFE        # (uid_t)-1 means "unchanged" to setresuid

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
            enter_and_sandbox,
            mntns_fd,
            job,
            deadline=deadline,
            name="ldconfig",
            keep_fds=(mntns_fd, job.exe),
            category="ldcache",
            isolated=True,
        )
    finally:
        job.close()
    report(result, job.program)


@record
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
    seccomp: bytes = b""  # the BPF program installed right before exec

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
    cap_last = cap_last_cap()
    program = ldconfig_filter()
    exe, kept = program_fd(ldconfig_host_path)
    ns.load()  # in this process, so a server's children and our worker inherit it
    return Job(rootfs, argv, exe, uid, gid, cap_last, ldconfig_host_path, kept, program)


def report(result: dict, program: str) -> None:
    """In the host process, after the sandbox's worker ended: ldconfig's output (or, if the
    sandbox could not be made, what it had to say) to the debug log, and
    ``NvcError("ldcache", ...)`` if the sandbox or ldconfig failed."""
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


IMAGE_PROBLEM = "image: "   # a setup error that is the image's doing, not the sandbox's


def failure_message(result: dict, program: str) -> str | None:
    """One line describing why the sandbox or ldconfig failed, or ``None`` on success: what
    happened and ldconfig's last line (its fatal message; everything it printed is in the
    ``--debug`` trace), escaped, never its whole output."""
    setup = result.get("setup_error", "")
    if setup.startswith(IMAGE_PROBLEM):
        return escape(setup[len(IMAGE_PROBLEM):], 400)
    if setup:
        return f"ldconfig sandbox setup failed: {escape(setup, 400)}"
    status = result["status"]
    if status == 0:
        return None
    if status < 0:
        what = f"process {escape(program)} terminated with signal {-status} ({_signame(-status)})"
    else:
        what = f"process {escape(program)} failed with error code: {status}"   # upstream's words
    lines = [line.strip() for line in result["output"].splitlines() if line.strip()]
    if not lines:
        return what
    last = lines[-1]
    for prefix in (f"{program}: ", "ldconfig: ", "/sbin/ldconfig: ", "/sbin/ldconfig.real: "):
        last = last.removeprefix(prefix)
    return f"{what}: {escape(last, 300)}"


def _signame(signo: int) -> str:
    import signal   # ldconfig died of a signal: its name for the message (enum's import, then only)

    try:
        return signal.Signals(signo).name
    except ValueError:
        return "unknown"
