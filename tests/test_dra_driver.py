"""``nvcontainer dra-driver`` as the kubelet sees it: a real plugin process on the fake GPU
machines, the fake API server (tests/fixtures/kubeapi.py) serving the claims, and a fake
kubelet (tests/fixtures/dra_kubelet.py: the plugin watcher's registration client and the DRA
clients generated from the published protos).

The devices a claim gets are checked against the fake machine's own description (machine.json),
not against the plugin's code."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from nvcontainer.cdi import store
from nvcontainer.dra import checkpoint, claimspec
from tests.fixtures.dra_kubelet import FakeDraKubelet
from tests.fixtures.fakegpu import FakeSpec, run_in_fake_proc
from tests.fixtures.kubeapi import FakeApiServer, answer
from tests.fixtures.kubelet import Plugin, inject_event, plugin_config, set_driver_state

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
API = "resource.nvidia.com/v1beta1"
MIG = FakeSpec(gpus=2, mig=True, mig_gpus=1, mig_devices=2, mig_profiles=("1g.10gb", "2g.20gb"))


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


class Node:
    """The directories of one node: kubelet's, CDI's, and the plugin's state."""

    def __init__(self, base, hook: str = "/usr/local/bin/nvcontainer-hook"):
        self.base = base
        self.hook = hook
        self.registrar = base / "plugins_registry"
        self.plugins = base / "plugins"
        self.cdi = base / "cdi"
        for d in (self.registrar, self.plugins):
            d.mkdir(mode=0o700, exist_ok=True)
        self.config = plugin_config(base / "config.toml", base / "cache", {})

    def args(self, kubeconfig: str) -> list[str]:
        return ["--node-name", NODE, "--cdi-root", str(self.cdi), "--kubelet-registrar-directory-path",
                str(self.registrar), "--kubelet-plugins-directory-path", str(self.plugins), "--kubeconfig", kubeconfig,
                "--hook-path", self.hook]

    def specs(self) -> list[str]:
        return sorted(os.listdir(self.cdi)) if self.cdi.exists() else []


@contextlib.contextmanager
def driver(machine, node: Node, server: FakeApiServer, *, env=None, extra=()):
    args = [*node.args(server.write_kubeconfig(str(node.base / "kubeconfig"))), "--sysfs", str(machine.sysfs), *extra]
    plugin = Plugin(machine, node.config, node.base / "debug.log", args, command="dra-driver", env=env)
    kubelet = FakeDraKubelet(node.registrar, node.plugins, timeout=20)
    try:
        plugin.wait_for("serving gpu.nvidia.com")
        kubelet.wait_registered()
        plugin.wait_for("registered with the kubelet")
        yield kubelet, plugin
    finally:
        kubelet.close()
        code = plugin.terminate()
        err = plugin.stderr()
        assert "Traceback" not in err, err
        assert code == 0, err


def put(server: FakeApiServer, name: str, devices, *, configs=(), request="gpu", pool=NODE,
        admin=False) -> tuple[str, str, str]:
    extra = {"adminAccess": True} if admin else {}
    claim = server.put_claim({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name, "uid": f"0000-{name}"},
        "status": {"allocation": {"devices": {
            "results": [{"request": request, "driver": DRIVER, "pool": pool, "device": d, **extra} for d in devices],
            "config": list(configs)}}}})
    return "default", name, claim["metadata"]["uid"]


def claim_reads(server: FakeApiServer) -> int:
    return len([r for r in server.requests if "/resourceclaims/" in r[1]])


@pytest.fixture
def server():
    s = FakeApiServer()
    s.put_node(NODE)
    yield s
    s.stop()


def test_registration_as_the_plugin_watcher_sees_it(machine, tmp_path, server):
    node = Node(tmp_path)
    with driver(machine, node, server) as (kubelet, _):
        info = kubelet.info
        assert (info.type, info.name) == ("DRAPlugin", DRIVER)
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        assert info.endpoint == str(node.plugins / DRIVER / "dra.sock")
        assert sorted(os.listdir(node.registrar)) == [f"{DRIVER}-reg.sock"]
    assert os.listdir(node.registrar) == [] and not (node.plugins / DRIVER / "dra.sock").exists()


