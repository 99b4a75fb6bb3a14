"""Machinery for the race, lifecycle, topology, cgroup and host-data cases.

The shared host invariants (sentinel tree, host mount table, leftover processes, one-line
failures) live in ``conftest.py``; this module adds what those cases need on top:

* :class:`Variant`: one way of running nvcontainer. ``direct-*`` runs ``nvcontainer
  configure --pid`` against a container process of our own (:class:`Container`), the others a
  real runtime (``runc``/``crun``) with our prestart hook; ``-v2`` puts the container on
  cgroup v2 (an eBPF device program), ``-noopenat2`` starts nvcontainer with
  ``FORCE_NO_OPENAT2`` so every in-root lookup goes through the fallback walker.
* :class:`Driver`: a long-lived process in the fake machine's world that runs ``configure``
  in-process once per request, so a race loop costs a plan and an apply per iteration rather
  than a Python start-up.
* :class:`Attacker`: a second process that swaps directories and symlinks in a rootfs with
  ``renameat2(RENAME_EXCHANGE)`` in a tight loop.
* :func:`run_runtime`: a runtime start whose prestart hook is a recording wrapper around ours
  (mount tables, device rules or programs before and after, optional fault injection).
* Device probes that decide, by opening nodes from inside the container's cgroup, exactly which
  devices a container may use: the same black-box answer on cgroup v1 and v2.

``NVC_LONG_TESTS=1`` (read only here, by the tests) selects the long iteration counts; see
``fuzz/README.md`` and ``docs/security-tests.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.fixtures import runtime as rt
from tests.fixtures.fakegpu.runner import fake_proc_command
from tests.security.conftest import (
    DEFAULT_ARGS,
    RECORDING_WRAPPER,
    DEFAULT_ENV,
    ENXIO,
    EPERM,
    RUN_SECONDS,
    UNREQUESTED,
    Outcome,
    mounts_of,
    mounts_under,
    parse_facts,
    parse_mounts,
)

LONG = os.environ.get("NVC_LONG_TESTS", "") not in ("", "0")
CHUNK_SECONDS = 55          # one test item's share of conftest's CASE_SECONDS, with room to spare
CGROUP_V1 = Path("/sys/fs/cgroup/devices")
CGROUP_V2 = Path("/sys/fs/cgroup/unified")
LIB_DIR = "usr/lib/x86_64-linux-gnu"


def scale(ci: int, long: int) -> int:
    """An iteration count: ``ci`` in the default run, ``long`` with ``NVC_LONG_TESTS=1``."""
    return long if LONG else ci


def chunks(total: int, per_chunk: int) -> list[int]:
    """Chunk indices for splitting ``total`` iterations into test items of ``per_chunk``: each
    item stays inside conftest's per-case time bound and gets the invariants checked."""
    return list(range(max(1, -(-total // per_chunk))))


# --- how nvcontainer is started ----------------------------------------------------------------

_BOOT = """\
import sys
import nvcontainer.fs.syscalls, nvcontainer.cgroups.v2
nvcontainer.fs.syscalls.FORCE_NO_OPENAT2 = {no_openat2}
nvcontainer.cgroups.v2.FORCE_NO_REPLACE = {no_replace}
from nvcontainer.{module}.main import main
sys.exit(main(sys.argv[1:]))
"""


def nvc_argv(module: str, *, no_openat2: bool = False, no_replace: bool = False) -> list[str]:
    """argv that runs ``nvcontainer.<module>.main.main`` (``cli`` or ``hook``) with the test
    switches set before anything else is imported; arguments follow."""
    code = _BOOT.format(module=module, no_openat2=no_openat2, no_replace=no_replace)
    return [sys.executable, "-I", "-c", code]


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    runtime: str | None = None      # None: ``nvcontainer configure --pid`` directly
    cgroup2: bool = False
    no_openat2: bool = False

    @property
    def direct(self) -> bool:
        return self.runtime is None

    def __str__(self) -> str:
        return self.name


DIRECT_V1 = Variant("direct-v1")
DIRECT_V2 = Variant("direct-v2", cgroup2=True)
DIRECT_FALLBACK = Variant("direct-v1-noopenat2", no_openat2=True)
RUNC_V1 = Variant("runc-v1", "runc")
RUNC_V2 = Variant("runc-v2", "runc", cgroup2=True)
CRUN_V1 = Variant("crun-v1", "crun")
CRUN_V2 = Variant("crun-v2", "crun", cgroup2=True)
RUNC_FALLBACK = Variant("runc-v2-noopenat2", "runc", cgroup2=True, no_openat2=True)
CRUN_FALLBACK = Variant("crun-v1-noopenat2", "crun", no_openat2=True)

DIRECT = (DIRECT_V1, DIRECT_V2, DIRECT_FALLBACK)
RUNTIMES = (RUNC_V1, RUNC_V2, CRUN_V1, CRUN_V2, RUNC_FALLBACK, CRUN_FALLBACK)
ALL = DIRECT + RUNTIMES


def variants(ci: Sequence[Variant], long: Sequence[Variant] = ALL) -> tuple[Variant, ...]:
    """The variants a case runs through: a representative few by default, more in the long run."""
    return tuple(long if LONG else ci)


_RUNTIME_WORKS: dict[str, str] = {}


def need_runtime(variant: Variant, machine=None) -> None:
    """Skip unless ``variant``'s runtime is installed and, given a ``machine``, can start a
    plain container (no hook of ours) in the variant's world: crun on cgroup v2 needs
    CAP_SYS_RESOURCE for its RLIMIT_MEMLOCK, which some machines (this project's VMs) do not
    grant. Asked once per variant and session."""
    if not variant.runtime:
        return
    if shutil.which(variant.runtime) is None:
        pytest.skip(f"{variant.runtime} is not installed")
    if machine is None:
        return
    if variant.name not in _RUNTIME_WORKS:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="nvc-rt-") as tmp:
            run = run_runtime(machine, Path(tmp), variant, our_hook=False)
            ok = run.outcome.returncode == 0 and "DONE" in run.outcome.facts
            _RUNTIME_WORKS[variant.name] = "" if ok else run.outcome.runtime_stderr.strip()[-200:]
    if _RUNTIME_WORKS[variant.name]:
        pytest.skip(f"{variant} cannot start a container without our hook here: {_RUNTIME_WORKS[variant.name]}")


def world(variant: Variant, argv: Sequence[str], prelude: str = "") -> list[str]:
    """``argv`` wrapped for the variant's cgroup world (and an optional shell ``prelude``)."""
    if variant.cgroup2:
        script = rt.CGROUP2_WORLD
    elif variant.runtime == "crun":
        script = rt.V1_ONLY_WORLD
    else:
        script = 'exec "$@"'
    return ["sh", "-c", prelude + "\n" + script, "sh", *argv]


# --- device probes -----------------------------------------------------------------------------


def candidate_nodes(machine) -> list[tuple[int, int]]:
    """Every character device of the fake machine (GPUs, control and UVM nodes, caps): what a
    probe tries to open, so a rule granted for any of them shows up."""
    desc = machine.description()
    nodes = {(g["node"]["major"], g["node"]["minor"]) for g in desc["gpus"]}
    nodes |= {(n["major"], n["minor"]) for n in desc["device_nodes"]}
    return sorted(nodes)


def expected_allowed(machine, gpus: Sequence[int] = (0,)) -> set[tuple[int, int]]:
    """The (major, minor) a compute+utility request for ``gpus`` must make usable, from the
    machine's own description: each GPU, nvidiactl, nvidia-uvm and nvidia-uvm-tools."""
    desc = machine.description()
    out = {(g["node"]["major"], g["node"]["minor"]) for g in desc["gpus"] if g["index"] in gpus}
    for node in desc["device_nodes"]:
        if node["path"] in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
            out.add((node["major"], node["minor"]))
    return out


# Prints "DEV:major:minor:read-result|write-result" for each node; the nodes exist already
# (made outside the cgroup, whose rules may forbid mknod), the shell has joined the cgroup.
_PROBE = r"""
for spec; do
    node=${spec%%=*}; name=${spec#*=}
    r=$(cat "$node" 2>&1 | head -n 1)
    w=$( (: > "$node") 2>&1 | head -n 1)
    echo "DEV:$name:${r:-ok}|${w:-ok}"
done
"""

# The same from inside a runtime's container: mknod in /dev (runtimes allow "m" for every
# char device, and their /dev is a tmpfs without nodev, writable even when the rootfs is
# read-only), then open for reading and for writing.
NO_NODE = "no-node"


def container_probe(machine) -> str:
    lines = []
    for i, (major, minor) in enumerate(candidate_nodes(machine)):
        lines.append(f'if mknod /dev/nvc-probe{i} c {major} {minor} 2>/dev/null; then '
                     f'r=$(cat /dev/nvc-probe{i} 2>&1 | head -n 1); '
                     f'w=$( (: > /dev/nvc-probe{i}) 2>&1 | head -n 1); '
                     f'else r={NO_NODE}; w={NO_NODE}; fi; '
                     f'echo "DEV:{major}:{minor}:${{r:-ok}}|${{w:-ok}}"')
    return "\n".join(lines) + "\n"


def allowed_from(facts: dict[str, list[str]]) -> dict[tuple[int, int], str]:
    """``DEV`` probe lines → {(major, minor): access}, access "rw", "r", "w" or "" (denied).
    Without a driver, an allowed open fails with ENXIO; a denied one with EPERM."""
    out = {}
    for line in facts.get("DEV", []):
        major, minor, results = line.split(":", 2)
        read, write = results.rsplit("|", 1)
        access = ("r" if read.endswith(ENXIO) else "") + ("w" if write.endswith(ENXIO) else "")
        for result in (read, write):
            # NO_NODE: the probe node could not be made (mknod is refused in a user namespace);
            # it counts as not granted, so a test expecting a grant still fails.
            if not (result.endswith(ENXIO) or result.endswith(EPERM) or result == NO_NODE):
                raise AssertionError(f"unexpected probe result for {major}:{minor}: {result!r}")
        out[(int(major), int(minor))] = access
    return out


def granted(facts: dict[str, list[str]]) -> set[tuple[int, int]]:
    """Devices the probe could open at all; every one must be fully (rw) allowed."""
    access = allowed_from(facts)
    partial = {dev: a for dev, a in access.items() if a not in ("", "rw")}
    assert not partial, f"devices allowed for only part of rw: {partial}"
    return {dev for dev, a in access.items() if a}


# --- cgroups for the direct path ---------------------------------------------------------------


def _runc_like_program():
    """A deny-by-default device program shaped like runc's: mknod of any char device, /dev/null
    read/write, nothing else."""
    from nvcontainer.cgroups.bpf import AND, JNE, JSET, RSH, alu32_imm, exit_insn, jmp_imm, ldx_w, mov64_imm

    return [
        ldx_w(2, 1, 0), alu32_imm(AND, 2, 0xFFFF), ldx_w(3, 1, 0), alu32_imm(RSH, 3, 16),
        ldx_w(4, 1, 4), ldx_w(5, 1, 8),
        jmp_imm(JNE, 2, 2, 3), jmp_imm(JNE, 3, 1, 2), mov64_imm(0, 1), exit_insn(),       # c *:* m
        jmp_imm(JNE, 2, 2, 5), jmp_imm(JNE, 4, 1, 4), jmp_imm(JNE, 5, 3, 3),               # c 1:3
        jmp_imm(JSET, 3, ~6 & 0xFFFFFFFF, 2), mov64_imm(0, 1), exit_insn(),               # JSET: rw only
        mov64_imm(0, 0), exit_insn(),
    ]


def attached_programs(cgroup: Path) -> list[int]:
    """Ids of the device programs attached to ``cgroup`` (cgroup v2)."""
    from nvcontainer.cgroups import bpf

    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return bpf.prog_query(fd)[1]
    finally:
        os.close(fd)


def program_length(prog_id: int) -> int:
    from nvcontainer.cgroups import bpf

    fd = bpf.prog_get_fd_by_id(prog_id)
    try:
        return len(bpf.prog_info(fd).insns)
    finally:
        os.close(fd)


@dataclasses.dataclass
class Cgroup:
    path: Path
    version: int

    @classmethod
    def create(cls, version: int) -> "Cgroup":
        if version == 1:
            path = CGROUP_V1 / "nvc-sec5" / uuid.uuid4().hex[:12]
            path.mkdir(parents=True)
            if (path.parent / "devices.list").read_text() != "a *:* rwm\n":
                raise AssertionError(f"{path.parent} limits its children's devices: clear it first")
            (path / "devices.deny").write_text("a")
            return cls(path, 1)
        from nvcontainer.cgroups import bpf

        path = CGROUP_V2 / "nvc-sec5" / uuid.uuid4().hex[:12]
        path.mkdir(parents=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            prog = bpf.prog_load(_runc_like_program(), "runc_like")
            try:
                bpf.prog_attach(fd, prog, bpf.F_ALLOW_MULTI)
            finally:
                os.close(prog)
        finally:
            os.close(fd)
        return cls(path, 2)

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def rules(self) -> set[str]:
        """v1: the cgroup's ``devices.list``."""
        return set((self.path / "devices.list").read_text().split("\n")) - {""}

    def programs(self) -> list[int]:
        return attached_programs(self.path)

    def remove(self) -> None:
        """rmdir, waiting up to 10 s for processes that are still exiting; a cgroup that stays
        busy is a leftover the case must answer for."""
        for _ in range(500):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        raise AssertionError(f"cgroup {self.path} still busy: processes {self.procs.read_text().split()}")


class Probe:
    """Device nodes made once on the host (outside any cgroup) and opened from a shell that
    joined the container's cgroup: which devices does the cgroup let through?"""

    def __init__(self, machine, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.specs = []
        for major, minor in candidate_nodes(machine):
            node = directory / f"c{major}-{minor}"
            if not node.exists():
                os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            self.specs.append(f"{node}={major}:{minor}")

    def granted(self, cgroup: Cgroup) -> set[tuple[int, int]]:
        res = subprocess.run(
            ["sh", "-c", 'echo $$ > "$1"; shift; exec sh -c "$0" sh "$@"', _PROBE, str(cgroup.procs), *self.specs],
            capture_output=True, text=True, timeout=RUN_SECONDS)
        assert res.returncode == 0, res.stderr
        return granted(parse_facts(res.stdout))


# --- the direct path's container ---------------------------------------------------------------

# A runtime's view at prestart time: own mount namespace, the rootfs a mount of its own,
# procfs on rootfs/proc with a tmpfs on proc/driver (no real driver here). $2: "ro" makes the
# rootfs mount read-only; $3: more shell run in the namespace before "ready" (volumes).
_CONTAINER = r"""
set -e
r=$1
mount --bind "$r" "$r"
mount --make-rprivate "$r"
mount -t proc -o nosuid,nodev,noexec proc "$r/proc"
mount -t tmpfs -o mode=555 nvc-test "$r/proc/driver"
[ "$2" = ro ] && mount -o remount,bind,ro "$r"
eval "$3"
echo ready
exec sleep 300
"""

# Shared topology: a world (standing in for the host) where the rootfs is a *shared* mount,
# and the container a copy of that world: its rootfs is a peer of the world's, so a mount
# under it would propagate back. Only the container joins the cgroup (whose rules forbid the
# /dev/null that the shell opens for a background job).
_SHARED_WORLD = r"""
set -e
r=$1
mount --bind "$r" "$r"
mount --make-shared "$r"
mount -t proc -o nosuid,nodev,noexec proc "$r/proc"
mount -t tmpfs -o mode=555 nvc-test "$r/proc/driver"
sh -c 'echo $$ > "$1"; exec unshare -m --propagation unchanged -- sleep 300' sh "$2" &
echo "ready $!"
exec sleep 300
"""

_JOIN = 'echo $$ > "$1"; shift; exec "$@"'


class Container:
    """A process standing in for a runtime's container init during prestart: its own cgroup
    (devices denied, or a runc-like program on v2) and its own mount namespace.

    ``volume``: shell run in the namespace after the setup (e.g. bind a host dir over a
    target); ``shared``: see ``_SHARED_WORLD`` (then ``world_pid`` names the stand-in host).
    """

    def __init__(self, rootfs: Path, *, cgroup_version: int = 1, readonly: bool = False, volume: str = "",
                 shared: bool = False, cgroup: Cgroup | None = None):
        self.rootfs = Path(rootfs)
        self.own_cgroup = cgroup is None
        self.cgroup = cgroup or Cgroup.create(cgroup_version)
        self.world_pid: int | None = None
        if shared:
            argv = ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", _SHARED_WORLD, "sh", str(rootfs),
                    str(self.cgroup.procs)]
        else:
            argv = ["sh", "-c", _JOIN, "sh", str(self.cgroup.procs),
                    "unshare", "-m", "--propagation", "private", "--", "sh", "-c", _CONTAINER, "sh", str(rootfs),
                    "ro" if readonly else "rw", volume]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline().split()
        if not ready or ready[0] != "ready":
            self.stop()
            raise AssertionError(f"test container did not start: {self.proc.stderr.read()}")
        if shared:
            self.world_pid, self.pid = self.proc.pid, int(ready[1])
            _wait_for_own_ns(self.pid, self.world_pid)
        else:
            self.pid = self.proc.pid
        self.mounts_before = mounts_of(self.pid)

    def new_mounts(self) -> list[str]:
        return [e[0] for e in (Counter(mounts_of(self.pid)) - Counter(self.mounts_before)).elements()]

    def kill(self) -> None:
        """Kill the container process (and, with a shared world, the world) now."""
        for pid in (self.pid, self.world_pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        self.kill()
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=RUN_SECONDS)
        self.proc.stdout.close()
        self.proc.stderr.close()
        if self.world_pid:
            _reap_quietly()
        if self.own_cgroup:
            self.cgroup.remove()

    def __enter__(self) -> "Container":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_for_own_ns(pid: int, other: int) -> None:
    end = time.monotonic() + 10
    while os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink(f"/proc/{other}/ns/mnt"):
        assert time.monotonic() < end, "unshare never entered its namespace"
        time.sleep(0.005)


def _reap_quietly() -> None:
    """The shared world's background container is reparented to pytest (a subreaper)."""
    end = time.monotonic() + 3
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def configure_args(machine, pid: int, rootfs: Path, args: Sequence[str] = DEFAULT_ARGS,
                   global_args: Sequence[str] = ()) -> list[str]:
    return ["--root", str(machine.root), *global_args, "configure", "--pid", str(pid), *args, str(rootfs)]


def configure_command(machine, variant: Variant, pid: int, rootfs: Path, args: Sequence[str] = DEFAULT_ARGS,
                      global_args: Sequence[str] = (), no_replace: bool = False) -> list[str]:
    """The whole command line of one ``configure`` run in the fake machine's world."""
    argv = nvc_argv("cli", no_openat2=variant.no_openat2, no_replace=no_replace)
    return fake_proc_command(machine, world(variant, argv + configure_args(machine, pid, rootfs, args, global_args)))


class Driver:
    """``configure`` in-process, many times, in one process living in the fake world.

    Each :meth:`configure` sends an argv over a pipe; the driver runs ``nvcontainer.cli.main``
    with stderr captured and answers ``{"rc", "stderr"}``. Python starts once, so a race loop
    spends its time in planning and applying, where the races are.
    """

    _CODE = r"""
import io, json, sys
import nvcontainer.fs.syscalls, nvcontainer.cgroups.v2
nvcontainer.fs.syscalls.FORCE_NO_OPENAT2 = {no_openat2}
nvcontainer.cgroups.v2.FORCE_NO_REPLACE = {no_replace}
from nvcontainer.cli.main import main
out = sys.stdout
for line in sys.stdin:
    err = io.StringIO()
    sys.stderr = err
    try:
        rc = main(json.loads(line))
    except BaseException as exc:
        rc = 99
        err.write("DRIVER: uncaught " + repr(exc) + "\n")
    finally:
        sys.stderr = sys.__stderr__
    out.write(json.dumps({{"rc": rc, "stderr": err.getvalue()}}) + "\n")
    out.flush()
"""

    def __init__(self, machine, variant: Variant, *, no_replace: bool = False):
        self.machine = machine
        self.variant = variant
        code = self._CODE.format(no_openat2=variant.no_openat2, no_replace=no_replace)
        argv = fake_proc_command(machine, world(variant, [sys.executable, "-I", "-c", code]))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def configure(self, pid: int, rootfs: Path, args: Sequence[str] = DEFAULT_ARGS,
                  global_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
        self.proc.stdin.write(json.dumps(configure_args(self.machine, pid, rootfs, args, global_args)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the configure driver died"
        reply = json.loads(line)
        return subprocess.CompletedProcess([], reply["rc"], "", reply["stderr"])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> "Driver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- the attacker ------------------------------------------------------------------------------

_ATTACKER = r"""
import ctypes, json, os, random, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {"x86_64": 316, "aarch64": 276}[os.uname().machine]
RENAME_EXCHANGE = 2
pairs = json.loads(sys.argv[1])
stop = False
def done(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, done)
def make(dfd, name, kind, value):
    try:
        if kind == "symlink":
            os.symlink(value, name, dir_fd=dfd)
        elif kind == "dir":
            os.mkdir(name, 0o755, dir_fd=dfd)
        else:
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644, dir_fd=dfd))
    except OSError:
        pass
work = []
for directory, a, b, kind, value in pairs:
    dfd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    make(dfd, b, kind, value)
    work.append((dfd, a.encode(), b.encode(), a, b, kind, value))
swaps = repairs = 0
print("ready", flush=True)
while not stop:
    for dfd, ea, eb, a, b, kind, value in work:
        if libc.syscall(NR, dfd, ea, dfd, eb, RENAME_EXCHANGE) == 0:
            swaps += 1
        else:
            # one side was removed (our hook replaces what it finds): put a hostile one back
            repairs += 1
            make(dfd, a, kind, value)
            make(dfd, b, kind, value)
    # now and then hold still for a few milliseconds, so runs also meet a tree that stays in
    # one (hostile or harmless) state for a whole step, not only one that flips under every call
    if random.random() < 0.002:
        time.sleep(random.random() * 0.004)
print(json.dumps({"swaps": swaps, "repairs": repairs}), flush=True)
"""


@dataclasses.dataclass(frozen=True)
class Swap:
    """Exchange entry ``name`` of ``directory`` (relative to the rootfs) with a decoy that the
    attacker creates: a symlink (``value`` its target), an empty directory or an empty file."""

    directory: str
    name: str
    kind: str
    value: str = ""

    @property
    def decoy(self) -> str:
        return f".nvc-race-{self.name}"


class Attacker:
    """Swaps every :class:`Swap` back and forth with ``renameat2(RENAME_EXCHANGE)`` as fast as
    it can until stopped. Directories are opened once at the start, so a pair keeps working in
    its directory wherever another pair moved it."""

    def __init__(self, rootfs: Path, swaps: Sequence[Swap]):
        pairs = []
        for s in swaps:
            directory = rootfs / s.directory
            directory.mkdir(parents=True, exist_ok=True)
            pairs.append([str(directory), s.name, s.decoy, s.kind, s.value])
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _ATTACKER, json.dumps(pairs)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "ready\n", "the attacker did not start"
        self.result: dict | None = None

    def stop(self) -> dict:
        if self.result is None:
            self.proc.send_signal(signal.SIGTERM)
            out, _ = self.proc.communicate(timeout=RUN_SECONDS)
            self.result = json.loads(out.strip().splitlines()[-1])
        return self.result


def race_swaps(sentinel, *, dev: bool) -> list[Swap]:
    """What the race cases swap: image directories the hook creates in or mounts onto, with
    symlinks leading to the sentinel (absolute, and climbing with ``..``) and with decoy
    directories; single files the hook mounts onto or writes, with symlinks to the victim.
    ``dev`` adds ``/dev`` itself (the direct path only: a runtime puts its own tmpfs there, and
    swapping it races the runtime rather than us)."""
    swaps = [
        Swap("usr/lib", "x86_64-linux-gnu", "symlink", str(sentinel.lib_dir)),
        Swap("", "etc", "symlink", sentinel.upward(sentinel.tree / "etc")),
        Swap("", "run", "symlink", str(sentinel.empty_dir)),
        Swap("usr", "bin", "dir"),
        Swap("tmp", "nvidia-mps", "symlink", sentinel.upward(sentinel.empty_dir)),
        Swap("etc", "ld.so.conf.d", "dir"),
        Swap(LIB_DIR, "libcuda.so.550.54.14", "symlink", sentinel.upward(sentinel.victim)),
        Swap(LIB_DIR, "libcuda.so.1", "symlink", str(sentinel.victim)),
        Swap("etc/ld.so.conf.d", "00-nvcontainer-cuda-compat.conf", "symlink", str(sentinel.victim)),
        Swap("usr/local/cuda", "compat", "symlink", str(sentinel.lib_dir)),
    ]
    if dev:
        swaps.append(Swap("", "dev", "symlink", sentinel.upward(sentinel.empty_dir)))
    return swaps


def race_image(rootfs: Path) -> None:
    """Extras the race image has, so every swapped name exists from the start: /run, /usr/bin,
    /tmp/nvidia-mps, and a CUDA compat libcuda newer than the host driver (the plan then writes
    an ld.so.conf.d drop-in, one more file to race)."""
    for d in ("run", "usr/bin", "tmp/nvidia-mps", "usr/local/cuda/compat"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", rootfs / "usr/local/cuda/compat/libcuda.so.999.1.2")


# --- runtime runs ------------------------------------------------------------------------------



@dataclasses.dataclass
class RuntimeRun:
    outcome: Outcome
    rootfs: Path
    bundle: Path
    record: dict

    @property
    def granted(self) -> set[tuple[int, int]]:
        return granted(self.outcome.facts)


def make_runtime_bundle(machine, workdir: Path, variant: Variant, *, env: Sequence[str] = DEFAULT_ENV,
                        our_hook: bool = True, script: str = "", hook_args: Sequence[str] = (),
                        extra_spec: Callable[[dict], None] | None = None, opts: dict | None = None,
                        rootfs: Path | None = None, readonly: bool = False,
                        hook_world: bool = False) -> tuple[Path, Path]:
    """A bundle for :func:`run_runtime`: returns (bundle, record path). The container prints
    the device probe (``DEV`` lines), ``OPEN0``/``UNREQ``, runs ``script``, then ``DONE:ok``.
    ``hook_world``: our hook alone runs in the fake machine's world, for a runtime started
    outside it (``run_runtime(..., fake_world=False)``)."""
    record = workdir / f"record-{uuid.uuid4().hex[:8]}.json"
    wrapped = [sys.executable, "-I", "-c", RECORDING_WRAPPER, str(record), str(os.getpid()), json.dumps(opts or {})]
    if our_hook:
        hook = nvc_argv("hook", no_openat2=variant.no_openat2) + ["--root", str(machine.root), *hook_args, "prestart"]
        wrapped += fake_proc_command(machine, hook) if hook_world else hook

    def hooks(spec):
        driver, hook = rt.hook_entries(machine, our_hook=True)
        spec["hooks"]["prestart"] = [driver, {"path": sys.executable, "args": wrapped, "env": hook["env"],
                                              "timeout": 120}]
        if rootfs is not None:
            spec["root"]["path"] = str(rootfs)   # runtimes refuse a symlinked rootfs
        if extra_spec:
            extra_spec(spec)

    probe = container_probe(machine) + (
        f'echo "OPEN0:$(cat /dev/nvidia0 2>&1 | head -1)"\necho "UNREQ:$(cat /{UNREQUESTED} 2>&1 | head -1)"\n')
    bundle = rt.make_bundle(workdir, machine, list(env), probe + script + '\necho "DONE:ok"\n', extra_spec=hooks,
                            rootfs=rootfs, readonly=readonly)
    if rootfs is None:
        fresh_image_extras(bundle / "rootfs", machine)
    return bundle, record


def fresh_image_extras(rootfs: Path, machine) -> None:
    """What :func:`conftest.fresh_image` adds to a busybox image (the unrequested node)."""
    gpu1 = machine.description()["gpus"][1]["node"]
    if not (rootfs / UNREQUESTED).exists():
        os.mknod(rootfs / UNREQUESTED, 0o666 | stat.S_IFCHR, os.makedev(gpu1["major"], gpu1["minor"]))


def runtime_command(machine, variant: Variant, bundle: Path, name: str, prelude: str = "",
                    fake_world: bool = True) -> tuple[list, list]:
    """(run argv, delete argv) for ``variant.runtime`` in the variant's world, itself inside the
    fake machine's, or with ``fake_world`` false in a private mount namespace with the host's
    plain /proc: never in the host's own namespace, where the world's mounts would stay."""
    state = bundle.parent / f"state-{variant.runtime}"
    run = world(variant, [variant.runtime, "--root", str(state), "run", "--bundle", str(bundle), name], prelude)
    delete = [variant.runtime, "--root", str(state), "delete", "-f", name]
    if not fake_world:
        private = ["unshare", "-m", "--propagation", "private", "--"]
        return private + run, private + delete
    return fake_proc_command(machine, run), fake_proc_command(machine, delete)


def run_runtime(machine, workdir: Path, variant: Variant, *, bundle: Path | None = None, record: Path | None = None,
                image: Callable[[Path], None] | None = None, prelude: str = "", timeout: int = RUN_SECONDS,
                fake_world: bool = True, **bundle_kw) -> RuntimeRun:
    """Start a container with ``variant``'s runtime; see :func:`make_runtime_bundle`. Returns the
    outcome (conftest's :class:`Outcome`, ``stderr`` = our hook's own), the rootfs and the
    wrapper's record."""
    if bundle is None:
        bundle, record = make_runtime_bundle(machine, workdir, variant, **bundle_kw)
    rootfs = (bundle / "rootfs").resolve()
    if image:
        image(rootfs)
    name = f"{bundle.name}-{uuid.uuid4().hex[:6]}"
    run, delete = runtime_command(machine, variant, bundle, name, prelude, fake_world)
    try:
        res = subprocess.run(run, capture_output=True, text=True, timeout=timeout)
    finally:
        subprocess.run(delete, capture_output=True, timeout=RUN_SECONDS)
    out = Outcome(variant.name, res.returncode, res.stdout, runtime_stderr=res.stderr,
                  facts=parse_facts(res.stdout), hook_ran=record.exists())
    rec = json.loads(record.read_text()) if out.hook_ran else {}
    if rec:
        record.unlink()
        out.stderr = rec["runs"][-1]["stderr"] if rec["runs"] else ""
        out.hook_rc = rec["runs"][-1]["rc"] if rec["runs"] else None
        before = Counter(parse_mounts(rec["before"]))
        out.new_mounts = [e[0] for e in (Counter(parse_mounts(rec["after"])) - before).elements()]
        runtime_world = Counter(parse_mounts(rec["runtime_after"])) - Counter(parse_mounts(rec["runtime_before"]))
        out.host_mounts_in_rootfs = (mounts_under(parse_mounts(rec["host"]), rootfs)
                                     + [f"runtime namespace: {e[0]}" for e in runtime_world.elements()])
        if rec["cgroup_version"] == 1:
            out.rules = set(rec["devices_after"]) - set(rec["devices_before"])
    return RuntimeRun(out, rootfs, bundle, rec)


def runtime_refuses(variant: Variant, control: RuntimeRun) -> None:
    """Skip when the runtime cannot start even a plain container here (e.g. crun on cgroup v2
    needs CAP_SYS_RESOURCE for its RLIMIT_MEMLOCK, which this machine does not grant)."""
    if control.outcome.returncode != 0 or "DONE" not in control.outcome.facts:
        pytest.skip(f"{variant} cannot start a container without our hook here: "
                    f"{control.outcome.runtime_stderr.strip()[-200:]}")


def one_line(stderr: str, prefix: str) -> str:
    """The single printable line a failed run must leave on stderr."""
    assert stderr.endswith("\n") and stderr.count("\n") == 1, f"not one line: {stderr!r}"
    line = stderr[:-1]
    assert line.isprintable() and line.startswith(prefix) and "Traceback" not in line, repr(line)
    return line


def check_run(out: Outcome, rootfs: Path, machine, granted_now: set[tuple[int, int]] | None,
              prefix: str, *, full_mounts: int | None = None, exact: bool = True) -> bool:
    """The race and fault invariants of one run, whatever its result: exit 0 or one clean
    line; every new mount inside the rootfs and none on the host side; no device beyond the
    requested ones (and on success, with ``exact``, exactly those, and the expected number of
    mounts). Returns whether the run succeeded."""
    outside = [m for m in out.new_mounts if not mounts_under([(m,)], rootfs)]
    assert not outside, f"{out.path}: mounts outside the rootfs: {outside}"
    assert not out.host_mounts_in_rootfs, f"{out.path}: host-side mounts: {out.host_mounts_in_rootfs}"
    wanted = expected_allowed(machine)
    if granted_now is not None:
        assert granted_now <= wanted, f"{out.path}: devices beyond the request: {sorted(granted_now - wanted)}"
    if out.returncode == 0:
        if granted_now is not None and exact:
            assert granted_now == wanted, f"{out.path}: granted {sorted(granted_now)}"
        if full_mounts is not None:
            assert len(out.new_mounts) == full_mounts, f"{out.path}: {len(out.new_mounts)} mounts: {out.new_mounts}"
        return True
    # configure itself failed, or our hook did (not the runtime on its own): say why, in a line
    if out.path.startswith("direct") or getattr(out, "hook_rc", 0) not in (0, None) or out.stderr:
        one_line(out.stderr, prefix)
    return False


# --- host data ---------------------------------------------------------------------------------


def copy_machine(machine, dest: Path):
    """A private copy of the fake machine's driver root (device nodes, links and all) that a
    case may damage; /proc, NVML's config and the description stay the original's."""
    subprocess.run(["cp", "-a", str(machine.root), str(dest)], check=True)
    return dataclasses.replace(machine, root=dest)


_NEW_MAGIC = b"glibc-ld.so.cache1.1"


def ld_cache(entries: Sequence[tuple[int, bytes, bytes]], *, raw_offsets: dict[int, tuple[int, int]] | None = None,
             nlibs: int | None = None) -> bytes:
    """A new-format ``ld.so.cache`` (native byte order) from (flags, key, value) entries, with
    string offsets relative to the header as glibc writes them. ``raw_offsets`` overrides the
    (key, value) offsets of given entries and ``nlibs`` the count, to build hostile caches."""
    header = struct.Struct("=20sIIB3xI12x")
    entry = struct.Struct("=iIIIQ")
    table = header.size + len(entries) * entry.size
    strings = bytearray()
    offsets = []
    for _, key, value in entries:
        k = table + len(strings)
        strings += key + b"\0"
        v = table + len(strings)
        strings += value + b"\0"
        offsets.append((k, v))
    for i, pair in (raw_offsets or {}).items():
        offsets[i] = pair
    out = bytearray(header.pack(_NEW_MAGIC, len(entries) if nlibs is None else nlibs, len(strings), 2, 0))
    for (flags, _, _), (k, v) in zip(entries, offsets):
        out += entry.pack(flags, k, v, 0, 0)
    return bytes(out + strings)


# --- lifecycle helpers -------------------------------------------------------------------------

_NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def spawn_with_pid(pid: int, argv: Sequence[str], tries: int = 50) -> subprocess.Popen | None:
    """Start ``argv`` as process ``pid`` (a number just freed), by setting the kernel's
    last-allocated PID to ``pid - 1`` right before forking, as CRIU does. Another process on
    the machine may take the number first; then it is retried, and None returned at the end."""
    for _ in range(tries):
        with open(_NS_LAST_PID, "w") as fh:
            fh.write(str(pid - 1))
        proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def _state(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1])


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return f"{pid}: " + fh.read(160).replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: gone"


def stray(known: set[int], *, grace: float = 3.0) -> list[str]:
    """Processes below this one that are not in ``known`` and still run after ``grace``
    seconds. Orphans come to us (conftest makes pytest a child subreaper); those that already
    died are reaped here, by PID, so only live leftovers are reported."""
    from tests.security.conftest import descendants

    end = time.monotonic() + grace
    while True:
        alive = []
        for pid in set(descendants()) - known:
            state = _state(pid)
            if state is None:
                continue
            if state[0] in ("Z", "X"):
                if state[1] == os.getpid():
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
                continue
            alive.append(pid)
        if not alive or time.monotonic() > end:
            return [_describe(pid) for pid in alive]
        time.sleep(0.02)


def leftovers(*roots: int) -> list[str]:
    """Live processes below ``roots`` (each with its command line): what a run left behind."""
    from tests.security.conftest import descendants

    return [_describe(pid) for root in roots for pid in descendants(root)
            if (_state(pid) or ("X", 0))[0] not in ("Z", "X")]


def allow_seconds(seconds: float) -> None:
    """In the long run only: give the running case ``seconds`` from now when that is more than
    conftest's per-case bound has left (100 simultaneous containers, 100 runtime starts under
    attack); conftest disarms the timer after the case. The default run keeps the bound."""
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    if LONG and 0 < left < seconds:
        signal.setitimer(signal.ITIMER_REAL, seconds)


class Sampler:
    """Counts the device programs attached to a v2 cgroup as fast as it can while running:
    ``stop()`` gives (fewest, most, samples). A cgroup with no program allows every device, so
    the fewest must never be 0."""

    _CODE = r"""
import json, os, signal, sys
from nvcontainer.cgroups import bpf
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
low, high, n = 1 << 30, 0, 0
print("ready", flush=True)
while not stop:
    c = len(bpf.prog_query(fd)[1])
    low, high, n = min(low, c), max(high, c), n + 1
print(json.dumps([low, high, n]), flush=True)
"""

    def __init__(self, cgroup: Path):
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", self._CODE, str(cgroup)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "ready\n", "the sampler did not start"

    def stop(self) -> tuple[int, int, int]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=RUN_SECONDS)
        low, high, n = json.loads(out.strip().splitlines()[-1])
        return low, high, n


# Lines of the debug log (--debug FILE) that mark the steps of a run, in order; a fault is
# injected right after one of them (plus a random delay), so every step gets hit, not only
# the slow ones.
MARKERS = ("plan:", "prepared ", "placed ", "devices cgroup", "ldconfig done")


class Striker:
    """Runs ``action`` once ``marker`` appears in the debug log ``log`` (or at once without a
    marker), after ``delay`` seconds; gives up after ``timeout``. A thread of the test
    process: it only watches a file and sends signals, nvcontainer itself runs elsewhere."""

    def __init__(self, log: Path, marker: str | None, delay: float, action: Callable[[], None],
                 timeout: float = 20):
        import threading

        self.log, self.marker, self.delay, self.action, self.timeout = log, marker, delay, action, timeout
        self.hit = False
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        end = time.monotonic() + self.timeout
        while self.marker and not self.cancelled.is_set() and time.monotonic() < end:
            try:
                if self.marker in self.log.read_text(errors="replace"):
                    break
            except OSError:
                pass
            time.sleep(0.0005)
        if self.cancelled.wait(self.delay):
            return
        self.hit = True
        self.action()

    def finish(self) -> bool:
        """Stop waiting (the run is over); returns whether the action ran."""
        self.cancelled.set()
        self.thread.join()
        return self.hit
