"""Reads that never end or never stop growing, and specs two runtimes read differently.

Class 1 (issue 15 item 2): every hostile file type (a FIFO, ``/dev/zero``, a socket, a link to
a pipe through ``/proc/self/fd``, a sparse 10 GiB file) at every place a run reads a file the
image or the engine chose: the state on stdin, ``config.json``, ``ld.so.conf`` and its
includes, the library links ldconfig follows, ``/etc/debian_version`` (and the CUDA compat
libraries, in test_hostile_images). Each must end as a success or one line, without waiting
for a deadline: the direct runs are timed, and the deadline is set far above what they may take.

Class 2 (item 3): a ``config.json`` whose keys runc and crun read differently (``env`` beside
``Env``, a duplicate key, a case variant alone) is refused with one line naming the key, and
under runc (which would give the container the ``Env`` it reads case-insensitively) the
container does not start and gains no device rule.
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
from .test_hostile_images import chardev, fifo, link, put, unix_socket
from .test_hostile_inputs import HOOK_PREFIX, VALID_SPEC, bundle_with, run_hook, state
from tests.fixtures.fakegpu.runner import fake_proc_command

QUICK = 8.0     # a whole direct run (interpreter, NVML, mounts, ldconfig) on a loaded 2-CPU VM


def sparse(p: Path) -> None:
    with open(p, "wb") as fh:
        fh.write(b"/usr/lib/never-ending-line")
        fh.truncate(10 << 30)


KINDS = {
    "fifo": fifo,
    "dev-zero": chardev(1, 5),
    "socket": unix_socket,
    "proc-self-fd": link("/proc/self/fd/1"),
    "sparse-10g": sparse,
}


def timed_both(machine, sentinel, workdir, image, **kwargs) -> sec.Both:
    config = workdir / "config.toml"
    config.write_text("deadline = 60\n")   # a case that waited for the deadline would fail QUICK
    start = time.monotonic()
    both = run_both(machine, sentinel, workdir, image, global_args=("--config", str(config)), **kwargs)
    assert time.monotonic() - start < 4 * QUICK, "waited for a deadline"
    return both


# --- class 1: files that never end -------------------------------------------------------------

PLACES = {
    "ld.so.conf": "etc/ld.so.conf",
    "include": "etc/ld.so.conf.d/00-hostile.conf",
    "debian_version": "etc/debian_version",
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("place", PLACES)
def test_hostile_file_where_the_run_reads(sec_machine, host_sentinel, workdir, place, kind):
    """Skipped with a warning (configuration) or never opened (debian_version: only its
    existence counts): the container starts with its GPU, at once."""
    both = timed_both(sec_machine, host_sentinel, workdir, lambda r: put(r, PLACES[place], KINDS[kind]))
    for out in both.judged:
        assert out.returncode == 0


@pytest.mark.parametrize("line", ["include /proc/self/fd/*", "include /proc/1/root/etc/ld.so.conf"])
def test_includes_into_proc(sec_machine, host_sentinel, workdir, line):
    def image(r: Path) -> None:
        with open(r / "etc/ld.so.conf", "a") as fh:
            fh.write(line + "\n")
    timed_both(sec_machine, host_sentinel, workdir, image)


@pytest.mark.parametrize("kind", ["fifo", "proc-self-fd", "socket"])
def test_library_link_to_a_special_file(sec_machine, host_sentinel, workdir, kind):
    """ldconfig would open it blocking: one line naming the link, at once."""
    def image(r: Path) -> None:
        lib = r / "usr/lib/x86_64-linux-gnu"
        if kind == "proc-self-fd":
            put(r, "usr/lib/x86_64-linux-gnu/libhostile.so.1", KINDS[kind])
        else:
            put(r, "usr/lib/x86_64-linux-gnu/hostile", KINDS[kind])
            os.symlink("hostile", lib / "libhostile.so.1")
    what = "a socket" if kind == "socket" else "a FIFO"
    timed_both(sec_machine, host_sentinel, workdir, image,
               expect=("ldcache error: /usr/lib/x86_64-linux-gnu/libhostile.so.1: a library link to " + what))


# The state on stdin: the hook run directly, as the runtime runs it (stdin held open by us).

def _argv(machine, args) -> list[str]:
    """The hook's command line: prestart with the fake machine's root; a CDI hook as is."""
    root = ["--root", str(machine.root)] if args[0] == "prestart" else []
    return [sys.executable, "-I", "-m", "nvcontainer.hook", *root, *args]


def _hook(machine, *args: str, stdin=subprocess.PIPE) -> subprocess.Popen:
    argv = _argv(machine, args)
    return subprocess.Popen(fake_proc_command(machine, argv), stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@pytest.mark.parametrize("args", [("prestart",), ("update-ldcache", "--folder", "/usr/lib")],
                         ids=["prestart", "cdi-update-ldcache"])
def test_state_from_a_runtime_that_never_closes_stdin(sec_machine, workdir, args):
    """The whole state, then silence with the pipe open: the hook must not wait for EOF.
    (A state that asks for no GPU: prestart is done; the CDI hook gets as far as its pid.)"""
    bundle = bundle_with(workdir, VALID_SPEC)
    hook = _hook(sec_machine, *args)
    try:
        start = time.monotonic()
        hook.stdin.write(json.dumps({"ociVersion": "1.0.2", "pid": 1, "bundle": str(bundle)}).encode()
                         if args[0] != "prestart" else state(bundle))
        hook.stdin.flush()
        hook.wait(timeout=QUICK)
        assert time.monotonic() - start < QUICK
        err = hook.stderr.read()
    finally:
        hook.kill()
        hook.wait()
        hook.stdin.close()
    if args[0] == "prestart":
        assert hook.returncode == 0 and err == b"", err
    else:
        res = subprocess.CompletedProcess(args, hook.returncode, b"", err)
        assert_one_line_failure(res, HOOK_PREFIX, contains="state: pid: expected an integer > 1, got 1")


@pytest.mark.parametrize("source", ["closed", "dev-zero", "directory"])
@pytest.mark.parametrize("args", [("prestart",), ("update-ldcache", "--folder", "/usr/lib")],
                         ids=["prestart", "cdi-update-ldcache"])
def test_state_from_a_hostile_stdin(sec_machine, workdir, source, args):
    """No stdin at all, an endless one, one that is not a stream: one line each, at once."""
    if source == "directory":
        pytest.skip("Python itself refuses a directory as stdin before any code of ours runs")
    argv = _argv(sec_machine, args)
    if source == "closed":
        cmd = ["sh", "-c", 'exec "$@" <&-', "sh", *argv]
        stdin = None
    else:
        cmd, stdin = argv, open("/dev/zero", "rb")
    try:
        start = time.monotonic()
        res = subprocess.run(fake_proc_command(sec_machine, cmd), stdin=stdin, capture_output=True,
                             timeout=RUN_SECONDS)
        assert time.monotonic() - start < QUICK
    finally:
        if stdin:
            stdin.close()
    expect = "state: standard input is closed" if source == "closed" else "state: larger than 1048576 bytes"
    assert_one_line_failure(res, HOOK_PREFIX, contains=expect)


@pytest.mark.parametrize("kind", ["socket", "proc-self-fd"])
def test_config_json_special_files(sec_machine, workdir, kind):
    """(The FIFO, /dev/zero, sparse and host-link cases are test_hostile_inputs'.)"""
    bundle = bundle_with(workdir, lambda p: KINDS[kind](p))
    start = time.monotonic()
    res = run_hook(sec_machine, state(bundle))
    assert time.monotonic() - start < QUICK
    assert_one_line_failure(res, HOOK_PREFIX, contains="config.json")


# --- class 2: keys two runtimes read differently -----------------------------------------------

GPU = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
NONE = ["NVIDIA_VISIBLE_DEVICES=void"]


def _raw(process_fields: str) -> bytes:
    return ('{"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"args": ["sh"], '
            + process_fields + "}}").encode()


SPLIT_SPECS = [
    ("env-then-Env", _raw(f'"env": {json.dumps(NONE)}, "Env": {json.dumps(GPU)}'), '"env" and "Env"'),
    ("Env-then-env", _raw(f'"Env": {json.dumps(GPU)}, "env": {json.dumps(NONE)}'), '"Env" and "env"'),
    ("env-twice", _raw(f'"env": {json.dumps(GPU)}, "env": {json.dumps(NONE)}'), '"env" and "env"'),
    ("ENV-alone", _raw(f'"ENV": {json.dumps(GPU)}'), "key \"ENV\" is not 'env'"),
    ("process-twice", b'{"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"env": []}, '
                      b'"Process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}}', '"process" and "Process"'),
    ("root-path-twice", b'{"ociVersion": "1.0.2", "root": {"path": "rootfs", "path": "/"}}', '"path" and "path"'),
    ("annotation-twice", b'{"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "annotations": '
                         b'{"cdi.k8s.io/x": "a", "cdi.k8s.io/x": "b"}}', 'duplicate key "cdi.k8s.io/x"'),
]


@pytest.mark.parametrize("data, keys", [c[1:] for c in SPLIT_SPECS], ids=[c[0] for c in SPLIT_SPECS])
def test_ambiguous_keys_are_refused_by_the_hook(sec_machine, workdir, data, keys):
    bundle = bundle_with(workdir, data)
    res = run_hook(sec_machine, state(bundle))
    assert_one_line_failure(res, HOOK_PREFIX, contains=[keys, "refusing the spec"])


def test_ambiguous_env_under_runc(sec_machine, host_sentinel, workdir):
    """runc gives the container ``Env`` (the later, case-folded key) and our hook would have
    read ``env``: the start is refused, the container never runs, no device rule is added."""
    def spec(s: dict) -> None:
        s["process"]["Env"] = s["process"].pop("env")
        s["process"]["env"] = [*NONE, "PATH=/bin"]

    out, rootfs = sec.run_runtime(sec_machine, workdir, env=[*GPU, "PATH=/bin"], extra_spec=spec)
    sec.check_failure(out, sec_machine, "nvcontainer-hook: ", ["input error", '"Env" and "env"'], rootfs)
    assert out.rules == set()