@pytest.mark.parametrize("version", ["v1.DRAPlugin", "v1beta1.DRAPlugin"])
def test_prepare_and_unprepare_in_each_version(machine, tmp_path, server, version):
    node = Node(tmp_path)
    truth = machine.description()["gpus"]
    one = put(server, "one", ["gpu-1"])
    both = put(server, "both", ["gpu-0", "gpu-1"], admin=True)        # may share gpu-1 with "one"
    with driver(machine, node, server) as (kubelet, _):
        got = kubelet.prepare(one, both, version=version)
        assert got[one[2]] == ("", [("gpu-1", [f"k8s.gpu.nvidia.com/claim={one[2]}-gpu-1"])])
        assert [d for d, _ in got[both[2]][1]] == ["gpu-0", "gpu-1"]
        assert node.specs() == sorted(claimspec.file_name(c[2]) for c in (one, both))
        spec = store.read_spec(str(node.cdi / claimspec.file_name(one[2]))).spec
        nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
        minor = next(g["minor"] for g in truth if g["index"] == 1)
        assert f"/dev/nvidia{minor}" in nodes and len([n for n in nodes if n.startswith("/dev/nvidia")]) == 1
        assert kubelet.unprepare(one, both, version=version) == {one[2]: "", both[2]: ""}
        assert node.specs() == []


def test_restart_keeps_prepared_claims_and_kubelet_wipes_are_repaired(machine, tmp_path, server):
    node = Node(tmp_path)
    claim = put(server, "keep", ["gpu-0"])
    with driver(machine, node, server) as (kubelet, plugin):
        first = kubelet.prepare(claim)
        kubelet.wipe()                                   # the kubelet restarts and cleans up
        plugin.wait_for("serving and registering again")
        kubelet.wait_registered(new=True)
        assert kubelet.prepare(claim) == first
    server.delete_claim("default", "keep")               # gone from the API server meanwhile
    reads = claim_reads(server)
    with driver(machine, node, server) as (kubelet, _):
        assert kubelet.prepare(claim) == first            # from the checkpoint
        assert claim_reads(server) == reads
        assert kubelet.unprepare(claim) == {claim[2]: ""}
    assert node.specs() == []


