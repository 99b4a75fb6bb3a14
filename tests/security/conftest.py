"""Host invariants for the security suite, and the two ways of running a hostile case.

Every test in ``tests/security`` runs under four autouse fixtures that check what a security
reviewer cares about regardless of the case:

* ``host_sentinel``: a tree of host files *outside* every rootfs (but reachable by the
  images' hostile symlinks, by absolute path and by ``../..``) is bit-for-bit, inode-for-inode
  the same afterwards;
* ``host_mounts_unchanged``: the host's mount table is the same afterwards;
* ``no_leftovers``: no process started by the test survives it (pytest is made a child
  subreaper, so orphans come back to it and are seen), and no mount namespace is kept alive by
  an fd or an nsfs mount;
* ``time_bound``: every case ends within ``CASE_SECONDS`` (SIGALRM; pytest-timeout is not
  installed), on top of the timeout on every subprocess.

A case runs through :func:`run_both`: once through ``nvcontainer configure --pid`` against a
"container" process of our own (:func:`run_configure`), then through a real runtime three
times, a control run without our hook, the real run with it, and the same run served by
``nvcontainer serve`` through the native client (:func:`run_runtime`). The control run is
needed because Debian 12's runc 1.1.5 and crun 1.8.1 have unfixed escapes of their own (e.g.
CVE-2026-41579: a ``/dev`` symlink makes runc create entries outside the rootfs); when the
control run alone damages the sentinel, the runtime half is reported as not attributable and
only the direct half judges our code.

Every run checks the same things: the exit status, one escaped line on failure, the device
rules the container's cgroup gained (exactly the requested ones), that a device node shipped
in the image but not requested stays EPERM, and that every mount added to the container's
mount namespace lies inside the rootfs while no mount appears under the rootfs on the host.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.fixtures import runtime as rt
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import fake_proc_command

SPEC = FakeSpec(gpus=2)
DEFAULT_ENV = ("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility")
DEFAULT_ARGS = ("-d", "0", "-c", "-u")
CASE_SECONDS = 90          # whole test, all runs included
RUN_SECONDS = 40           # any single subprocess
UNREQUESTED = "nvc-unrequested"  # an image-shipped node of GPU 1 (never requested) at the rootfs top
ENXIO = os.strerror(errno.ENXIO)
EPERM = os.strerror(errno.EPERM)
ENOENT = os.strerror(errno.ENOENT)
CGROUP_V1_DEVICES = Path("/sys/fs/cgroup/devices")

# Mount points other people's concurrent tests may legitimately add or drop on the shared
# machine; nothing of ours can land there (our hostile links point at the sentinel only).
_FOREIGN_MOUNT_PREFIXES = ("/run/netns", "/run/user", "/run/containers", "/var/lib/containers")


# --- the sentinel tree ------------------------------------------------------------------------


@dataclasses.dataclass
class Sentinel:
    """Host files a hostile image aims at. ``base`` holds ``host/`` (the sentinel proper) and
    ``cases/`` (the rootfs of every case), so from any rootfs ``../../..`` reaches it."""

    base: Path
    baseline: dict | None = None

    @property
    def tree(self) -> Path:
        return self.base / "host"

    @property
    def victim(self) -> Path:
        """A regular file with known content: what a redirected write or mount would hit."""
        return self.tree / "victim"

    @property
    def empty_dir(self) -> Path:
        """An empty directory: what a redirected mkdir/mknod/symlink would populate."""
        return self.tree / "empty"

    @property
    def lib_dir(self) -> Path:
        """A directory holding host "libraries": ``libvictim.so.1`` (a real shared object) and
        ``libcuda.so.999.99.99`` (a real x86-64 ELF), for links replacing the image's library
        or compat directories."""
        return self.tree / "lib"

    def upward(self, target: Path | str, depth: int = 24) -> str:
        """A relative symlink value that climbs above any rootfs with ``..`` and then names
        ``target`` (an absolute host path): ``../../…/tmp/nvc-sec-x/host/victim``."""
        return "../" * depth + str(target).lstrip("/")

    def build(self) -> None:
        tree = self.tree
        if tree.exists():
            shutil.rmtree(tree)
        (tree / "empty").mkdir(parents=True)
        (tree / "lib").mkdir()
        (tree / "etc/ld.so.conf.d").mkdir(parents=True)
        self.victim.write_text("VICTIM: must never change\n")
        self.victim.chmod(0o640)
        # A real shared object (ldconfig would list it if it ever scanned this directory) and a
        # real x86-64 ELF under a compat libcuda name (the plan would take it if the image's
        # compat directory ever resolved here).
        subprocess.run(["gcc", "-shared", "-nostdlib", "-Wl,-soname,libvictim.so.1", "-o", str(tree / "lib/libvictim.so.1"),
                        "-x", "c", "/dev/null"], check=True, timeout=RUN_SECONDS)
        shutil.copyfile("/bin/true", tree / "lib/libcuda.so.999.99.99")
        (tree / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
        (tree / "etc/ld.so.conf.d/host.conf").write_text("/opt/host/lib\n")
        (tree / "etc/ld.so.cache").write_bytes(b"glibc-ld.so.cache1.1 host cache, not to be touched\n")
        os.symlink("victim", tree / "victim-link")
        os.mknod(tree / "fifo", 0o600 | stat.S_IFIFO)
        tree.chmod(0o755)
        self.baseline = self.snapshot()

    def snapshot(self) -> dict:
        """Every entry below the tree (and the tree itself): type, mode, owner, size, inode,
        mtime/ctime (a create-then-delete leaves a directory mtime behind) and content."""
        out = {}
        for dirpath, dirnames, filenames in os.walk(self.tree, followlinks=False):
            for name in [".", *sorted(dirnames), *sorted(filenames)]:
                path = os.path.normpath(os.path.join(dirpath, name))
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode):
                    with open(path, "rb") as fh:
                        content = hashlib.sha256(fh.read()).hexdigest()
                elif stat.S_ISLNK(st.st_mode):
                    content = os.readlink(path)
                else:
                    content = None
                out[os.path.relpath(path, self.tree)] = (
                    st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_ino, st.st_nlink, st.st_rdev,
                    st.st_mtime_ns, st.st_ctime_ns, content,
                )
        return out

    def damage(self) -> list[str]:
        """What differs from the baseline, one line per entry; empty when intact."""
        now = self.snapshot()
        assert self.baseline is not None
        return [f"{k}: {self.baseline.get(k)} -> {now.get(k)}"
                for k in sorted(set(now) | set(self.baseline)) if now.get(k) != self.baseline.get(k)]


@pytest.fixture(scope="session")
def sentinel_tree() -> Sentinel:
    """The session's sentinel (build once); tests use :func:`host_sentinel` instead."""
    base = Path(tempfile.mkdtemp(prefix="nvc-sec-"))
    base.chmod(0o755)
    (base / "cases").mkdir(mode=0o755)
    sentinel = Sentinel(base)
    sentinel.build()
    yield sentinel
    remove_tree(base)


