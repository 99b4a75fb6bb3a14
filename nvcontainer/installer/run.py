"""``nvcontainer install``'s life on a node: take the node, install, register, serve, keep the
CDI spec fresh, and on SIGTERM put the node back as it was.

Why one process for all of it: the pod's life is the installation's. The kubelet sends SIGTERM
when the DaemonSet is deleted or the pod replaced, and this process answers by restoring every
engine file byte for byte (setup's record and backups), restarting the engine, and removing the
programs, unless told to keep them (``NO_CLEANUP_ON_EXIT``).

Two installers on one node (a rolling update with ``maxSurge``, or two DaemonSets whose selectors
overlap) take turns on one ``flock`` in the host's ``/run/nvcontainer``: the first is active, a
later one stands by, holding a shared lock on a second file that says "someone is waiting". The
active one, told to stop while someone waits, hands over instead of cleaning up: it leaves the
installation in place and exits, and the one standing by takes the lock and installs its own
version over it, by the atomic switch of :mod:`.tree`. So an update never leaves a window in which
the node has no runtime ``nvidia``, and neither installer ever writes while the other does.

SIGTERM and SIGINT are blocked while work is under way and read with ``sigtimedwait`` between
steps, so a signal never lands half-way through a write: a step finishes, or is rolled back,
and then the signal is answered. A SIGKILL half-way leaves at most a hidden staging directory
(removed by the next run) and files that setup wrote whole, which its record takes back.

A failure is one line on stderr and in ``/dev/termination-log`` (the pod's status shows it), with
the engine's files put back first.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

from .. import __version__
from ..errors import NvcError, escape
from ..records import replace
from . import engine, tree
from .settings import CDI_OUTPUT, DEFAULT_INSTALL_DIR, FALLBACK_DIRS, LOCK_FILE, Settings

STANDBY_FILE = LOCK_FILE.replace(".lock", ".standby")
TERMINATION_LOG = "/dev/termination-log"
SIGNALS = {signal.SIGTERM, signal.SIGINT}


def say(line: str) -> None:
    sys.stderr.write(f"nvcontainer install: {line}\n")
    sys.stderr.flush()


def fail_line(line: str) -> None:
    say(line)
    try:   # the pod's status: the kubelet reads this file when the container ends
        with open(TERMINATION_LOG, "w") as f:
            f.write(line[:4000] + "\n")
    except OSError:
        pass


def _same_root(a: str, b: str) -> bool:
    try:
        x, y = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def _stop_requested(timeout: float) -> bool:
    return signal.sigtimedwait(SIGNALS, max(timeout, 0.0)) is not None


class Node:
    """What this run did on the host, for the undo."""

    def __init__(self, s: Settings, source: str):
        self.s = s
        self.source = source
        self.where = ""          # the install directory, host path
        self.registered = False
        self.cdi_written = False
        self.server: subprocess.Popen | None = None
        self._cdi_said = False

    def at(self, path: str) -> str:
        return self.s.on_host(path)

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.where, tree.CURRENT, "bin")

    # ---- taking the node -------------------------------------------------------------------

    def lock(self) -> int | None:
        """The node's installer lock, waited for as a standby; None if told to stop meanwhile."""
        os.makedirs(os.path.dirname(self.at(LOCK_FILE)), mode=0o700, exist_ok=True)
        fd = os.open(self.at(LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        standby = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if standby is None:
                standby = os.open(self.at(STANDBY_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                fcntl.flock(standby, fcntl.LOCK_SH)
                say("another installer is active on this node: standing by to take over from it")
            if _stop_requested(1.0):
                os.close(fd)
                os.close(standby)
                return None
        if standby is not None:
            os.close(standby)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {__version__}\n".encode())
        return fd

    @staticmethod
    def someone_waits(s: Settings) -> bool:
        try:
            fd = os.open(s.on_host(STANDBY_FILE), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    # ---- installing ----------------------------------------------------------------------------

    def install(self) -> None:
        s = self.s
        tree.check_tree(self.source)
        outside = tree.links_outside(self.source)
        if outside:
            say(f"note: the tree is not self-contained: {escape(', '.join(outside[:3]), 300)} (the host must have "
                "that; scripts/bundle makes one that is)")
        problem = tree.glibc_problem(tree.tree_needs(self.source), tree.host_glibc(s.host_root))
        if problem:
            raise NvcError("install", problem)
        explicit = s.install_dir != DEFAULT_INSTALL_DIR
        self.where, note = tree.writable_dir(s.host_root, s.install_dir, FALLBACK_DIRS, explicit)
        if note:
            say(note)
        where = self.at(self.where)
        ident = tree.identity(self.source, __version__)
        done, before = tree.install(self.source, where, ident)
        say(f"{done} in {self.where}/{tree.VERSIONS} ({self.where}/{tree.CURRENT} -> {tree.VERSIONS}/{ident})")
        gone = tree.prune(where, (ident, before))
        if gone:
            say(f"removed older versions: {', '.join(gone)}")

    def register(self) -> bool:
        """The engine's files written (setup's way); whether any changed."""
        from ..setup import engines, install, perform

        s = self.s
        ours = os.path.join(self.bin_dir, "nvidia-container-runtime")
        world = engines.world(s.host_root)
        why = engine.conflict(s.runtime, world.read, world.expand, ours)
        if why:
            raise NvcError("install", why)
        inst = install.Install(bin_dir=self.bin_dir, python=os.path.join(self.bin_dir, "python3"),
                               client_module="", client_ready=True, runtime_ready=True)
        options = engines.Options(engine=s.runtime, cdi=s.cdi, set_as_default=s.set_as_default, links=False,
                                  units=False, version=self.engine_version())
        steps = engines.steps(options, inst, world)
        changed = any(getattr(c, "content", None) != getattr(c, "old", None) for c in steps.changes)
        self.registered = True   # from here on, undo what the record says
        report = perform.perform(steps, prefix=s.host_root, stamp=time.strftime("%Y%m%dT%H%M%S"))
        for line in report.splitlines():
            if line.startswith(("wrote ", "unchanged ")):
                say(line)
        return changed

    def engine_version(self) -> tuple[int, ...] | None:
        """The engine's version where its files do not say which layout to write (containerd)."""
        if self.s.runtime != "containerd":
            return None
        from ..setup import versions

        argv = ["containerd", "--version"]
        if os.path.realpath(self.s.host_root) != "/":
            argv = ["chroot", self.s.host_root, *argv]
        try:
            res = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=10, cwd="/",
                                 env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
                                 stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return versions.parse(res.stdout[:4096]) if res.returncode == 0 else None

    def write_cdi(self) -> None:
        """The node's CDI spec for the running driver, replaced only when it changes."""
        from ..cdi import generate, store
        from ..config import load as configuration
        from ..inventory.cache import cached_inventory

        cfg = configuration.load(None).with_overrides(root=self.at(self.s.driver_root))
        try:
            inv = cached_inventory(cfg)
            opts = generate.options_for(cfg, hook_path=os.path.join(self.bin_dir, "nvcontainer-hook"))
            text = generate.render(generate.generate(inv, opts), "yaml", inv.driver_version)
        except NvcError as exc:
            if not self._cdi_said:
                say(f"CDI spec not written: {exc.detail} (tried again every {self.s.cdi_refresh:g} s)")
                self._cdi_said = True
            return
        path = self.at(CDI_OUTPUT)
        try:
            with open(path, encoding="utf-8") as f:
                if f.read(1 << 22) == text:
                    self.cdi_written = True
                    return
        except OSError:
            pass
        store.write_atomic(path, text)
        self.cdi_written = True
        self._cdi_said = False
        say(f"wrote the CDI spec {CDI_OUTPUT} (driver {inv.driver_version})")

    def start_server(self) -> None:
        """The installed ``nvcontainer serve``, in the host's namespaces, for the fronts to hand
        starts to; started again if it ends. Without it the fronts do the work themselves."""
        program = os.path.join(self.bin_dir, "python3")
        if not self.s.serve or (self.server and self.server.poll() is None):
            return
        if not os.access(self.at(program), os.X_OK):
            say(f"no {program} in the installed tree (or it leads nowhere): not serving")
            self.s = replace(self.s, serve=False)
            return
        # the tree's interpreter, not the console script, whose #! names where the package put it
        argv = [program, "-I", "-m", "nvcontainer", "serve", "--socket",
                "/run/nvcontainer/hook.sock"]
        if not _same_root("/proc/1/root", self.s.host_root):
            say(f"the host's init (pid 1) does not have {self.s.host_root} as its root (no hostPID, or not the "
                "host's /): not serving")
            self.s = replace(self.s, serve=False)
            return
        if os.path.realpath(self.s.host_root) != "/":
            # the host's own mount and cgroup namespaces (hostPID: pid 1 is the host's init): the
            # server declines a client that does not share them, and the fronts run in them
            argv = ["nsenter", "--target", "1", "--mount", "--cgroup", "--", *argv]
        self.server = subprocess.Popen(argv, cwd="/", stdin=subprocess.DEVNULL,   # not our blocked signals
                                       preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS),
                                       env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
        say(f"serving: {program} -m nvcontainer serve (pid {self.server.pid})")

    def ready(self) -> None:
        path = self.at(self.s.ready_file)
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        from ..cdi import store

        store.write_atomic(path, f"nvcontainer {__version__} {self.s.runtime} {self.where}\n")
        say(f"ready: {self.s.ready_file}")

    # ---- putting the node back -----------------------------------------------------------------

    def unready(self) -> None:
        try:
            os.unlink(self.at(self.s.ready_file))
        except FileNotFoundError:
            pass

    def stop_server(self) -> None:
        if self.server and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()

    def unregister(self) -> bool:
        """Setup's undo of the engine's files; whether any changed."""
        from ..setup import engines, perform, record

        s = self.s
        entries = record.load(s.host_root, s.runtime)
        steps = engines.undo(s.runtime, entries, engines.world(s.host_root))
        report = perform.perform(steps, prefix=s.host_root, stamp=time.strftime("%Y%m%dT%H%M%S"))
        for line in report.splitlines():
            if line.startswith(("restored ", "removed ", "left ")):
                say(line)
        self.registered = False
        self._drop_backups(entries)
        return bool(steps.changes)

    def _drop_backups(self, entries: list[dict]) -> None:
        """The backups a restore put back, removed: a pod restarted a hundred times must not
        leave a hundred copies of the engine's file beside it. One the file no longer equals
        (the restore did not happen, or someone changed it since) stays."""
        from ..setup.perform import current

        for e in entries:
            backup, path = e.get("backup"), e.get("file") or e.get("link")
            if not backup or not path or "file" not in e:
                continue
            try:
                if current(self.at(path)) == current(self.at(backup)) is not None:
                    os.unlink(self.at(backup))
            except (OSError, NvcError):
                pass

    def remove(self) -> None:
        if self.cdi_written:
            try:
                os.unlink(self.at(CDI_OUTPUT))
            except FileNotFoundError:
                pass
        if self.where:
            tree.remove(self.at(self.where))
            say(f"removed {self.where}")

    def put_back(self, *, restart: bool) -> None:
        """Everything undone, the engine restarted if its files changed (errors said, not raised)."""
        self.unready()
        self.stop_server()
        try:
            if self.registered and self.unregister() and restart:
                say(engine.restart(self.s))
        except NvcError as exc:
            say(exc.detail)
        self.remove()


def wait_ready(path: str, period: float = 5.0) -> int:
    """Until ``path`` exists (a line now and then), then 0; 0 also when told to stop."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    said = 0.0
    while not os.path.isfile(path):
        if time.monotonic() - said >= 60:
            say(f"waiting for {path}: nvcontainer install has not finished on this node")
            said = time.monotonic()
        if _stop_requested(period):
            return 0
    say(f"{path}: the node is ready")
    return 0


def default_source() -> str:
    """This installation's own tree: the directory above the interpreter's ``bin``."""
    return os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))


def run(s: Settings) -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    if not os.path.isdir(s.host_root):
        fail_line(f"HOST_ROOT_MOUNT={escape(s.host_root)}: not a directory (mount the host's / there)")
        return 1
    node = Node(s, s.source or default_source())
    lock = node.lock()
    if lock is None:
        say("stopped while standing by: nothing done")
        return 0
    node.unready()   # one a killed installer left says nothing about this run
    try:
        node.install()
        changed = False if s.no_runtime_config else node.register()
        if changed:
            say(engine.restart(s))
        node.write_cdi()
        node.start_server()
        node.ready()
    except (NvcError, OSError) as exc:
        line = exc.detail if isinstance(exc, NvcError) else f"{escape(exc.filename or '')}: {exc.strerror}"
        node.put_back(restart=True)
        fail_line(line + "; the engine's files are as they were")
        return 1
    if s.no_daemon:
        say("done (NO_DAEMON: left installed)")
        return 0
    while not _stop_requested(s.cdi_refresh):
        node.write_cdi()
        node.start_server()
    if Node.someone_waits(s):
        node.stop_server()
        say("stopping: another installer stands by; handing the node over as it is")
    elif s.no_cleanup:
        node.stop_server()
        say("stopping: NO_CLEANUP_ON_EXIT: left installed")
    else:
        say("stopping: putting the node back")
        node.put_back(restart=True)
    os.close(lock)
    return 0