def test_faults_are_errors_naming_the_claim_and_the_plugin_keeps_serving(machine, tmp_path, server):
    node = Node(tmp_path)
    absent = put(server, "absent", ["gpu-7"])
    other_pool = put(server, "elsewhere", ["gpu-0"], pool="node-b")
    mps = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 200}}
    bad = put(server, "bad", ["gpu-0"], configs=[{"source": "FromClaim", "requests": [], "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": API, "kind": "GpuConfig", "sharing": mps}}}])
    with driver(machine, node, server) as (kubelet, plugin):
        got = kubelet.prepare(absent, other_pool, bad, ("default", "deleted", "0000-deleted"))
        assert "device gpu-7 is not on node node-a" in got[absent[2]][0]
        assert got[other_pool[2]] == ("", [])            # nothing of this node in it
        assert "defaultActiveThreadPercentage: 200" in got[bad[2]][0]
        assert "claim default/deleted: deleted" in got["0000-deleted"][0]
        assert node.specs() == []
        # malformed request: refused, and the plugin keeps serving
        pb, stub, channel = kubelet.service()
        method = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
        with channel, pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(method)(b"\xff\xff", timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the API server down: an error in time, not a hang
        server.down = True
        start = time.monotonic()
        down = put(server, "down", ["gpu-0"])
        got = kubelet.prepare(down, timeout=6)
        assert got[down[2]][0] and time.monotonic() - start < 6
        server.down = False
        assert kubelet.prepare(down)[down[2]][0] == ""
        assert "Traceback" not in plugin.stderr()


def test_a_hostile_checkpoint_is_rebuilt_with_one_line(machine, tmp_path, server):
    node = Node(tmp_path)
    claim = put(server, "c", ["gpu-1"])
    with driver(machine, node, server) as (kubelet, _):
        first = kubelet.prepare(claim)
    (node.plugins / DRIVER / checkpoint.NAME).write_bytes(b'{"version":1,"claims":{"x":' + b"[" * 100000)
    with driver(machine, node, server) as (kubelet, plugin):
        lines = [line for line in plugin.stderr().splitlines() if line.startswith("nvcontainer dra-driver: checkpoint")]
        assert len(lines) == 1 and "rebuilt from 1 claim specs" in lines[0], plugin.stderr()
        assert kubelet.prepare(claim) == first


def test_a_shared_claim_prepared_for_two_pods_at_once_is_read_once(machine, tmp_path, server):
    """Two pods of one claim: the kubelet prepares it for each, maybe at once; one API read, one
    spec, the same answer."""
    node = Node(tmp_path)
    shared = put(server, "shared", ["gpu-0"])
    with driver(machine, node, server) as (kubelet, _):
        before = claim_reads(server)
        server.slow = 0.5
        with ThreadPoolExecutor(2) as pool:
            one, two = pool.map(lambda _: kubelet.prepare(shared), range(2))
        server.slow = 0.0
        assert one == two and one[shared[2]][0] == ""
        assert claim_reads(server) - before == 1
        assert node.specs() == [claimspec.file_name(shared[2])]


def test_a_mig_claim(fake_machine_factory, tmp_path, server):
    machine = fake_machine_factory(MIG)
    truth = machine.description()["gpus"]
    node = Node(tmp_path)
    with driver(machine, node, server) as (kubelet, _):
        from nvcontainer.dra import names
        from nvcontainer.inventory.build import build

        inv = build(str(machine.root), proc=str(machine.proc))
        migs = [n for n in names.devices(inv) if n.mig is not None]
        whole = [n for n in names.devices(inv) if n.mig is None]
        claim = put(server, "mig", [migs[0].name, whole[0].name])
        error, devices = kubelet.prepare(claim)[claim[2]]
        assert error == "" and [d for d, _ in devices] == [migs[0].name, whole[0].name]
        spec = store.read_spec(str(node.cdi / claimspec.file_name(claim[2]))).spec
        by_name = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
        mig_truth = next(m for g in truth for m in g["migs"] if m["uuid"] == migs[0].mig.uuid)
        parent = next(g for g in truth if any(m["uuid"] == mig_truth["uuid"] for m in g["migs"]))
        nodes = by_name[f"{claim[2]}-{migs[0].name}"]
        assert f"/dev/nvidia{parent['minor']}" in nodes
        assert len([n for n in nodes if n.startswith("/dev/nvidia-caps/")]) == 2
        assert kubelet.unprepare(claim) == {claim[2]: ""} and node.specs() == []


def test_slices_published_health_refuses_prepare_and_remove_slices(private_machine, tmp_path, server):
    """The slice side runs in the same process: this node's slices appear, a GPU the health
    watcher finds unhealthy (XID 79) is refused at prepare naming it, and --remove-slices
    deletes the node's slices."""
    machine = private_machine(FakeSpec(gpus=2))
    node = Node(tmp_path)
    plugin_config(node.config, tmp_path / "cache", {"heartbeat-seconds": 0.2, "heartbeat-timeout-seconds": 1.0})
    bad = next(g for g in machine.description()["gpus"] if g["index"] == 1)
    claim = put(server, "sick", [f"gpu-{bad['minor']}"])
    with driver(machine, node, server) as (kubelet, plugin):
        end = time.monotonic() + 30
        while not server.node_slices(NODE) and time.monotonic() < end:
            time.sleep(0.1)
        names = {d["name"] for s in server.node_slices(NODE) for d in s["spec"]["devices"]}
        assert names == {f"gpu-{g['minor']}" for g in machine.description()["gpus"]}
        plugin.wait_for("watching 2 GPU(s)")
        inject_event(machine, 1, 79)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            error, _ = kubelet.prepare(claim)[claim[2]]
            if error:
                break
            kubelet.unprepare(claim)
            time.sleep(0.2)
        assert f"device gpu-{bad['minor']} ({bad['uuid']}) is unhealthy" in error, plugin.stderr()
    kubeconfig = server.write_kubeconfig(str(tmp_path / "kubeconfig"))
    res = run_in_fake_proc(machine, [sys.executable, "-m", "nvcontainer", "dra-driver", "--node-name", NODE,
                                     "--kubeconfig", kubeconfig, "--remove-slices"],
                           capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("removed "), res.stderr
    assert server.node_slices(NODE) == []


def test_a_kubelet_restart_mid_prepare(machine, tmp_path, server):
    """The kubelet restarts (its sockets wiped) while a prepare waits on a slow API server: the
    prepare finishes, the plugin serves and registers again, the repeated prepare gets the same
    names from the checkpoint, and the CDI directory holds the one spec, nothing half-written."""
    node = Node(tmp_path)
    claim = put(server, "midway", ["gpu-1"])
    with driver(machine, node, server) as (kubelet, plugin):
        server.slow = 1.5
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(kubelet.prepare, claim)
            time.sleep(0.5)
            kubelet.wipe()
            first = pending.result(timeout=30)
        server.slow = 0.0
        plugin.wait_for("serving and registering again")
        kubelet.wait_registered(new=True)
        assert kubelet.prepare(claim) == first and first[claim[2]][0] == ""
        assert os.listdir(node.cdi) == [claimspec.file_name(claim[2])]
        assert "Traceback" not in plugin.stderr()


def test_a_refused_registration_is_one_line_and_the_plugin_keeps_serving(machine, tmp_path, server):
    node = Node(tmp_path)
    args = [*node.args(server.write_kubeconfig(str(node.base / "kubeconfig"))), "--sysfs", str(machine.sysfs)]
    plugin = Plugin(machine, node.config, node.base / "debug.log", args, command="dra-driver")
    try:
        FakeDraKubelet(node.registrar, node.plugins, refuse="plugin name taken").wait_registered()
        plugin.wait_for("the kubelet refused the registration: plugin name taken")
        kubelet = FakeDraKubelet(node.registrar, node.plugins)
        kubelet.wait_registered()                      # the watcher tries again: still served
        plugin.wait_for("registered with the kubelet as gpu.nvidia.com")
    finally:
        assert plugin.terminate() == 0
    assert "Traceback" not in plugin.stderr()


@pytest.mark.parametrize("args, env, line", [
    ([], {}, "nvcontainer: input error: --node-name (or NODE_NAME) is required"),
    (["--cdi-root", "relative"], {"NODE_NAME": "n"}, "nvcontainer: input error: --cdi-root relative: must be an absolute"),
    (["--kubeconfig", "/nonexistent", "--remove-slices"], {"NODE_NAME": "n"},
     "nvcontainer: kubernetes error: kubeconfig /nonexistent: "),
])
def test_bad_input_is_one_line(args, env, line, tmp_path):
    import subprocess

    res = subprocess.run([sys.executable, "-m", "nvcontainer", "dra-driver", *args], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], **env}, cwd=tmp_path, timeout=60)
    assert res.returncode == 1 and res.stderr.startswith(line) and res.stderr.count("\n") == 1, res.stderr


