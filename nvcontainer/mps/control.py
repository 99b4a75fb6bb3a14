"""One NVIDIA MPS control daemon: started in a directory of ours with an environment built from
nothing, told commands, asked whether it answers, told to quit, its directory removed.

Why here, below both kubelet plugins: ``nvcontainer mps-daemon`` (the device plugin's side, one
daemon per shared GPU) and ``nvcontainer dra-driver`` (one daemon per prepared claim that asks
MPS) start the same program the same way; what differs is only which GPUs a daemon sees, where
its directory is and what it is told, which each decides for itself (``deviceplugin/mps.py``,
``dra/node/mpsclaim.py``).

What runs with our privileges is the driver's own ``nvidia-cuda-mps-control`` as the inventory
found it (never a binary from an image or from PATH), checked to be a regular file that only
root can change, with ``/`` as its directory. Its output goes to a file, not a pipe: the daemon
forked by ``-d`` keeps what it inherits, and we never wait for its end.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

from .. import log
from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from ..fs.replace import replace

BINARY = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
CONTROL = "control"              # the control daemon's named pipe in the pipe directory
SHM = "shm"                      # a daemon's own /dev/shm, shared with its clients only
# The daemon started in a mount namespace of its own with shm/ as its /dev/shm: our own Python,
# isolated (-I -S: nothing from the environment or cwd), makes the namespace and the bind, then
# execs the driver's program with the environment given unchanged. Not a preexec_fn: the kubelet
# plugins are threaded, and only exec is safe after fork there.
_IN_OWN_SHM = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def check(rc, what):
    if rc != 0:
        sys.stderr.write(what + ": " + os.strerror(ctypes.get_errno()) + "\\n"); sys.exit(1)
check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
check(libc.mount(None, b"/", None, 0x4000 | 0x40000, None), "mount --make-rprivate /")
check(libc.mount(sys.argv[1].encode(), b"/dev/shm", None, 0x1000, None), "mount --bind " + sys.argv[1] + " /dev/shm")
env = {k: v for k, v in os.environ.items() if k != "LC_CTYPE"}   # Python's own C-locale coercion
os.execve(sys.argv[2], [sys.argv[2], "-d"], env)
"""
PROBE = "get_default_active_thread_percentage"
QUIT = "quit"
OUTPUT_LIMIT = 4096


def control_binary(inv) -> str:
    """The host path of the driver's ``nvidia-cuda-mps-control``, checked, or an error."""
    return driver_program(inv, BINARY, "MPS needs the driver's compute utilities")


def driver_program(inv, name: str, needed: str) -> str:
    """The path of the driver's program ``name`` as the inventory found it (never one from PATH
    or an image), checked to be a regular file only root can change; an error saying why it is
    ``needed`` when there is none. The one lookup of a driver program we run as root
    (nvidia-cuda-mps-control, nvidia-smi)."""
    found = next((b for b in inv.binaries if b.name == name), None)
    if found is None:
        raise NvcError("driver", f"no {name} in the driver's files (the inventory of {escape(inv.root)}): {needed}")
    path = os.path.join(inv.root, found.path.lstrip("/"))
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise NvcError("driver", f"{escape(path)}: {exc.strerror.lower()}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise NvcError("driver", f"{escape(path)}: not a regular file that only root can change; "
                                 "refusing to run it")
    return path


