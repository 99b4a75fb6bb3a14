"""The runtime shim's spec edit served by ``nvcontainer serve`` (``native/runtime.c`` asks the
server before it starts its Python half; ``serve/request.py`` runs that half's code warm).

Pass signals: the server's trace names each runtime request it took; the container sees exactly
its GPU (ENXIO on its node, the other absent), as through the Python half; the spec the runtime
is handed is byte for byte the one the Python half writes; errors are the same one line; a front
of another install, or no server, gets the Python half (the front's fallback is the same code
path as before this existed). The server and runc run in one world (``test_serve.in_world``): a
server in another mount namespace declines, by design.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from nvcontainer.hook import client as hookclient
from nvcontainer.native import build as native
from tests.test_runtime_engines import CHECKS, Shim, assert_sees_only, bundle_without_hooks, facts, machine  # noqa: F401
from tests.fixtures import runtime as rt
from tests.test_serve import _request, in_world, server  # noqa: F401 (a fixture)

RUNTIME_REQUEST = "runtime request from pid "


def served_shim(base: Path, machine, sock: str, **kwargs) -> Shim:
    """The test's shim, its front built to ask the server at ``sock``."""
    shim = Shim(base, machine, **kwargs)
    native.build_runtime(str(shim.program), sys.executable, str(shim.config), defines=(f'NVC_SOCKET="{sock}"',))
    return shim


def runc_steps(shim: Shim, bundle: Path, name: str) -> list[dict]:
    state = bundle.parent / "state-runc"
    return [{"argv": [str(shim.engine_runtime), "--root", str(state), "run", "--bundle", str(bundle), name],
             "pause": 0.3},
            {"argv": ["runc", "--root", str(state), "delete", "-f", name]}]


class Result:
    def __init__(self, step: dict):
        self.returncode, self.stdout, self.stderr = step["rc"], step["stdout"], step["stderr"]


@pytest.mark.parametrize("gpu", [0, 1])
def test_a_gpu_container_gets_its_spec_edit_from_the_server(machine, tmp_path, gpu):
    sock = str(tmp_path / "srv" / "hook.sock")
    shim = served_shim(tmp_path / "shim", machine, sock)
    bundle = bundle_without_hooks(tmp_path / "b", machine, [f"NVIDIA_VISIBLE_DEVICES={gpu}"])
    out = in_world(machine, tmp_path, runc_steps(shim, bundle, f"served{gpu}"), sock)
    res = Result(out["steps"][0])
    assert res.returncode == 0, res.stderr
    assert_sees_only(facts(res), gpu)
    spec = shim.spec()
    assert [h["path"] for h in spec["hooks"]["prestart"]] == [str(shim.hook)]
    assert f"/dev/nvidia{gpu}" in [d["path"] for d in spec["linux"]["devices"]]
    trace = (tmp_path / "serve.log").read_text()
    assert trace.count(RUNTIME_REQUEST) == 1 and "declined" not in trace, trace
    assert f"--bundle {bundle}" in trace
    assert trace.count("a runtime create was served: its hook's spare is forked at once") == 1, trace
    # the shim's own trace (its config's debug file) was written by the server's child
    assert "written" in shim.log.read_text()


def test_the_hook_after_a_served_edit_runs_in_a_spare_forked_for_it(machine, tmp_path, native_client):
    """The edit tells the server its container's hook asks next (on a real node sooner than the
    50 ms after which an idle server forks a spare on its own): the server hears it between the
    edit's spare and the hook's, and the hook runs in a spare (its worker forked ahead). When the
    spare is forked is serve/server.py's spare_wait (tests/test_serve.py)."""
    from nvcontainer.native import build as native_build

    sock = str(tmp_path / "srv" / "hook.sock")
    shim = served_shim(tmp_path / "shim", machine, sock)
    client = tmp_path / "client" / native_build.NAME   # the native client as `setup --serve` builds it
    client.parent.mkdir()
    shutil.copy2(native_client, client)
    shim.hook.write_text(rt.driver_wrapper(f"{client} --socket {sock}"))
    bundle = bundle_without_hooks(tmp_path / "b", machine, ["NVIDIA_VISIBLE_DEVICES=0"])
    out = in_world(machine, tmp_path, runc_steps(shim, bundle, "spare"), sock)
    res = Result(out["steps"][0])
    assert res.returncode == 0, res.stderr
    assert_sees_only(facts(res), 0)
    trace = (tmp_path / "serve.log").read_text()
    lines = trace.splitlines()
    told = next(i for i, line in enumerate(lines) if "its hook's spare is forked at once" in line)
    took = [i for i, line in enumerate(lines) if " took a request" in line]
    assert len(took) == 2 and took[0] < told < took[1], trace   # the edit's spare, then the hook's