def test_time_slicing_runs_the_drivers_nvidia_smi(machine, tmp_path, server):
    node = Node(tmp_path)
    config = {"source": "FromClass", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing",
                                                            "timeSlicingConfig": {"interval": "Long"}}}}}
    claim = put(server, "sliced", ["gpu-0"], configs=[config])
    uuid = next(g["uuid"] for g in machine.description()["gpus"] if g["index"] == 0)
    with driver(machine, node, server) as (kubelet, _):
        assert kubelet.prepare(claim)[claim[2]][0] == ""
        assert kubelet.unprepare(claim) == {claim[2]: ""}
    trace = (node.base / "debug.log").read_text()
    assert f"time-slice of {uuid} set to Long for claim default/sliced" in trace
    assert "not reset" not in trace


def test_an_mps_claim_s_daemon_outlives_a_plugin_restart_and_goes_with_unprepare(machine, tmp_path, server):
    from tests.test_deviceplugin_mps import has, record, told

    for path in (machine.mps_record, Path(f"{machine.mps_record}.state")):
        path.unlink(missing_ok=True)
    node = Node(tmp_path)
    config = {"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": {
            "defaultActiveThreadPercentage": 25}}}}}
    claim = put(server, "mps", ["gpu-1"], configs=[config])
    uuid = next(g["uuid"] for g in machine.description()["gpus"] if g["index"] == 1)
    here = node.plugins / DRIVER / "mps" / claim[2] / "config-0"
    started = lambda: [pid for kind, pid, _ in record(machine) if kind == "start"]   # noqa: E731
    try:
        with driver(machine, node, server) as (kubelet, _):
            assert kubelet.prepare(claim)[claim[2]][0] == ""
            [pid] = started()
            env = [text for kind, p, text in record(machine) if kind == "env" and p == pid]
            assert f"CUDA_VISIBLE_DEVICES={uuid}" in env and f"CUDA_MPS_PIPE_DIRECTORY={here}/pipe" in env
            assert told(machine, pid, has("set_default_active_thread_percentage 25")) == [
                "set_default_active_thread_percentage 25"]
            spec = store.read_spec(str(node.cdi / claimspec.file_name(claim[2]))).spec
            assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in spec["devices"][0]["containerEdits"]["env"]
        assert (here / "pipe" / "control").is_fifo()          # the plugin stopped; the daemon did not
        with driver(machine, node, server) as (kubelet, _):
            assert kubelet.prepare(claim)[claim[2]][0] == ""
            assert started() == [pid]                          # re-adopted, not started again
            assert kubelet.unprepare(claim) == {claim[2]: ""}
        assert told(machine, pid, has("quit"))[-1] == "quit"
        assert not (node.plugins / DRIVER / "mps").exists() and node.specs() == []
    finally:
        for pid in started():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_a_trickling_api_server_holds_no_worker_past_the_deadline(machine, tmp_path, server):
    """Issue 35: the API server trickles every answer a byte at a time (each byte inside the
    per-read timeout). Eight claims at once (more than the plugin's worker threads) each end at
    their deadline with one line, an unprepare meanwhile is answered, and once the server is
    well a claim is prepared: nothing is wedged."""
    node = Node(tmp_path)
    good = put(server, "good", ["gpu-0"])
    many = [put(server, f"slow-{i}", ["gpu-1"]) for i in range(8)]
    with driver(machine, node, server) as (kubelet, plugin):
        assert kubelet.prepare(good)[good[2]][0] == ""
        body = b'{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {}}' + b" " * 400
        server.hostile = answer(body, trickle=0.1)       # 48 s a body; the deadline is 5 - 2 s
        start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(kubelet.prepare, *many, timeout=5)
            time.sleep(1)
            assert kubelet.unprepare(good) == {good[2]: ""}
            got = pending.result(timeout=10)
        assert time.monotonic() - start < 6
        assert all("default/slow-" in error and "\n" not in error for error, _ in got.values()), got
        server.hostile = None
        again = put(server, "again", ["gpu-0"])
        start = time.monotonic()
        assert kubelet.prepare(again, timeout=5)[again[2]][0] == ""
        assert time.monotonic() - start < 2
        assert "Traceback" not in plugin.stderr()


