"""``nvcontainer mps-daemon``: one NVIDIA MPS control daemon per shared GPU, set up, watched,
and taken down, so the device plugin can hand out MPS replicas.

Why a supervisor of its own rather than a shell loop in the DaemonSet: the plugin advertises a
GPU's replicas only while that GPU's daemon is ready, and "ready" must mean the limits were set,
not merely that a process was started. So each daemon is started, told its limits, and only
then given its ``.ready`` marker (written atomically); it is asked a harmless question every
``--interval`` seconds (as NVIDIA's plugin checks its daemon's health), and one that does not
answer loses its marker at once (the plugin marks its replicas Unhealthy), is said in one line,
and is started again. SIGTERM tells every daemon ``quit`` and removes what was made.

What runs with our privileges is the driver's own ``nvidia-cuda-mps-control`` as the inventory
found it (never a binary from an image or from PATH), checked to be a regular file that only
root can change, with an environment we build from nothing and ``/`` as its directory. The
decisions (which GPUs, paths, limits, commands, marker) are :mod:`.mps`'s.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import time

from .. import log
from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from ..kubelet.report import Reporter
from . import devices, mps, settings as settings_module
from .mpshealth import is_pipe

DEFAULT_INTERVAL = 5.0
OUTPUT_LIMIT = 4096
SHM_FALLBACK_KIB = 65536


def control_binary(inv) -> str:
    """The host path of the driver's ``nvidia-cuda-mps-control``, checked, or an error."""
    found = next((b for b in inv.binaries if b.name == mps.CONTROL_BINARY), None)
    if found is None:
        raise NvcError("driver", f"no {mps.CONTROL_BINARY} in the driver's files (the inventory of "
                                 f"{escape(inv.root)}): MPS needs the driver's compute utilities")
    path = os.path.join(inv.root, found.path.lstrip("/"))
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise NvcError("driver", f"{escape(path)}: {exc.strerror.lower()}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise NvcError("driver", f"{escape(path)}: not a regular file that only root can change; "
                                 "refusing to run it")
    return path


def _owned_dir(path: str, mode: int = 0o755) -> None:
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
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _first_line(f) -> str:
    f.seek(0)
    data, _ = read_at_most(f.fileno(), OUTPUT_LIMIT)
    text = data.decode("utf-8", "replace").strip()
    return escape(text.splitlines()[0] if text else "no output", 200)


class Daemon:
    """One GPU's control daemon, as :mod:`.mps` describes it."""

    def __init__(self, share: mps.Share, binary: str, deadline: float):
        self.share = share
        self.binary = binary
        self.deadline = deadline

    def _run(self, args: list[str], stdin: str | None) -> tuple[int, str]:
        with tempfile.TemporaryFile() as out:
            try:
                # the daemon forked by -d keeps what it inherits: a file, not a pipe, so we
                # never wait for its end
                proc = subprocess.run([self.binary, *args], input=stdin.encode() if stdin is not None else None,
                                      stdin=subprocess.DEVNULL if stdin is None else None, stdout=out,
                                      stderr=out, env=mps.daemon_env(self.share), cwd="/",
                                      timeout=self.deadline, close_fds=True)
            except subprocess.TimeoutExpired:
                return -1, f"no answer in {self.deadline:g} s"
            except OSError as exc:
                return -1, escape(exc.strerror or str(exc))
            return proc.returncode, _first_line(out)

    def tell(self, command: str) -> str:
        """'' when the daemon took ``command``, else why not."""
        rc, said = self._run([], command + "\n")
        log.info(f"{self.share.name}: {command!r} -> {rc} {said}")
        return "" if rc == 0 else f"'{command}' failed ({said})"

    def start(self) -> str:
        """Start and set up the daemon; '' when it is ready (marker written), else why not."""
        share = self.share
        self.unready()
        if is_pipe(share.control):
            self.tell(mps.QUIT)      # a daemon left by an earlier run: not left orphaned
        self.clear()
        _owned_dir(share.pipe)
        _owned_dir(share.log)
        rc, said = self._run(["-d"], None)
        if rc != 0:
            return f"{mps.CONTROL_BINARY} -d failed ({said})"
        end = time.monotonic() + self.deadline
        while not is_pipe(share.control):
            if time.monotonic() > end:
                return f"no control pipe {escape(share.control)} after {self.deadline:g} s"
            time.sleep(0.02)
        for command in mps.commands(share):
            why = self.tell(command)
            if why:
                return why
        write_atomic(share.ready, mps.marker(share))
        return ""

    def alive(self) -> str:
        """'' while the daemon answers and its files are in place, else why not."""
        if not os.path.exists(self.share.ready):
            return "its marker was removed"
        if not is_pipe(self.share.control):
            return "its control pipe was removed"
        return self.tell(mps.PROBE)

    def unready(self) -> None:
        try:
            os.unlink(self.share.ready)
        except FileNotFoundError:
            pass

    def stop(self) -> str:
        """Tell the daemon to quit and remove its directory; '' or why quitting failed."""
        self.unready()
        why = self.tell(mps.QUIT) if is_pipe(self.share.control) else ""
        self.clear()
        parent = os.path.dirname(self.share.directory)
        for _ in range(self.share.resource.count("/") + 1):     # nvidia.com/gpu: two levels
            try:
                os.rmdir(parent)
            except OSError:
                break                # another GPU's directory is still there
            parent = os.path.dirname(parent)
        return why

    def clear(self) -> None:
        """Remove this GPU's directory (rmtree unlinks links inside, never follows them; a link
        in the directory's place is unlinked, so nothing is made through it)."""
        if os.path.islink(self.share.directory):
            os.unlink(self.share.directory)
        shutil.rmtree(self.share.directory, ignore_errors=True)


