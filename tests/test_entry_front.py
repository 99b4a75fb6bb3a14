"""The entry front (nvcontainer/native/front.c) answers a container that asks for no GPU alone,
and hands every other run to the Python hook with the state intact.

"Alone" is proven by building the front for an interpreter that does not exist: whatever it
could not answer itself fails with "cannot run". The scan it decides with is the runtime shim's
(nvc_common.h ``cannot_be_gpu``), fuzzed against the Python decision in test_runtime_front.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from nvcontainer.native import build

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="reads root-only paths like a hook")


@pytest.fixture(scope="module")
def front(tmp_path_factory) -> Path:
    """The front under the hook's name, for an interpreter that is not there."""
    out = tmp_path_factory.mktemp("front")
    build.build_fronts(str(out), str(out / "no-python"))
    return out / "nvcontainer-hook"


def bundle(tmp_path: Path, env: list[str], **extra) -> Path:
    b = tmp_path / "bundle"
    b.mkdir(exist_ok=True)
    spec = {"ociVersion": "1.0.2", "process": {"env": ["PATH=/bin", *env], "args": ["true"], "cwd": "/"},
            "root": {"path": "rootfs"}, **extra}
    (b / "config.json").write_text(json.dumps(spec))
    return b


def state(b: Path, pid: int = 4242, **extra) -> str:
    return json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": pid, "bundle": str(b), **extra})


def run(front: Path, args: list[str], stdin: str, config: Path | None = None) -> subprocess.CompletedProcess:
    argv = [str(front), *(["--config", str(config)] if config else []), *args]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("env", [[], ["NVIDIA_DRIVER_CAPABILITIES=all"], ["OTHER=NVIDIA"]])
def test_a_container_that_asks_for_nothing_is_answered_without_python(front, tmp_path, env):
    res = run(front, ["--root", "/", "prestart"], state(bundle(tmp_path, env)))
    assert (res.returncode, res.stderr) == (0, "")


@pytest.mark.parametrize("env, extra", [
    (["NVIDIA_VISIBLE_DEVICES=0"], {}),
    (["NVIDIA_VISIBLE_DEVICES=void"], {}),   # the Python hook decides even the obvious
    (["CUDA_VERSION=12.4"], {}),              # a legacy image: every GPU
    (["NVIDIA_XISIBLE_DEVICES=0"], {}),       # spelled with an escape (below)
    ([], {"mounts": [{"destination": "/var/run/nvidia-container-devices/0", "source": "/dev/null"}]}),
    ([], {"annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0"}}),
])
def test_anything_that_may_ask_goes_to_python(front, tmp_path, env, extra):
    b = bundle(tmp_path, env, **extra)
    spec = b / "config.json"
    spec.write_text(spec.read_text().replace("XISIBLE", "\\u0056ISIBLE"))
    res = run(front, ["prestart"], state(b))
    assert res.returncode == 1 and "cannot run" in res.stderr, res.stderr


def test_a_swarm_resource_variable_of_the_configuration_counts(front, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('swarm-resource = "DOCKER_RESOURCE_GPU"\n')
    b = bundle(tmp_path, ["DOCKER_RESOURCE_GPU=0"])
    assert "cannot run" in run(front, ["prestart"], state(b), config).stderr
    assert run(front, ["prestart"], state(b)).returncode == 0   # without it, the name means nothing


@pytest.mark.parametrize("args", [["--debug", "/tmp/x", "prestart"], ["--dry-run", "prestart"], ["poststop"],
                                  ["create-symlinks", "--link", "a::/b"], ["--config", "", "prestart"]])
def test_other_runs_are_pythons(front, tmp_path, args):
    res = run(front, args, state(bundle(tmp_path, [])))
    assert "cannot run" in res.stderr


@pytest.mark.parametrize("how", ["pid-1", "two-pids", "Bundle-case", "relative-bundle", "escaped", "symlinked-spec",
                                 "fifo-spec", "no-spec"])
def test_an_odd_state_or_spec_is_pythons(front, tmp_path, how):
    b = bundle(tmp_path, [])
    text = state(b)
    if how == "pid-1":
        text = state(b, pid=1)
    elif how == "two-pids":
        text = text[:-1] + ', "annotations": {"pid": "7"}}'
    elif how == "Bundle-case":
        text = text[:-1] + f', "Bundle": "{b}"}}'
    elif how == "relative-bundle":
        text = text.replace(f'"{b}"', '"bundle"')
    elif how == "escaped":
        text = text.replace(str(b), str(b).replace("/", "\\/"))
    elif how in ("symlinked-spec", "fifo-spec", "no-spec"):
        (b / "config.json").rename(b / "real.json")
        if how == "symlinked-spec":
            (b / "config.json").symlink_to("real.json")
        elif how == "fifo-spec":
            os.mkfifo(b / "config.json")
    res = run(front, ["prestart"], text)
    assert "cannot run" in res.stderr, (res.returncode, res.stderr)


def test_the_state_reaches_python_whole(tmp_path):
    """A front for a real interpreter that prints what it got on stdin: the bytes the front read
    are handed on unchanged (a memfd as fd 0)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\ncat > \"$(dirname \"$0\")/got\"\n")
    fake.chmod(0o755)
    build.build_fronts(str(tmp_path), str(fake))
    text = state(bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])) + "\n"
    res = run(tmp_path / "nvcontainer-hook", ["prestart"], text)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "got").read_text() == text


def test_a_state_that_never_completes_is_one_line_within_the_bound(front, tmp_path):
    """A runtime that writes half a state and never closes stdin: the same line as the Python
    hook's, after its 5 seconds, not a hang."""
    r, w = os.pipe()
    os.write(w, b'{"ociVersion": "1.0.2", "pid": 42')
    start = time.monotonic()
    try:
        res = subprocess.run([str(front), "prestart"], stdin=r, capture_output=True, text=True, timeout=30)
    finally:
        os.close(r)
        os.close(w)
    assert time.monotonic() - start < 8
    assert res.returncode == 1
    assert res.stderr == ("nvcontainer-hook: input error: state: no complete JSON document on standard input "
                          "within 5s (33 bytes, not closed)\n")


def test_the_native_client_answers_a_container_that_asks_for_nothing_alone(tmp_path):
    """The served registration: neither the server (nobody listens on the socket) nor the
    interpreter (absent) is needed for a container without a GPU; one that asks still goes on."""
    client = tmp_path / "client"
    build.build(str(client), str(tmp_path / "no-python"))
    sock = str(tmp_path / "nobody.sock")
    none = run(client, ["--socket", sock, "prestart"], state(bundle(tmp_path, [])))
    assert (none.returncode, none.stderr) == (0, "")
    gpu = run(client, ["--socket", sock, "prestart"], state(bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])))
    assert gpu.returncode == 1 and "cannot run" in gpu.stderr, gpu.stderr