@pytest.fixture(autouse=True)
def host_sentinel(sentinel_tree) -> Sentinel:
    """Autouse. Yields the :class:`Sentinel` (``.victim``, ``.empty_dir``, ``.lib_dir``,
    ``.tree``, ``.upward(path)``); after the test, its listing, types, modes, owners, sizes,
    inodes, times and contents must equal the baseline. On damage the tree is rebuilt so the
    next test starts clean, and this test fails."""
    damage = sentinel_tree.damage()
    if damage:  # somebody before us (a runtime's own bug, reported there) left it damaged
        sentinel_tree.build()
    yield sentinel_tree
    damage = sentinel_tree.damage()
    if damage:
        sentinel_tree.build()
        pytest.fail("host sentinel changed:\n" + "\n".join(damage[:20]), pytrace=False)


@pytest.fixture
def workdir(sentinel_tree) -> Path:
    """A fresh directory under the sentinel's ``cases/`` for images and bundles; removed after
    (without following the images' symlinks)."""
    path = sentinel_tree.base / "cases" / uuid.uuid4().hex[:10]
    path.mkdir(mode=0o755)
    yield path
    remove_tree(path)


def remove_tree(path: Path) -> None:
    """``rm -rf`` that copes with the deep trees hostile links make us create (shutil.rmtree
    recurses per level) and, like rmtree, never follows a symlink."""
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], timeout=RUN_SECONDS, check=False)


@pytest.fixture(scope="session")
def sec_machine(fake_machine_factory):
    """The fake GPU machine every case runs against (2 GPUs; GPU 1 is never requested)."""
    return fake_machine_factory(SPEC)


# --- mount table ------------------------------------------------------------------------------


def _unescape(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mounts(text: str) -> list[tuple[str, str, str, str]]:
    """(mount point, fstype, source, mount options) of every mountinfo line."""
    out = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        out.append((_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2]), fields[5]))
    return out


def mounts_of(pid: int | str = "self") -> list[tuple[str, str, str, str]]:
    with open(f"/proc/{pid}/mountinfo") as fh:
        return parse_mounts(fh.read())