def test_hostile_claims_and_answers_are_one_line_each_and_the_plugin_keeps_serving(machine, tmp_path, server):
    """Issue 35 under the served path: a ten-character quantity that was computed for 16 s on
    the event loop, a per-device key int() cannot read, and answers that are no claim (an HTML
    page, an array, JSON nested 100,000 deep): each claim gets one line, at once."""
    node = Node(tmp_path)

    def mps(**config):
        return [{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": config}}}}]

    huge = put(server, "huge", ["gpu-0"], configs=mps(defaultPinnedDeviceMemoryLimit="1e10000000"))
    key = put(server, "key", ["gpu-0"], configs=mps(defaultPerDevicePinnedMemoryLimit={"\u00b2": "1Gi"}))
    with driver(machine, node, server) as (kubelet, plugin):
        start = time.monotonic()
        got = kubelet.prepare(huge, key, timeout=10)
        assert time.monotonic() - start < 3
        assert "defaultPinnedDeviceMemoryLimit: 1e10000000: out of range" in got[huge[2]][0]
        assert "defaultPerDevicePinnedMemoryLimit: \u00b2: names no device" in got[key[2]][0]
        for body, content_type, line in ((b"<html>login</html>", "text/html", "invalid JSON"),
                                         (b"[]", "application/json", "JSON list, not an object"),
                                         (b"[" * 100_000 + b"]" * 100_000, "application/json", "nested deeper")):
            server.hostile = answer(body, content_type=content_type)
            claim = put(server, f"c-{len(body)}", ["gpu-0"])
            error, devices = kubelet.prepare(claim, timeout=10)[claim[2]]
            assert line in error and "\n" not in error and devices == [], error
        server.hostile = None
        newline = ("default", "newline", "0000-newline\n")     # a UID that passed ^...$ with re.match
        server.put_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                          "metadata": {"namespace": "default", "name": "newline", "uid": newline[2]},
                          "status": {"allocation": {"devices": {"results": [
                              {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]}}}})
        error, _ = kubelet.prepare(newline, timeout=10)[newline[2]]
        assert "not a UID" in error and node.specs() == []
        good = put(server, "good", ["gpu-0"])
        assert kubelet.prepare(good, timeout=10)[good[2]][0] == ""
        assert node.specs() == [claimspec.file_name(good[2])]
        assert "Traceback" not in plugin.stderr()


def host_paths(spec: dict) -> list[str]:
    every = [spec.get("containerEdits", {}), *(d["containerEdits"] for d in spec["devices"])]
    return ([m["hostPath"] for e in every for m in e.get("mounts", ())]
            + [n.get("hostPath", n["path"]) for e in every for n in e.get("deviceNodes", ())]
            + [h["path"] for e in every for h in e.get("hooks", ())])


@pytest.mark.parametrize("env", [{"NVIDIA_DRIVER_ROOT": "/"}, {"HOST_DRIVER_ROOT": "/"}, {}])
def test_nvidia_s_driver_root_variables_give_specs_of_host_paths(machine, tmp_path, server, env):
    """NVIDIA's chart: the host's / mounted at DRIVER_ROOT_CTR_PATH, NVIDIA_DRIVER_ROOT the host's
    path (default /). The spec names what the host has, never where the plugin reads it."""
    node = Node(tmp_path, hook="/usr/bin/nvcontainer-hook")
    claim = put(server, "rooted", ["gpu-0"])
    with driver(machine, node, server, env={**env, "DRIVER_ROOT_CTR_PATH": str(machine.root)}) as (kubelet, _):
        assert kubelet.prepare(claim)[claim[2]][0] == ""
        spec = store.read_spec(str(node.cdi / claimspec.file_name(claim[2]))).spec
    paths = host_paths(spec)
    assert any("libcuda.so" in p for p in paths) and any(p.startswith("/dev/nvidia") for p in paths)
    assert not [p for p in paths if p.startswith(str(machine.root))]
    # each names the host's file: under the host's / (the fake machine's root) it is there
    assert not [p for p in paths if p != node.hook and not os.path.lexists(str(machine.root) + p)]


def test_a_host_driver_root_elsewhere_is_named_in_the_spec(machine, tmp_path, server):
    """The GPU Operator's driver container: /run/nvidia/driver on the host, mounted here."""
    node = Node(tmp_path)
    claim = put(server, "operator", ["gpu-1"])
    env = {"NVIDIA_DRIVER_ROOT": "/run/nvidia/driver", "DRIVER_ROOT_CTR_PATH": str(machine.root)}
    with driver(machine, node, server, env=env) as (kubelet, _):
        assert kubelet.prepare(claim)[claim[2]][0] == ""
        spec = store.read_spec(str(node.cdi / claimspec.file_name(claim[2]))).spec
    mounts = [m["hostPath"] for m in spec["containerEdits"]["mounts"]]
    assert mounts and all(m.startswith("/run/nvidia/driver/") for m in mounts), mounts


@pytest.mark.parametrize("taint", [False, True])
def test_a_driver_without_nvml_events_keeps_every_device(private_machine, tmp_path, server, taint):
    """nvmlEventSetCreate fails: every device stays published and preparable, health checks off
    said once; under --taint-unhealthy each carries NVIDIA's unmonitored taint."""
    machine = private_machine(FakeSpec(gpus=2))
    set_driver_state(machine, "no_events=1")
    node = Node(tmp_path)
    claim = put(server, "unwatched", ["gpu-0"])
    with driver(machine, node, server, extra=["--taint-unhealthy"] if taint else []) as (kubelet, plugin):
        plugin.wait_for("health checks off: the driver's NVML has no event API (nvmlEventSetCreate: Not Supported)")
        end = time.monotonic() + 30
        while time.monotonic() < end:
            devices = [d for s in server.node_slices(NODE) for d in s["spec"]["devices"]]
            if len(devices) == 2 and (not taint or all(d.get("taints") for d in devices)):
                break
            time.sleep(0.1)
        assert len(devices) == 2
        taints = [t["key"] for d in devices for t in d.get("taints", ())]
        assert taints == (["gpu.nvidia.com/unmonitored"] * 2 if taint else [])
        assert kubelet.prepare(claim)[claim[2]][0] == ""
        assert plugin.stderr().count("health checks off") == 1
