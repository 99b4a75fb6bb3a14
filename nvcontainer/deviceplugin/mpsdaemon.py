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
import signal

from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from ..mps import control as mpscontrol
from ..mps.control import control_binary, owned_dir as _owned_dir, write_atomic
from ..kubelet.report import Reporter
from . import devices, mps, settings as settings_module

DEFAULT_INTERVAL = 5.0
SHM_FALLBACK_KIB = 65536


class Daemon:
    """One GPU's control daemon, as :mod:`.mps` describes it, run by the shared
    :class:`~nvcontainer.mps.control.Control`, with a readiness marker of its own."""

    def __init__(self, share: mps.Share, binary: str, deadline: float):
        self.share = share
        self.control = mpscontrol.Control(share.name, share.directory, share.uuid, binary, deadline, shm=True)

    def tell(self, command: str) -> str:
        """'' when the daemon took ``command``, else why not."""
        return self.control.tell(command)

    def start(self) -> str:
        """Start and set up the daemon; '' when it is ready (marker written), else why not."""
        self.unready()
        why = self.control.start(mps.commands(self.share))
        if not why:
            write_atomic(self.share.ready, mps.marker(self.share))
        return why

    def alive(self) -> str:
        """'' while the daemon answers and its files are in place, else why not."""
        if not os.path.exists(self.share.ready):
            return "its marker was removed"
        return self.control.answers()

    def unready(self) -> None:
        try:
            os.unlink(self.share.ready)
        except FileNotFoundError:
            pass

    def stop(self) -> str:
        """Tell the daemon to quit and remove its directory; '' or why quitting failed."""
        self.unready()
        why = self.control.stop()
        parent = os.path.dirname(self.share.directory)
        for _ in range(self.share.resource.count("/") + 1):     # nvidia.com/gpu: two levels
            try:
                os.rmdir(parent)
            except OSError:
                break                # another GPU's directory is still there
            parent = os.path.dirname(parent)
        return why

    def clear(self) -> None:
        self.control.clear()


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