def mounts_under(entries, *prefixes: Path | str) -> list[str]:
    """Mount points at or below any of ``prefixes``."""
    roots = [str(p).rstrip("/") for p in prefixes]
    return [e[0] for e in entries if any(e[0] == r or e[0].startswith(r + "/") for r in roots)]


def _own_mounts(sentinel: Sentinel) -> Counter:
    keep = []
    for entry in mounts_of():
        point = entry[0]
        if point.startswith("/tmp/") and not point.startswith(str(sentinel.base)):
            continue
        if point.startswith(_FOREIGN_MOUNT_PREFIXES):
            continue
        keep.append(entry)
    return Counter(keep)


@pytest.fixture(autouse=True)
def host_mounts_unchanged(sentinel_tree):
    """Autouse. The host mount table (mount point, type, source, options) is identical before
    and after the test, ignoring only other people's scratch mounts under /tmp and the
    container engines' own /run and /var/lib paths; nsfs mounts (pinned namespaces) included."""
    before = _own_mounts(sentinel_tree)
    yield
    after = _own_mounts(sentinel_tree)
    if after != before:
        added = sorted((after - before).elements())
        removed = sorted((before - after).elements())
        pytest.fail(f"host mount table changed: added {added}, removed {removed}", pytrace=False)


# --- processes and namespaces -----------------------------------------------------------------