def shm_size_kib(meminfo: str) -> int:
    """Half the machine's memory, as NVIDIA's mount-shm sizes the tmpfs."""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) // 2
    return SHM_FALLBACK_KIB


def mount_shm(mps_root: str) -> bool:
    """Make ``<mps-root>/shm`` a tmpfs unless it is a mount already; True when we mounted it."""
    from ..fs import syscalls

    path = f"{mps_root}/{mps.SHM}"
    _owned_dir(mps_root)
    _owned_dir(path, 0o1777)
    if os.path.ismount(path):
        return False
    with open("/proc/meminfo", "rb") as f:
        size = shm_size_kib(read_at_most(f.fileno(), 1 << 16)[0].decode("ascii", "replace"))
    flags = 0x2 | 0x4 | 0x8          # MS_NOSUID | MS_NODEV | MS_NOEXEC
    try:
        syscalls.mount("shm", path, "tmpfs", flags, f"size={size}k,mode=1777")
    except OSError as exc:
        raise NvcError("input", f"cannot mount a tmpfs on {escape(path)}: {escape(exc.strerror or str(exc))}") from None
    return True


def plan(config, settings) -> tuple[tuple[mps.Share, ...], str]:
    """The GPUs to share and the control binary, from the one inventory, or an error (MPS off,
    MIG, too many replicas, no binary)."""
    from ..inventory.cache import cached_inventory
    from ..request.selection import allow_list

    if not mps.enabled(settings):
        raise NvcError("config", f"device-plugin.sharing is \"{escape(settings.sharing)}\" with replicas = "
                                 f"{settings.replicas}: mps-daemon needs sharing = \"mps\" and replicas above 1")
    inv = cached_inventory(config)
    resources = devices.advertise(inv, settings, allow_list(inv, config.allowed_devices))
    return mps.shares(resources, settings), control_binary(inv)


class Supervisor:
    def __init__(self, daemons: list[Daemon], reporter: Reporter, interval: float):
        self.daemons = daemons
        self.reporter = reporter
        self.interval = interval
        self.ready: dict[str, bool] = {d.share.uuid: False for d in daemons}

    def check(self) -> None:
        for d in self.daemons:
            uuid = d.share.uuid
            if self.ready[uuid]:
                why = d.alive()
                if not why:
                    continue
                d.unready()
                self.ready[uuid] = False
                self.reporter.state(uuid, f"MPS daemon for {d.share.name} stopped answering ({why}): "
                                          "starting it again")
            try:
                why = d.start()
            except NvcError as exc:           # a directory that is not ours: this GPU only
                why = exc.detail
            except OSError as exc:
                why = escape(exc.strerror or str(exc))
            if why:
                d.unready()
                self.reporter.state(uuid, f"MPS daemon for {d.share.name} did not start: {why}; trying again "
                                          f"every {self.interval:g} s")
                continue
            self.ready[uuid] = True
            s = d.share
            limit = f", {s.memory_mib} MiB pinned memory" if s.memory_mib else ""
            self.reporter.state(uuid, f"MPS daemon for {s.name} ready: {s.replicas} clients, {s.threads}% "
                                      f"of its threads{limit} each")

    def stop(self) -> None:
        for d in self.daemons:
            why = d.stop()
            if why:
                self.reporter.say(f"MPS daemon for {d.share.name}: {why}; its directory is removed")
        self.reporter.say("stopped")


def run(config, interval: float | None = None, shm: bool = False) -> None:
    """Run the daemons until SIGTERM or SIGINT."""
    settings = settings_module.parse(config.device_plugin)
    reporter = Reporter("mps-daemon")
    if shm:
        mounted = mount_shm(settings.mps_root)
        reporter.say(f"{escape(settings.mps_root)}/{mps.SHM}: " + ("tmpfs mounted" if mounted else "already a mount"))
        return
    shares, binary = plan(config, settings)
    for share in shares:
        line = mps.rounding(share)
        if line:
            reporter.say(line)
    _owned_dir(settings.mps_root)
    _owned_dir(f"{settings.mps_root}/{mps.SHM}", 0o1777)
    supervisor = Supervisor([Daemon(s, binary, config.deadline) for s in shares], reporter,
                            interval or DEFAULT_INTERVAL)
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    stop = []
    previous = {s: signal.signal(s, lambda signum, frame: stop.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    old_fd = signal.set_wakeup_fd(write_end)
    try:
        if not shares:
            reporter.say("no GPU to share on this node")
        supervisor.check()
        while not stop:
            select.select([read_end], [], [], supervisor.interval)
            if not stop:
                supervisor.check()
    finally:
        supervisor.stop()
        signal.set_wakeup_fd(old_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(read_end)
        os.close(write_end)
