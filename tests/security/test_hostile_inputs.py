"""Hostile inputs: the OCI state, config.json, the image's NVIDIA_* values, configure's argv.

The state and config.json reach the hook through the engine, but the image chose much of what
is in them, and a buggy or hostile engine plugin can put anything there: every wrong JSON type,
absurd sizes, NULs and lone surrogates, files that are FIFOs or links. Each case must end with
exit status non-zero and exactly one printable line naming the problem, quickly, having changed
nothing. The state is written by the runtime itself, so its cases (and config.json's malformed
shapes, which runc would refuse before any hook) feed the hook directly; the image's
environment values go through ``configure`` and through runc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import conftest as sec
from .conftest import RUN_SECONDS, assert_one_line_failure, run_both
from tests.fixtures.fakegpu.runner import fake_proc_command

HOOK_PREFIX = "nvcontainer-hook: input error: "
VALID_SPEC = {"ociVersion": "1.0.2", "process": {"env": ["PATH=/bin"], "args": ["sh"]}, "root": {"path": "rootfs"}}


def run_hook(machine, stdin: bytes, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-I", "-m", "nvcontainer.hook", "--root", str(machine.root), *args, "prestart"]
    return subprocess.run(fake_proc_command(machine, argv), input=stdin, capture_output=True, timeout=RUN_SECONDS)


def bundle_with(workdir: Path, config) -> Path:
    """A bundle whose config.json is ``config`` (dict: JSON; bytes: verbatim; callable: makes
    the file itself)."""
    bundle = workdir / "bundle"
    bundle.mkdir(exist_ok=True)
    (bundle / "rootfs").mkdir(exist_ok=True)
    path = bundle / "config.json"
    if callable(config):
        config(path)
    else:
        path.write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
    return bundle


def state(bundle: Path | str, **extra) -> bytes:
    return json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": os.getpid(),
                       "bundle": str(bundle), **extra}).encode()


# --- the state on stdin -----------------------------------------------------------------------

def _with(**fields):
    return lambda b: json.dumps({"ociVersion": "1.0.2", "bundle": str(b), "pid": 12345, **fields}).encode()


STATES = [
    ("empty", lambda b: b"", "state: invalid JSON"),
    ("not-json", lambda b: b"\x1b[31mnot json\n", "state: invalid JSON"),
    ("list", lambda b: b"[]", "state: expected an object"),
    ("trailing-data", lambda b: _with()(b) + b" {}", "state: invalid JSON"),
    ("nan", lambda b: _with()(b).replace(b"12345", b"NaN"), "state: invalid JSON"),
    ("deep", lambda b: b"[" * 200000 + b"]" * 200000, "state: JSON nested too deeply"),
    ("over-1mib", lambda b: _with(annotations={"a": "x" * (2 << 20)})(b), "state: larger than"),
    ("invalid-utf8", lambda b: _with()(b)[:-1] + b', "x": "\xff\xfe"}', "state: invalid JSON"),
    ("pid-missing", lambda b: json.dumps({"bundle": str(b)}).encode(), "state: pid: missing"),
    ("pid-true", _with(pid=True), "state: pid: expected an integer > 1, got true"),
    ("pid-string", _with(pid="12345"), 'got "12345"'),
    ("pid-float", _with(pid=1.5), "got 1.5"),
    ("pid-zero", _with(pid=0), "got 0"),
    ("pid-one", _with(pid=1), "got 1"),
    ("pid-huge", _with(pid=1 << 64), "state: pid: expected an integer > 1"),
    ("pid-5000-digits", lambda b: _with()(b).replace(b"12345", b"9" * 5000), "state: invalid JSON"),
    ("bundle-missing", lambda b: b'{"pid": 12345}', "state: bundle: missing"),
    ("bundle-number", _with(bundle=42), "state: bundle: expected a string"),
    ("bundle-empty", _with(bundle=""), "state: bundle: must not be empty"),
    ("bundle-relative", _with(bundle="rel/bundle"), "state: bundle: not an absolute path"),
    ("bundle-nul", _with(bundle="/tmp/x\u0000y"), "contains a NUL"),
    ("bundle-surrogate", lambda b: _with()(b).replace(str(b).encode(), b"/tmp/\\ud800"), "unpaired surrogate"),
    ("bundle-escapes", _with(bundle="/tmp/\x1b]0;owned\x07\nnvcontainer: forged"), "cannot open"),
    ("bundle-absent", _with(bundle="/nonexistent/bundle"), "cannot open /nonexistent/bundle/config.json"),
    ("root-number", _with(root=7), "state: root: expected a string"),
    ("annotations-list", _with(annotations=["a"]), "state: annotations: expected an object"),
    ("annotation-number", _with(annotations={"a": 1}), "state: annotations[a]: expected a string"),
]


@pytest.mark.parametrize("make,message", [c[1:] for c in STATES], ids=[c[0] for c in STATES])
def test_hostile_state(sec_machine, workdir, make, message):
    bundle = bundle_with(workdir, VALID_SPEC)
    started = time.monotonic()
    res = run_hook(sec_machine, make(bundle))
    line = assert_one_line_failure(res, HOOK_PREFIX, contains=message)
    assert time.monotonic() - started < 10, "a parse error must come at once"
    assert len(line) < 1000


def test_state_is_read_to_eof_even_when_refused(sec_machine, workdir):
    """crun writes the whole state before it waits: the hook must drain a large stdin rather
    than leave the writer blocked on a full pipe (the run is bounded by RUN_SECONDS)."""
    bundle = bundle_with(workdir, VALID_SPEC)
    res = run_hook(sec_machine, state(bundle)[:-1] + b', "annotations": {"a": "' + b"x" * (8 << 20) + b'"}}')
    assert_one_line_failure(res, HOOK_PREFIX, contains="state: larger than")


# --- config.json ------------------------------------------------------------------------------

def _spec(**changes):
    spec = json.loads(json.dumps(VALID_SPEC))
    for dotted, value in changes.items():
        node = spec
        *path, last = dotted.split("__")
        for key in path:
            node = node[key]
        if value is _DROP:
            del node[last]
        else:
            node[last] = value
    return spec


_DROP = object()


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _sparse(p: Path) -> None:
    with open(p, "wb") as fh:
        fh.truncate(1 << 40)


SPECS = [
    ("list", [], "config.json: expected an object"),
    ("not-json", b"{'single': 'quotes'}", "config.json: invalid JSON"),
    ("nan", json.dumps(VALID_SPEC).replace('"1.0.2"', "NaN").encode(), "config.json: invalid JSON"),
    ("deep", b'{"a":' * 100000 + b"1" + b"}" * 100000, "config.json: JSON nested too deeply"),
    ("over-16mib", lambda p: p.write_bytes(b" " * (17 << 20) + json.dumps(VALID_SPEC).encode()), "larger than"),
    ("sparse-1tib", _sparse, "config.json: larger than"),
    ("fifo", _fifo, "not a regular file"),
    ("dev-zero", lambda p: os.mknod(p, 0o666 | 0o020000, os.makedev(1, 5)), "not a regular file"),
    ("link-to-host", lambda p: os.symlink("/etc/passwd", p), "cannot open"),
    ("oci-version-missing", _spec(ociVersion=_DROP), "config.json: ociVersion: expected a string, got null"),
    ("process-list", _spec(process=[]), "config.json: process: expected an object"),
    ("env-object", _spec(process__env={"A": "B"}), "config.json: process.env: expected a list"),
    ("env-numbers", _spec(process__env=[1, 2]), "config.json: process.env[0]: expected a string, got 1"),
    ("env-no-equals", _spec(process__env=["NVIDIA_VISIBLE_DEVICES"]), "expected NAME=VALUE"),
    ("env-nul", _spec(process__env=["NVIDIA_VISIBLE_DEVICES=0\u0000x"]), "contains a NUL"),
    ("caps-bounding-string", _spec(process__capabilities={"bounding": "CAP_SYS_ADMIN"}),
     "process.capabilities.bounding: expected a list"),
    ("root-missing", _spec(root=_DROP), "config.json: root: expected an object, got null"),
    ("root-path-number", _spec(root__path=5), "config.json: root.path: expected a string"),
    ("mounts-object", {**VALID_SPEC, "mounts": {}}, "config.json: mounts: expected a list"),
    ("mount-destination-missing", {**VALID_SPEC, "mounts": [{"source": "/dev/null"}]},
     "config.json: mounts[0].destination: expected a string"),
    ("annotations-list", {**VALID_SPEC, "annotations": []}, "config.json: annotations: expected an object"),
]


@pytest.mark.parametrize("config,message", [c[1:] for c in SPECS], ids=[c[0] for c in SPECS])
def test_hostile_config_json(sec_machine, workdir, config, message):
    bundle = bundle_with(workdir, config)
    started = time.monotonic()
    res = run_hook(sec_machine, state(bundle))
    assert_one_line_failure(res, HOOK_PREFIX, contains=message)
    assert time.monotonic() - started < 10


def test_huge_environment_list_is_parsed_quickly(sec_machine, workdir):
    """200,000 environment entries (about 5 MiB), none asking for a GPU: parsed within the
    bounds and the container is left alone (exit 0, nothing printed)."""
    env = [f"VAR{i}=value{i}" for i in range(200_000)]
    bundle = bundle_with(workdir, _spec(process__env=env))
    started = time.monotonic()
    res = run_hook(sec_machine, state(bundle))
    assert res.returncode == 0 and res.stderr == b"", res.stderr
    assert time.monotonic() - started < 10


# --- NVIDIA_* values from the image, through configure and runc -------------------------------

FORGED = "\nnvcontainer: forged line"
ESCAPES = "\x1b[2J\x1b]0;owned\x07"
BIDI = "\u202e\u2028"

# (id, image env, equivalent configure arguments, failure text)
ENV_CASES = [
    ("device-newline", [f"NVIDIA_VISIBLE_DEVICES=0{FORGED}"], ["-d", f"0{FORGED}"], "device error"),
    ("device-escapes", [f"NVIDIA_VISIBLE_DEVICES={ESCAPES}"], ["-d", ESCAPES], "device error"),
    ("device-bidi", [f"NVIDIA_VISIBLE_DEVICES=0x{BIDI}1"], ["-d", f"0x{BIDI}1"], "device error"),
    ("device-missing-index", ["NVIDIA_VISIBLE_DEVICES=7"], ["-d", "7"], "device error: 7: unknown device"),
    ("device-mig-index-no-mig", ["NVIDIA_VISIBLE_DEVICES=0:0"], ["-d", "0:0"], "device error"),
    ("device-path", ["NVIDIA_VISIBLE_DEVICES=../../dev/mem"], ["-d", "../../dev/mem"], "device error"),
    ("device-5000-ids", ["NVIDIA_VISIBLE_DEVICES=" + ",".join(map(str, range(5000)))],
     ["-d", ",".join(map(str, range(5000)))], "at most 1024"),
    ("device-70k-value", ["NVIDIA_VISIBLE_DEVICES=" + "0," * 35000], ["-d", "0," * 35000 + "7"], None),
    ("capabilities-escapes", ["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_DRIVER_CAPABILITIES=compute{ESCAPES}{FORGED}"],
     None, "input error: unsupported capabilities"),
    ("require-escapes", ["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_REQUIRE_CUDA=cuda>=1{ESCAPES}{FORGED}"],
     ["-d", "0", "-r", f"cuda>=1{ESCAPES}{FORGED}"], "requirement error"),
    ("require-3000-vars", ["NVIDIA_VISIBLE_DEVICES=0", *[f"NVIDIA_REQUIRE_X{i}=cuda>=1.0" for i in range(3000)]],
     None, "too many requirements"),
    ("imex-huge", ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_IMEX_CHANNELS=99999999999"],
     ["-d", "0", "--imex-channel", "99999999999"], "unsupported IMEX channel value"),
    ("mig-config-escapes", ["NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_MIG_CONFIG_DEVICES=all{ESCAPES}"],
     ["-d", "0", "--mig-config", f"all{ESCAPES}"], "error"),
]


@pytest.mark.parametrize("env,args,message", [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES])
def test_hostile_environment_values(sec_machine, host_sentinel, workdir, env, args, message):
    """Refused in one escaped line by configure and by the hook under runc; the container
    never starts; no device rule is added. (``args=None``: no configure equivalent, the
    direct half runs the benign request.)"""
    if message is None:   # value over the 64 KiB bound (hook) / 35,001 ids folded to 2 (configure)
        both = run_both(sec_machine, host_sentinel, workdir, env=env, args=args, check=False)
        assert_one_line_failure(both.direct, "nvcontainer: device error", contains="7: unknown device")
        for out in both.starts:
            sec.check_failure(out, sec_machine, "nvcontainer-hook: ", "longer than 65536", out.rootfs)
        return
    both = run_both(sec_machine, host_sentinel, workdir, env=env, args=args or sec.DEFAULT_ARGS,
                    expect=message if args else None, expect_runtime=message)
    for out in both.judged:
        if out.returncode:
            assert "\x1b" not in out.stderr and "forged line\n" not in out.stderr
            assert out.rules == set()


# --- configure's own command line -------------------------------------------------------------

CLI_CASES = [
    ("pid-zero", lambda ctx: ["--pid", "0"], "input error: invalid pid: 0"),
    ("pid-one", lambda ctx: ["--pid", "1"], "input error: invalid pid: 1"),
    ("pid-negative", lambda ctx: ["--pid", "-5"], "input error"),
    ("pid-huge", lambda ctx: ["--pid", "99999999999999999999"], "input error"),
    ("pid-word", lambda ctx: ["--pid", "init\x1b[2J"], "input error"),
    ("pid-gone", lambda ctx: ["--pid", str(ctx["gone"])], "container error"),
    ("rootfs-slash", lambda ctx: ["--pid", str(ctx["container"]), "--", "/"], "invalid rootfs directory"),
    ("rootfs-relative", lambda ctx: ["--pid", str(ctx["container"]), "--", "rootfs"], "invalid rootfs directory"),
    ("rootfs-escapes", lambda ctx: ["--pid", str(ctx["container"]), "--", f"/nonexistent{ESCAPES}{FORGED}"],
     "container error: cannot open rootfs"),
    ("rootfs-is-file", lambda ctx: ["--pid", str(ctx["container"]), "--", "/etc/passwd"],
     "container error: cannot open rootfs"),
    ("device-escapes", lambda ctx: ["--pid", str(ctx["container"]), "-d", ESCAPES + FORGED], "device error"),
    ("ldconfig-container-path", lambda ctx: ["--pid", str(ctx["container"]), "--ldconfig", "/sbin/ldconfig"],
     "input error: --ldconfig"),
    ("unknown-option", lambda ctx: ["--pid", str(ctx["container"]), f"--evil{ESCAPES}"], "input error"),
]


@pytest.mark.parametrize("make,message", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_hostile_configure_arguments(sec_machine, workdir, make, message):
    rootfs = sec.fresh_image(workdir / "rootfs", sec_machine)
    gone = subprocess.Popen(["true"])
    gone.wait()
    container = subprocess.Popen(["unshare", "-m", "--propagation", "private", "--", "sleep", "30"])
    try:
        argv = make({"gone": gone.pid, "container": container.pid})
        if "--" not in argv:
            argv = [*argv, "-c", "-u", str(rootfs)]
        else:
            argv.remove("--")
        cmd = [sys.executable, "-I", "-m", "nvcontainer", "--root", str(sec_machine.root), "configure", *argv]
        res = subprocess.run(fake_proc_command(sec_machine, cmd), capture_output=True, text=True, timeout=RUN_SECONDS)
        assert_one_line_failure(res, "nvcontainer: ", contains=message)
    finally:
        container.kill()
        container.wait()


def test_container_in_our_own_mount_namespace_is_refused(sec_machine, workdir):
    """A "container" that shares configure's mount namespace (runc allows that): mounting
    "into" it would mount onto the host itself. The sleeper is started inside configure's own
    namespace (the fake /proc world) so that it really is the same one."""
    rootfs = sec.fresh_image(workdir / "rootfs", sec_machine)
    script = 'sleep 30 & p=$!; "$@" --pid $p -c -u "$ROOTFS"; rc=$?; kill $p; exit $rc'
    cmd = ["env", f"ROOTFS={rootfs}", "sh", "-c", script, "sh",
           sys.executable, "-I", "-m", "nvcontainer", "--root", str(sec_machine.root), "configure"]
    res = subprocess.run(fake_proc_command(sec_machine, cmd), capture_output=True, text=True, timeout=RUN_SECONDS)
    assert_one_line_failure(res, "nvcontainer: container error: ", contains="shares the host's mount namespace")


# --- the invariants themselves ----------------------------------------------------------------


def test_the_invariant_checks_notice_what_they_guard(host_sentinel, workdir):
    """The autouse checks are what the whole suite leans on: show each one firing. A byte of
    the victim changed with its times restored, the victim replaced by an identical copy (new
    inode), a host mount, and an orphaned process must all be seen."""
    victim = host_sentinel.victim
    st = os.stat(victim)
    data = victim.read_bytes()
    victim.write_bytes(b"W" + data[1:])
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert any(line.startswith("victim:") for line in host_sentinel.damage())
    copy = victim.with_name("victim.copy")
    copy.write_bytes(data)
    os.chmod(copy, st.st_mode & 0o7777)
    os.replace(copy, victim)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert any(line.startswith("victim:") for line in host_sentinel.damage())
    host_sentinel.build()
    assert host_sentinel.damage() == []

    before = sec._own_mounts(host_sentinel)
    point = workdir / "mnt"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "nvc-sec-selftest", str(point)], check=True, timeout=RUN_SECONDS)
    try:
        assert sec._own_mounts(host_sentinel) - before
    finally:
        subprocess.run(["umount", str(point)], check=True, timeout=RUN_SECONDS)
    assert sec._own_mounts(host_sentinel) == before

    subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 &"], check=True, timeout=RUN_SECONDS)
    # The orphan is reparented at once, but it may still be the shell's fork, not yet sleep:
    # look again for a while (under load the exec came after the first look).
    orphans: list[int] = []
    for _ in range(200):
        orphans = [p for p in sec.descendants() if _cmdline(p).startswith(b"sleep\0")]
        if orphans:
            break
        time.sleep(0.01)
    assert orphans, "an orphan must come back to pytest, the child subreaper"
    for pid in orphans:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