def is_pipe(path: str) -> bool:
    """Whether the daemon's control endpoint is there: a named pipe up to CUDA 12, a Unix socket
    from CUDA 13 on (its log says "Starting control daemon using socket"; seen on a real H200,
    docs/real-gpu.md). Checked with lstat: a symbolic link planted in its place is neither."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def daemon_env(directory: str, visible: str) -> dict[str, str]:
    """The whole environment of the daemon of ``directory``: nothing inherited."""
    return {"PATH": PATH, PIPE_ENV: f"{directory}/pipe", LOG_ENV: f"{directory}/log", "CUDA_VISIBLE_DEVICES": visible}


def is_own_dir(path: str) -> bool:
    """A real directory (not a link) of ours."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def owned_dir(path: str, mode: int = 0o755) -> None:
    """``path`` a directory of ours (made if missing), never a symbolic link."""
    try:
        os.makedirs(path, mode, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise NvcError("input", f"cannot make {escape(path)}: {exc.strerror.lower()}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise NvcError("input", f"{escape(path)} is not a directory of ours (a link, or another owner)")
    os.chmod(path, mode)


def write_atomic(path: str, text: str) -> None:
    """The readiness marker, whole or not at all (fs/replace.py's one atomic replace)."""
    replace(path, text.encode(), 0o644)


def _first_line(f) -> str:
    f.seek(0)
    data, _ = read_at_most(f.fileno(), OUTPUT_LIMIT)
    text = data.decode("utf-8", "replace").strip()
    return escape(text.splitlines()[0] if text else "no output", 200)


class Paths:
    """A daemon's files under its ``directory`` (an attribute or property of the class that
    mixes this in): one layout for every daemon we start."""

    directory: str

    @property
    def pipe(self) -> str:
        return f"{self.directory}/pipe"

    @property
    def log(self) -> str:
        return f"{self.directory}/log"

    @property
    def control(self) -> str:
        return f"{self.pipe}/{CONTROL}"

    @property
    def shm(self) -> str:
        return f"{self.directory}/{SHM}"


class Control(Paths):
    """The daemon of ``directory`` (``pipe/``, ``log/`` under it), seeing ``visible`` (the
    ``CUDA_VISIBLE_DEVICES`` it is started with); ``name`` is how lines about it say it. With
    ``shm``, the daemon gets ``shm/`` (mode 1777, as /dev/shm) as its /dev/shm, which its
    clients are given too: one per daemon, so clients of other daemons (other tenants) never
    see its shared memory."""

    def __init__(self, name: str, directory: str, visible: str, binary: str, deadline: float, shm: bool = False):
        self.name = name
        self.own_shm = shm
        self.directory = directory
        self.visible = visible
        self.binary = binary
        self.deadline = deadline

    def env(self) -> dict[str, str]:
        return daemon_env(self.directory, self.visible)

    def _run(self, args: list[str], stdin: str | None) -> tuple[int, str]:
        own = self.own_shm and args == ["-d"]
        argv = [sys.executable, "-I", "-S", "-c", _IN_OWN_SHM, self.shm, self.binary] if own else [self.binary, *args]
        with tempfile.TemporaryFile() as out:
            try:
                proc = subprocess.run(argv, input=stdin.encode() if stdin is not None else None,
                                      stdin=subprocess.DEVNULL if stdin is None else None, stdout=out,
                                      stderr=out, env=self.env(), cwd="/", timeout=self.deadline, close_fds=True)
            except subprocess.TimeoutExpired:
                return -1, f"no answer in {self.deadline:g} s"
            except OSError as exc:
                return -1, escape(exc.strerror or str(exc))
            return proc.returncode, _first_line(out)

    def ours(self) -> bool:
        """Whether the directory and its ``pipe/`` are real directories of ours, not symbolic
        links (lstat, component by component below our own state directory): a link planted in
        their place would send what we tell this daemon (``quit``) to another one."""
        return is_own_dir(self.directory) and is_own_dir(self.pipe)

    def reachable(self) -> bool:
        """The daemon's control endpoint is there, reached through our own directories only."""
        return self.ours() and is_pipe(self.control)

    def tell(self, command: str) -> str:
        """'' when the daemon took ``command``, else why not (never through a planted link)."""
        if not self.ours():
            return f"'{command}' not sent: {escape(self.directory)} is not a directory of ours (a link?)"
        rc, said = self._run([], command + "\n")
        log.info(f"{self.name}: {command!r} -> {rc} {said}")
        return "" if rc == 0 else f"'{command}' failed ({said})"

    def start(self, commands) -> str:
        """A fresh daemon, told ``commands``; '' when it took them all, else why not. A daemon
        left in the directory by an earlier run is told to quit first, not left orphaned."""
        if self.reachable():
            self.tell(QUIT)
        self.clear()
        owned_dir(self.directory)
        owned_dir(self.pipe)
        owned_dir(self.log)
        if self.own_shm:
            owned_dir(self.shm, 0o1777)
        rc, said = self._run(["-d"], None)
        if rc != 0:
            return f"{BINARY} -d failed ({said})"
        end = time.monotonic() + self.deadline
        while not is_pipe(self.control):
            if time.monotonic() > end:
                return f"no control pipe {escape(self.control)} after {self.deadline:g} s"
            time.sleep(0.02)
        for command in commands:
            why = self.tell(command)
            if why:
                return why
        return ""

    def answers(self) -> str:
        """'' while the daemon's pipe is there and it answers a harmless question, else why not."""
        if not self.reachable():
            return "its control pipe was removed"
        return self.tell(PROBE)

    def stop(self) -> str:
        """Tell the daemon to quit and remove its directory; '' or why quitting failed."""
        why = self.tell(QUIT) if self.reachable() else ""
        self.clear()
        return why

    def clear(self) -> None:
        """Remove the directory (rmtree unlinks links inside, never follows them; a link in the
        directory's place is unlinked, so nothing is made through it)."""
        if os.path.islink(self.directory):
            os.unlink(self.directory)
        shutil.rmtree(self.directory, ignore_errors=True)