_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper(on: bool) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        ppid = int(data[data.rfind(b")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below ``pid`` (default: this pytest process)."""
    kids = _children_map()
    todo, out = [pid or os.getpid()], []
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _ns_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("mnt:["):
            out.add(target)
    return out


@pytest.fixture(scope="package")
def _subreaper():
    """Package-scoped: the tests outside this package do not reap orphans, so pytest stops
    being a subreaper (and reaps what came to it) once the last security test is done."""
    _set_subreaper(True)
    yield
    _set_subreaper(False)
    _reap()


@pytest.fixture(autouse=True)
def no_leftovers(_subreaper):
    """Autouse. After the test no process started by it is alive (orphans are reparented to
    pytest, a child subreaper, so a stray hook worker, ldconfig sandbox or container process is
    seen), and this process holds no new mount-namespace fd. Stragglers are killed by pid and
    the test fails."""
    before = set(descendants())
    fds_before = _ns_fds()
    yield
    deadline = time.monotonic() + 3  # processes killed at the end of the test may still be exiting
    while True:
        _reap()
        left = [p for p in descendants() if p not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    described = []
    for pid in left:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read(200).replace(b"\0", b" ").decode(errors="replace")
            described.append(f"{pid}: {cmdline}")
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _reap()
    leaked = _ns_fds() - fds_before
    if described or leaked:
        pytest.fail(f"leftovers: processes {described}, namespace fds {sorted(leaked)}", pytrace=False)


class CaseTimeout(Exception):
    pass


@pytest.fixture(autouse=True)
def time_bound():
    """Autouse. The whole test gets ``CASE_SECONDS``; past that, SIGALRM raises
    :class:`CaseTimeout` wherever the test is blocked."""
    def expired(signum, frame):
        raise CaseTimeout(f"case exceeded {CASE_SECONDS}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- failure lines ----------------------------------------------------------------------------


def assert_one_line_failure(res, prefix: str, *, contains: str | Sequence[str] = ()) -> str:
    """``res`` (a CompletedProcess or :class:`Outcome`) failed with exactly one printable line
    on stderr that starts with ``prefix`` and holds every ``contains`` text; returns the line.
    Printable (``str.isprintable``) means hostile newlines, escape sequences, bidi controls and
    line separators were escaped, and no traceback leaked."""
    stderr = res.stderr if isinstance(res.stderr, str) else res.stderr.decode("utf-8", "replace")
    assert res.returncode != 0, f"expected a failure, got exit 0; stderr {stderr!r}"
    assert stderr.endswith("\n") and stderr.count("\n") == 1, f"not one line: {stderr!r}"
    line = stderr[:-1]
    assert line.isprintable(), f"unescaped bytes in {line!r}"
    assert line.startswith(prefix), f"{line!r} does not start with {prefix!r}"
    assert "Traceback" not in line
    for text in [contains] if isinstance(contains, str) else contains:
        assert text in line, f"{text!r} not in {line!r}"
    return line


# --- images -----------------------------------------------------------------------------------


def fresh_image(dest: Path, machine) -> Path:
    """The busybox image every case starts from, plus an image-shipped device node of GPU 1
    (``/nvc-unrequested``), which no case requests: opening it must stay EPERM."""
    rt.busybox_rootfs(dest)
    _image_extras(dest, machine)
    return dest


def _image_extras(rootfs: Path, machine) -> None:
    gpu1 = machine.description()["gpus"][1]["node"]
    os.mknod(rootfs / UNREQUESTED, 0o666 | stat.S_IFCHR, os.makedev(gpu1["major"], gpu1["minor"]))


def expected_rules(machine, gpus: Sequence[int] = (0,)) -> set[str]:
    """The device rules a compute+utility request for ``gpus`` must add, from the fake
    machine's own description (not from nvcontainer): each GPU, nvidiactl, nvidia-uvm(-tools)."""
    desc = machine.description()
    rules = {f"c {g['node']['major']}:{g['node']['minor']} rw" for g in desc["gpus"] if g["index"] in gpus}
    for node in desc["device_nodes"]:
        if node["path"] in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
            rules.add(f"c {node['major']}:{node['minor']} rw")
    return rules


parse_facts = rt.parse_facts


# --- one run ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """One run of a case. ``stderr`` is nvcontainer's own stderr (for the runtime, what our
    hook wrote, captured by the wrapper), ``runtime_stderr`` the runtime's. ``rules``: device
    rules the container's cgroup gained during the run. ``new_mounts``: mount points added to
    the container's mount namespace. ``facts``: ``KEY:value`` lines the probe printed."""

    path: str
    returncode: int
    stdout: str = ""
    stderr: str = ""
    runtime_stderr: str = ""
    rules: set[str] = dataclasses.field(default_factory=set)
    new_mounts: list[str] = dataclasses.field(default_factory=list)
    host_mounts_in_rootfs: list[str] = dataclasses.field(default_factory=list)
    facts: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    hook_ran: bool = True
    rootfs: Path | None = None   # the image this run used (on the host), to inspect afterwards


# The "container" of the direct path: its own cgroup (devices denied), its own mount namespace
# with the rootfs as a mount of its own, procfs at rootfs/proc and a tmpfs at proc/driver, as a
# runtime has it before prestart hooks. Mounts go on the image's paths only where they are real
# directories (the test's own namespace, but a symlink there would make the setup lie). Then
# the volumes: (host directory, rootfs-relative destination) pairs, bound as an engine would.
_CONTAINER_SETUP = r"""
set -e
r=$1
shift
mount --bind "$r" "$r"
mount --make-rprivate "$r"
if [ -d "$r/proc" ] && [ ! -L "$r/proc" ]; then
    mount -t proc -o nosuid,nodev,noexec proc "$r/proc"
    mount -t tmpfs -o mode=555 nvc-test "$r/proc/driver"
fi
while [ $# -gt 1 ]; do
    mount --bind "$1" "$r/$2"
    shift 2
done
echo ready
exec sleep 300
"""

_JOIN_CGROUP = 'echo $$ > "$1"; shift; exec "$@"'


def _cgroup_v1() -> Path:
    path = CGROUP_V1_DEVICES / "nvc-sec" / uuid.uuid4().hex[:12]
    path.mkdir(parents=True)
    (path / "devices.deny").write_text("a")
    return path


def _rules_of(cgroup: Path) -> set[str]:
    return set((cgroup / "devices.list").read_text().split("\n")) - {""}


def _remove_cgroup(cgroup: Path) -> None:
    for _ in range(100):
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def _probe_open(cgroup: Path, pid: int, path: str) -> str:
    """First line of ``cat PATH`` run in the container's cgroup and mount namespace."""
    res = subprocess.run(
        ["sh", "-c", _JOIN_CGROUP, "sh", str(cgroup / "cgroup.procs"), "nsenter", "-t", str(pid), "-m", "--",
         "cat", path], capture_output=True, text=True, timeout=RUN_SECONDS)
    return (res.stderr or res.stdout).split("\n")[0]


# ``python -m nvcontainer`` with the in-root resolver forced onto its openat(2) walker, the
# path taken on kernels without openat2(2).
_WALKER_MAIN = ("import sys, nvcontainer.fs.syscalls as s; s.FORCE_NO_OPENAT2 = True; "
                "from nvcontainer.cli.main import main; sys.exit(main(sys.argv[1:]))")


def run_configure(machine, rootfs: Path, args: Sequence[str] = DEFAULT_ARGS, *, extra: Sequence[str] = (),
                  global_args: Sequence[str] = (), probe: bool = True, walker: bool = False,
                  volumes: Sequence[tuple[Path, str]] = ()) -> Outcome:
    """``nvcontainer --root <machine> [global_args] configure --pid <ours> [args] [extra] <rootfs>``
    against a container process of our own; see the module docstring for what is recorded.
    With ``probe``, a successful run also opens ``/dev/nvidia0`` and the image's unrequested
    node from inside the container (facts ``OPEN0`` and ``UNREQ``). ``walker`` forces the
    openat(2) fallback resolver (``FORCE_NO_OPENAT2``). ``volumes`` are (host directory,
    rootfs-relative path) pairs bind-mounted into the container before configure runs."""
    cgroup = _cgroup_v1()
    proc = subprocess.Popen(
        ["sh", "-c", _JOIN_CGROUP, "sh", str(cgroup / "cgroup.procs"),
         "unshare", "-m", "--propagation", "private", "--", "sh", "-c", _CONTAINER_SETUP, "sh", str(rootfs),
         *[str(x) for pair in volumes for x in pair]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline()
        if ready != "ready\n":
            proc.kill()
            raise AssertionError(f"test container did not start: {proc.stderr.read()}")
        before = mounts_of(proc.pid)
        program = [sys.executable, "-I", "-c", _WALKER_MAIN] if walker else [sys.executable, "-I", "-m", "nvcontainer"]
        argv = [*program, "--root", str(machine.root), *global_args,
                "configure", "--pid", str(proc.pid), *args, *extra, str(rootfs)]
        res = subprocess.run(fake_proc_command(machine, argv), capture_output=True, text=True, timeout=RUN_SECONDS)
        after = mounts_of(proc.pid)
        outcome = Outcome(
            "configure-walker" if walker else "configure", res.returncode, res.stdout, res.stderr,
            rules=_rules_of(cgroup),
            new_mounts=[e[0] for e in (Counter(after) - Counter(before)).elements()],
            host_mounts_in_rootfs=mounts_under(mounts_of(), rootfs), rootfs=rootfs,
        )
        if probe and res.returncode == 0:
            outcome.facts = {"OPEN0": [_probe_open(cgroup, proc.pid, f"{rootfs}/dev/nvidia0")],
                             "UNREQ": [_probe_open(cgroup, proc.pid, f"{rootfs}/{UNREQUESTED}")]}
        return outcome
    finally:
        proc.kill()
        proc.wait(timeout=RUN_SECONDS)
        proc.stdout.close()
        proc.stderr.close()
        _remove_cgroup(cgroup)


# The prestart hook the runtime runs in our hook's place: records the container's mount table,
# its device rules (v1) or programs (v2) and the runtime's own mount table, runs the wrapped
# hook (none for a control run) ``repeat`` times with the state on stdin, optionally killing
# the hook or the container once a marker line shows up in the hook's debug log (``fault``),
# records again, and exits with the last status.
RECORDING_WRAPPER = r"""
import ctypes, json, os, signal, subprocess, sys, threading, time
out, host_pid, opts, argv = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4:]
# A subreaper: the workers of a hook killed under us become our children, not the runtime's.
# crun 1.8 waits for a hook with sigtimedwait() and keeps only a SIGCHLD whose si_pid is the
# hook's; a reparented worker dying as we exit can take the one pending SIGCHLD slot, and crun
# would then wait out the hook's whole timeout.
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
raw = sys.stdin.buffer.read()
pid = json.loads(raw)["pid"]
def read(path):
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""
def cgroup():
    v2 = None
    for line in read(f"/proc/{pid}/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "devices" in parts[1].split(",") and os.path.isdir("/sys/fs/cgroup/devices"):
            return 1, "/sys/fs/cgroup/devices" + parts[2]
        if parts[0] == "0":
            v2 = "/sys/fs/cgroup" + parts[2]
    return 2, v2
version, cg = cgroup()
def devices():
    if version == 1:
        return read(cg + "/devices.list").splitlines()
    from nvcontainer.cgroups import bpf
    fd = os.open(cg, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return bpf.prog_query(fd)[1]
    finally:
        os.close(fd)
rec = {"before": read(f"/proc/{pid}/mountinfo"), "runtime_before": read("/proc/self/mountinfo"),
       "devices_before": devices(), "cgroup_version": version, "runs": []}
sampler = None
if opts.get("sample") and version == 2:
    code = ("import json, os, signal, sys\nfrom nvcontainer.cgroups import bpf\n"
            "stop = []\nsignal.signal(signal.SIGTERM, lambda *a: stop.append(1))\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\nlow, high, n = 99, 0, 0\n"
            "print('ready', flush=True)\n"
            "while not stop:\n    c = len(bpf.prog_query(fd)[1]); low = min(low, c); high = max(high, c); n += 1\n"
            "print(json.dumps([low, high, n]), flush=True)\n")
    sampler = subprocess.Popen([sys.executable, "-I", "-c", code, cg], stdout=subprocess.PIPE, text=True)
    sampler.stdout.readline()
def fault(hook):
    # wait for the marker line in the hook's debug log (or the hook's end), then strike
    f = opts["fault"]
    end = time.monotonic() + 20
    while f.get("marker") and hook.poll() is None and time.monotonic() < end:
        try:
            with open(f["log"]) as fh:
                if f["marker"] in fh.read():
                    break
        except OSError:
            pass
        time.sleep(0.0005)
    time.sleep(f.get("delay", 0))
    if f["what"] == "hook":
        # whether it struck is read from the hook's exit status afterwards: poll() here says
        # "running" whenever the other thread holds the wait lock, even after the hook exited
        hook.kill()
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    # the runtime cannot reap its init while it waits for hooks: the PID stays a zombie, so
    # it can never name another process during the hook
    for _ in range(2000):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("Z", "X", "gone"):
            break
        time.sleep(0.001)
    rec["container_state"] = state
rc = 0
for _ in range(opts.get("repeat", 1) if argv else 0):
    hook = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    striker = threading.Thread(target=fault, args=(hook,)) if opts.get("fault") else None
    if striker:
        striker.start()
    _, err = hook.communicate(raw, timeout=90)
    if striker:
        striker.join()
    rc = hook.returncode
    if opts.get("fault", {}).get("what") == "hook":
        rec["struck"] = rc == -signal.SIGKILL
    rec["runs"].append({"rc": rc, "stderr": err.decode("utf-8", "surrogateescape")})
    if rc:
        break
if sampler:
    sampler.send_signal(signal.SIGTERM)
    rec["sample"] = json.loads(sampler.communicate(timeout=30)[0].strip().splitlines()[-1])
rec.update(after=read(f"/proc/{pid}/mountinfo"), runtime_after=read("/proc/self/mountinfo"),
           host=read(f"/proc/{host_pid}/mountinfo"), devices_after=devices(), rc=rc)
# reap the orphans (they die with the hook through PDEATHSIG) before the runtime sees us exit
signal.alarm(30)
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
signal.alarm(0)
with open(out, "w") as fh:
    json.dump(rec, fh)
sys.stderr.write(rec["runs"][-1]["stderr"] if rec["runs"] else "")
sys.exit(rc if rc >= 0 else 1)
"""

RUNTIME_PROBE = f"""
echo "OPEN0:$(cat /dev/nvidia0 2>&1 | head -1)"
echo "UNREQ:$(cat /{UNREQUESTED} 2>&1 | head -1)"
"""


# The native hook client that ``nvcontainer setup --serve`` registers, for ``served`` runs
# (set once for the package, from the session's ``native_client``).
_SERVED_CLIENT: list[str] = []


@pytest.fixture(scope="package", autouse=True)
def _served_client(native_client):
    _SERVED_CLIENT[:] = [native_client]
    yield


def run_runtime(machine, workdir: Path, image: Callable[[Path], None] | None = None,
                env: Sequence[str] = DEFAULT_ENV, *, our_hook: bool = True, runtime: str = "runc",
                script: str = "", hook_args: Sequence[str] = (), volumes: Sequence[tuple[Path, str]] = (),
                extra_spec: Callable[[dict], None] | None = None, served: bool = False) -> tuple[Outcome, Path]:
    """``<runtime> run`` a bundle whose rootfs is :func:`fresh_image` then ``image(rootfs)``;
    prestart hooks: the test's /proc/driver tmpfs, then the recording wrapper around our hook
    (or around nothing, for a control run). The container runs :data:`RUNTIME_PROBE`, then
    ``script``, then prints ``DONE:ok``. ``hook_args`` go before the hook's stage word (e.g.
    ``--config FILE``); ``volumes`` become bind mounts of the spec. Returns the outcome and the
    rootfs.

    ``served``: the hook is the native client, and ``nvcontainer serve`` runs beside the
    runtime for the whole start, as ``nvcontainer setup --serve`` sets a node up; the run is
    checked to have been served (no request declined, the hook's trace says so)."""
    tag = "served" if served else "hooked" if our_hook else "control"
    record = workdir / f"record-{tag}-{uuid.uuid4().hex[:6]}.json"
    sock = None
    if served:
        assert our_hook and _SERVED_CLIENT, "a served run needs our hook and the native client"
        home = workdir / f"srv-{uuid.uuid4().hex[:6]}"
        home.mkdir(mode=0o700)
        sock = home / "hook.sock"

    def hooks(spec):
        driver, hook = rt.hook_entries(machine, our_hook=True, hook_args=hook_args)
        wrapped = [sys.executable, "-I", "-c", RECORDING_WRAPPER, str(record), str(os.getpid()), "{}"]
        if served:
            wrapped += [_SERVED_CLIENT[0], "--socket", str(sock), "--root", str(machine.root),
                        "--debug", str(sock.parent / "hook.log"), *hook_args, "prestart"]
        elif our_hook:
            wrapped += hook["args"]
        spec["hooks"]["prestart"] = [driver, {"path": sys.executable, "args": wrapped, "env": hook["env"],
                                              "timeout": 90}]
        for source, destination in volumes:
            spec["mounts"].append({"destination": "/" + destination, "type": "bind", "source": str(source),
                                   "options": ["rbind", "rw"]})
        if extra_spec:
            extra_spec(spec)

    bundle = rt.make_bundle(workdir, machine, list(env), RUNTIME_PROBE + script + '\necho "DONE:ok"\n',
                            extra_spec=hooks)
    rootfs = bundle / "rootfs"
    _image_extras(rootfs, machine)
    if image:
        image(rootfs)
    res = rt.run_container(machine, bundle, runtime=runtime, timeout=RUN_SECONDS,
                           wrap=rt.server_beside(machine, sock) if served else ())
    outcome = Outcome(f"{runtime}-{tag}", res.returncode, res.stdout, runtime_stderr=res.stderr,
                      facts=parse_facts(res.stdout), hook_ran=record.exists(), rootfs=rootfs)
    if served:
        _check_served(sock, outcome)
    if outcome.hook_ran:
        rec = json.loads(record.read_text())
        outcome.stderr = rec["runs"][-1]["stderr"] if our_hook and rec["runs"] else ""
        before = Counter(parse_mounts(rec["before"]))
        outcome.new_mounts = [e[0] for e in (Counter(parse_mounts(rec["after"])) - before).elements()]
        world = Counter(parse_mounts(rec["runtime_after"])) - Counter(parse_mounts(rec["runtime_before"]))
        outcome.host_mounts_in_rootfs = (mounts_under(parse_mounts(rec["host"]), rootfs)
                                         + [f"runtime namespace: {e[0]}" for e in world.elements()])
        outcome.rules = set(rec["devices_after"]) - set(rec["devices_before"])
    return outcome, rootfs


def _check_served(sock: Path, out: Outcome) -> None:
    """That a ``served`` run was: the server started and stopped cleanly around the runtime,
    declined no request (a declined client runs the hook itself), and the hook's trace, once it
    got as far as the prestart line, names the server's child."""
    assert "SERVER_BESIDE" not in out.runtime_stderr, out.runtime_stderr
    server_log = (sock.parent / "serve.log").read_text()
    assert "request declined" not in server_log, server_log
    trace = (sock.parent / "hook.log").read_text() if (sock.parent / "hook.log").exists() else ""
    if out.returncode == 0 or "prestart: pid" in trace:
        assert "(served by nvcontainer serve, pid " in trace, trace


# --- both paths -------------------------------------------------------------------------------


SAME = object()  # run_both: the runtime is expected to end as the direct path


@dataclasses.dataclass
class Both:
    direct: Outcome
    hooked: Outcome | None       # None when the runtime itself could not be judged
    control: Outcome | None
    note: str = ""
    served: Outcome | None = None   # the same hooked start through ``nvcontainer serve``

    @property
    def judged(self) -> tuple[Outcome, ...]:
        """The runs a case's own checks apply to: the direct one, and both runtime starts
        (hooked, served) unless the runtime itself could not be judged."""
        return (self.direct,) if self.hooked is None else (self.direct, self.hooked, self.served)

    @property
    def starts(self) -> tuple[Outcome, ...]:
        """The runtime starts with our hook, in-process and served; none if not judged."""
        return () if self.hooked is None else (self.hooked, self.served)


def check_success(out: Outcome, machine, rootfs: Path, gpus: Sequence[int] = (0,)) -> None:
    """A successful injection: exit 0, exactly the requested device rules, the requested node
    usable (ENXIO: the cgroup lets it through to a driver that isn't there), the image's
    unrequested node EPERM, every new mount inside the rootfs and none on the host."""
    assert out.returncode == 0, f"{out.path}: {out.stderr or out.runtime_stderr}"
    assert out.rules == expected_rules(machine, gpus), f"{out.path}: device rules {sorted(out.rules)}"
    assert out.facts.get("OPEN0", [""])[0].endswith(ENXIO), f"{out.path}: {out.facts}"
    assert out.facts.get("UNREQ", [""])[0].endswith(EPERM), f"{out.path}: {out.facts}"
    check_contained(out, rootfs)


def check_contained(out: Outcome, rootfs: Path) -> None:
    """Whatever the result: mounts only inside the rootfs, none visible on the host side."""
    outside = [m for m in out.new_mounts if not mounts_under([(m,)], rootfs)]
    assert not outside, f"{out.path}: mounts outside the rootfs: {outside}"
    assert not out.host_mounts_in_rootfs, f"{out.path}: host-side mounts: {out.host_mounts_in_rootfs}"


def check_failure(out: Outcome, machine, prefix: str, contains: str | Sequence[str], rootfs: Path) -> str:
    """A refused injection: one escaped line naming the problem, no device rule beyond the
    requested ones, nothing mounted outside the rootfs; for a runtime, the container never ran."""
    line = assert_one_line_failure(out, prefix, contains=contains)
    assert out.rules <= expected_rules(machine), f"{out.path}: device rules {sorted(out.rules)}"
    check_contained(out, rootfs)
    if not out.path.startswith("configure"):
        assert "DONE" not in out.facts, f"{out.path}: the container ran: {out.stdout!r}"
    return line


def run_both(machine, sentinel: Sentinel, workdir: Path, image: Callable[[Path], None] | None = None, *,
             env: Sequence[str] = DEFAULT_ENV, args: Sequence[str] = DEFAULT_ARGS, expect: str | Sequence[str] | None = None,
             expect_runtime: str | Sequence[str] | None | object = SAME,
             runtime: str = "runc", script: str = "", global_args: Sequence[str] = (),
             volumes: Sequence[tuple[Path, str]] = (), check: bool = True) -> Both:
    """Run one hostile case through ``configure --pid`` and through ``runtime`` (control run
    first, then with our hook), each on a fresh copy of the image built by
    :func:`fresh_image` and then ``image(rootfs)``.

    ``expect=None``: success (:func:`check_success` on both paths). ``expect="text"`` (or
    several): both paths fail with one line containing it (:func:`check_failure`).
    ``expect_runtime`` overrides ``expect`` for the runtime (runc's own /dev tmpfs hides the
    image's /dev, for instance). With
    ``check=False`` nothing is asserted beyond the autouse invariants; inspect the returned
    :class:`Both`. ``env`` is what the image asks for and ``args`` the equivalent configure
    options; ``global_args`` go before the command word of both (``--config FILE``); ``volumes``
    are host directories bound into the container (see :func:`run_configure`).

    When the control run fails, the runtime refuses the image on its own: the hooked run must
    fail too, and our hook's line (if it got to run) must still be one clean line. When the
    control run damages the sentinel (the runtime's own escape), the sentinel is rebuilt, a
    warning names the runtime, and ``hooked`` is None: only the direct path judges us.
    """
    rootfs = fresh_image(workdir / "direct" / "rootfs", machine)
    if image:
        image(rootfs)
    direct = run_configure(machine, rootfs, args, global_args=global_args, volumes=volumes)
    if check:
        if expect is None:
            check_success(direct, machine, rootfs)
        else:
            check_failure(direct, machine, "nvcontainer: ", expect, rootfs)
    assert not sentinel.damage(), f"configure changed the sentinel: {sentinel.damage()[:5]}"

    control, _ = run_runtime(machine, workdir, image, env, our_hook=False, runtime=runtime, script=script,
                             hook_args=global_args, volumes=volumes)
    if sentinel.damage():
        sentinel.build()
        note = f"{runtime} alone changes the sentinel with this image: runtime half not attributable"
        warnings.warn(note)
        return Both(direct, None, control, note)

    runs = [run_runtime(machine, workdir, image, env, our_hook=True, runtime=runtime, script=script,
                        hook_args=global_args, volumes=volumes, served=served)
            for served in (False, True)]
    if check:
        refused = control.returncode != 0 or "DONE" not in control.facts
        if expect_runtime is SAME:
            expect_runtime = expect
        for out, rootfs in runs:
            if refused:
                assert out.returncode != 0, f"{out.path}: {runtime} refused the image without us but ran it with us"
                if out.stderr:
                    assert_one_line_failure(out, "nvcontainer-hook: ")
                check_contained(out, rootfs)
            elif expect_runtime is None:
                check_success(out, machine, rootfs)
            else:
                check_failure(out, machine, "nvcontainer-hook: ", expect_runtime, rootfs)
        if refused:
            return Both(direct, runs[0][0], control, f"{runtime} refuses this image by itself", runs[1][0])
    return Both(direct, runs[0][0], control, served=runs[1][0])