def test_the_served_edit_is_the_python_halfs_byte_for_byte(machine, tmp_path):
    """The same bundle through the served front and through a front with no server: the runtime
    is handed the same bytes."""
    sock = str(tmp_path / "srv" / "hook.sock")
    got = {}
    for arm, where in (("served", sock), ("python", str(tmp_path / "nobody" / "hook.sock"))):
        shim = served_shim(tmp_path / arm, machine, where)
        shutil.rmtree(tmp_path / "b", ignore_errors=True)
        bundle = bundle_without_hooks(tmp_path / "b", machine, ["NVIDIA_VISIBLE_DEVICES=1",
                                                                 "NVIDIA_DRIVER_CAPABILITIES=compute,utility"])
        written = (bundle / "config.json").read_bytes()
        out = in_world(machine, tmp_path / arm, runc_steps(shim, bundle, f"same-{arm}"), sock)
        assert out["steps"][0]["rc"] == 0, out["steps"][0]["stderr"]
        assert shim.after.read_bytes() != written
        # the same bytes but for the shim's own directory and the bundle's random cgroup name
        cgroup = json.loads(written)["linux"]["cgroupsPath"].encode()
        got[arm] = shim.after.read_bytes().replace(str(tmp_path / arm).encode(), b"BASE").replace(cgroup, b"CG")
        trace = (tmp_path / arm / "serve.log").read_text()
        assert trace.count(RUNTIME_REQUEST) == (1 if arm == "served" else 0), trace
    assert got["served"] == got["python"]


def test_a_bad_request_is_the_same_one_line_and_leaves_the_spec(machine, tmp_path):
    sock = str(tmp_path / "srv" / "hook.sock")
    shim = served_shim(tmp_path / "shim", machine, sock)
    bundle = bundle_without_hooks(tmp_path / "b", machine, ["NVIDIA_VISIBLE_DEVICES=7"], "echo STARTED")
    written = (bundle / "config.json").read_bytes()
    out = in_world(machine, tmp_path, runc_steps(shim, bundle, "bad"), sock)
    res = out["steps"][0]
    assert res["rc"] == 1 and "STARTED" not in res["stdout"]
    assert res["stderr"] == "nvidia-container-runtime: device error: 7: unknown device\n"
    assert (bundle / "config.json").read_bytes() == written and not shim.after.exists()
    assert RUNTIME_REQUEST in (tmp_path / "serve.log").read_text()


def test_a_container_without_a_gpu_never_reaches_the_server(machine, tmp_path):
    sock = str(tmp_path / "srv" / "hook.sock")
    shim = served_shim(tmp_path / "shim", machine, sock)
    bundle = bundle_without_hooks(tmp_path / "b", machine, [])
    written = (bundle / "config.json").read_bytes()
    out = in_world(machine, tmp_path, runc_steps(shim, bundle, "nogpu"), sock)
    res = Result(out["steps"][0])
    assert res.returncode == 0, res.stderr
    assert_sees_only(facts(res), None)
    assert shim.after.read_bytes() == written
    assert RUNTIME_REQUEST not in (tmp_path / "serve.log").read_text()


def _runtime_request(python: str, args: list[str], env: tuple[str, ...] = ()) -> bytes:
    argv = [python, *args]
    head = b"%s %d %d %d %d\n" % (hookclient.RUNTIME_MAGIC, 0, 0o022, len(argv), len(env))
    return head + b"".join(os.fsencode(s) + b"\0" for s in (*argv, *env))


def test_a_front_of_another_install_or_a_bad_request_is_declined(server, tmp_path):
    proc, sock = server
    other = tmp_path / "elsewhere" / "python3"
    other.parent.mkdir()
    other.symlink_to(sys.executable)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for python, env, why in ((str(other), (), "runtime front of another install"),
                                 (sys.executable, ("PATH=/bin",), "bad runtime request"),
                                 ("python3", (), "bad runtime request")):
            reply = _send_as_child(sock, python, ["--", "state", "x"], env, (null, null, null))
            assert reply.startswith(b"declined ") and why.encode() in reply, reply
    finally:
        os.close(null)
    assert proc.poll() is None
    trace = (tmp_path / "serve.log").read_text()
    assert "request declined: runtime front of another install" in trace


def _send_as_child(sock: Path, python: str, args: list[str], env, fds) -> bytes:
    """A runtime request whose header names the PID of the child that sends it."""
    return _request(sock, lambda pid: _runtime_request(python, args, env).replace(b" 0 ", b" %d " % pid, 1), fds)


def test_the_server_answers_the_runtime_path_or_the_status(server, tmp_path, machine):
    """The wire as the front reads it: ``runtime PATH`` for a command that edits nothing,
    ``rc 1`` with the one line on the front's stderr for a refused edit."""
    proc, sock = server
    shim = Shim(tmp_path / "shim", machine)
    errfile = tmp_path / "stderr"
    null = os.open(os.devnull, os.O_RDWR)
    err = os.open(errfile, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        reply = _send_as_child(sock, sys.executable, ["--config", str(shim.config), "--cwd", "/", "--", "state", "x"],
                               (), (null, null, err))
        assert reply == f"runtime {shim.lowlevel}".encode()
        bundle = bundle_without_hooks(tmp_path / "b", machine, ["NVIDIA_VISIBLE_DEVICES=nonsense"])
        written = (bundle / "config.json").read_bytes()
        reply = _send_as_child(sock, sys.executable, ["--config", str(shim.config), "--cwd", str(bundle), "--",
                                                      "create", "c1"], (), (null, null, err))
        assert reply == b"rc 1"
        assert (bundle / "config.json").read_bytes() == written
    finally:
        os.close(null)
        os.close(err)
    assert errfile.read_text().count("\n") == 1 and "nonsense" in errfile.read_text()
    assert json.loads((bundle / "config.json").read_text())["process"]
