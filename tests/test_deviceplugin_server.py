"""``nvcontainer device-plugin`` as the kubelet sees it: a real plugin process on the fake GPU
machines (2 and 8 GPUs, MIG or not), a fake kubelet (the Registration service, and DevicePlugin
clients from the stubs generated from the published API) in a temporary directory.

What the kubelet is told is checked against the fake machine's own description (machine.json,
written by its builder), not against the plugin's code: the UUIDs, NUMA nodes and MIG profiles
the builder put there."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest

from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb
from tests.fixtures.fakegpu import FakeSpec, run_in_fake_proc
from tests.fixtures.kubelet import FakeKubelet, Plugin, Watch, inject_event, plugin_config, set_driver_state

FAST = {"heartbeat-seconds": 0.2, "heartbeat-timeout-seconds": 1.0}
MIG_MIXED2 = FakeSpec(gpus=2, mig=True, mig_devices=3, mig_profiles=("1g.10gb", "2g.20gb"))
MIG_SINGLE2 = FakeSpec(gpus=2, mig=True, mig_gpus=2, archs=("8.0", "8.0"))
MIG_SINGLE8 = FakeSpec(gpus=8, mig=True, mig_gpus=8, mig_devices=3, archs=("8.0",) * 8)
MIG_MIXED8 = FakeSpec(gpus=8, mig=True, mig_gpus=4, mig_devices=2, archs=("8.0", "8.0", "9.0", "8.0"),
                      mig_profiles=("1g.10gb", "3g.40gb"))


@pytest.fixture(scope="module", autouse=True)
def _needs_root(fake_machine_factory):
    fake_machine_factory   # skips the module without root or gcc


@contextlib.contextmanager
def serving(machine, tmp_path, table=None, *, top="", args=(), kubelet=True, expect_exit=False):
    """A fake kubelet (unless ``kubelet`` is False) and the plugin, stopped (SIGTERM) at the end,
    when the plugin must have exited 0 and never printed a traceback."""
    directory = tmp_path / "device-plugins"
    directory.mkdir(mode=0o700, exist_ok=True)
    settings = {"socket-dir": str(directory), "sysfs": str(machine.sysfs), **FAST, **(table or {})}
    config = plugin_config(tmp_path / "config.toml", tmp_path / "cache", settings, top)
    fake = FakeKubelet(directory).start() if kubelet else FakeKubelet(directory)
    plugin = Plugin(machine, config, tmp_path / "debug.log", args)
    try:
        yield fake, plugin
    finally:
        try:
            code = plugin.terminate()
        finally:
            fake.stop()      # its gRPC threads must not outlive the test: later tests fork
        err = plugin.stderr()
        assert "Traceback" not in err, err
        if not expect_exit:
            assert code == 0, err


def expected(machine, mig_strategy: str, id_strategy: str = "uuid") -> dict[str, list[tuple[str, int]]]:
    """Resource → [(ID, NUMA node)], from machine.json."""
    gpus = machine.description()["gpus"]

    def gid(g):
        return g["uuid"] if id_strategy == "uuid" else str(g["index"])

    def mid(g, m):
        return m["uuid"] if id_strategy == "uuid" else f"{g['index']}:{m['index']}"

    if mig_strategy == "none":
        return {"nvidia.com/gpu": [(gid(g), g["numa"]) for g in gpus]}
    if mig_strategy == "single":
        return {"nvidia.com/gpu": [(mid(g, m), g["numa"]) for g in gpus for m in g["migs"]]}
    out = {"nvidia.com/gpu": [(gid(g), g["numa"]) for g in gpus if not g["migs"]]}
    for g in gpus:
        for m in g["migs"]:
            out.setdefault(f"nvidia.com/mig-{m['profile']}", []).append((mid(g, m), g["numa"]))
    return out


CASES = [
    ("2 GPUs", FakeSpec(gpus=2), "none", "uuid"),
    ("8 GPUs", FakeSpec(gpus=8), "none", "uuid"),
    ("8 GPUs by index", FakeSpec(gpus=8), "none", "index"),
    ("2 GPUs, MIG, none", MIG_MIXED2, "none", "uuid"),
    ("2 GPUs, MIG, single", MIG_SINGLE2, "single", "uuid"),
    ("8 GPUs, MIG, single", MIG_SINGLE8, "single", "index"),
    ("2 GPUs, MIG, mixed", MIG_MIXED2, "mixed", "uuid"),
    ("8 GPUs, MIG, mixed", MIG_MIXED8, "mixed", "index"),
]


@pytest.mark.parametrize("spec, mig_strategy, id_strategy", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_registers_lists_prefers_and_allocates(fake_machine_factory, tmp_path, spec, mig_strategy, id_strategy):
    machine = fake_machine_factory(spec)
    want = expected(machine, mig_strategy, id_strategy)
    table = {"mig-strategy": mig_strategy, "device-id-strategy": id_strategy}
    with serving(machine, tmp_path, table) as (kubelet, plugin):
        requests = kubelet.wait_registered(len(want))
        assert {r.resource_name for r in requests} == set(want)
        for r in requests:
            assert r.version == "v1beta1" and r.options.get_preferred_allocation_available
            assert not r.options.pre_start_required
            assert r.endpoint == f"nvcontainer-{r.resource_name.split('/')[1]}.sock"
            assert (kubelet.directory / r.endpoint).is_socket()
            assert oct((kubelet.directory / r.endpoint).stat().st_mode & 0o777) == "0o700"
            stub = kubelet.plugin(r.endpoint)
            options = stub.GetDevicePluginOptions(pb.Empty())
            assert options.get_preferred_allocation_available and not options.pre_start_required
            watch = Watch(stub)
            devices = watch.next()
            assert devices == {i: ("Healthy", (numa,)) for i, numa in want[r.resource_name]}
            watch.cancel()
            if not devices:
                continue
            ids = [i for i, _ in want[r.resource_name]]
            pref = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, must_include_deviceIDs=ids[-1:],
                                                       allocation_size=min(2, len(ids)))]))
            (chosen,) = pref.container_responses
            assert len(chosen.deviceIDs) == min(2, len(ids)) and chosen.deviceIDs[0] == ids[-1]
            got = stub.Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=ids[:2]), pb.ContainerAllocateRequest(devices_ids=ids[-1:])]))
            assert [dict(c.envs) for c in got.container_responses] == [
                {"NVIDIA_VISIBLE_DEVICES": ",".join(ids[:2])}, {"NVIDIA_VISIBLE_DEVICES": ids[-1]}]
            assert stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids[:1])) == \
                pb.PreStartContainerResponse()
        assert plugin.stderr().count("registered") == 1


STRATEGIES = {
    "envvar": lambda ids, kind: ({"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}, [], {}, []),
    "volume-mounts": lambda ids, kind: ({"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"},
                                        [(f"/var/run/nvidia-container-devices/{i}", "/dev/null", True) for i in ids],
                                        {}, []),
    "cdi-annotations": lambda ids, kind: ({}, [], {"value": ",".join(f"{kind}={i}" for i in ids)}, []),
    "cdi-cri": lambda ids, kind: ({}, [], {}, [f"{kind}={i}" for i in ids]),
}


@pytest.mark.parametrize("gpus", [2, 8])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_allocate_under_each_strategy(fake_machine_factory, tmp_path, strategy, gpus):
    machine = fake_machine_factory(FakeSpec(gpus=gpus))
    uuids = [g["uuid"] for g in machine.description()["gpus"]]
    wanted = [uuids[-1], uuids[gpus // 4]]
    with serving(machine, tmp_path, {"device-list-strategy": [strategy]}) as (kubelet, _):
        (reg,) = kubelet.wait_registered(1)
        got = kubelet.plugin(reg.endpoint).Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=wanted)]))
        (c,) = got.container_responses
        envs, mounts, annotations, cdi = STRATEGIES[strategy](wanted, "nvidia.com/gpu")
        assert dict(c.envs) == envs
        assert [(m.container_path, m.host_path, m.read_only) for m in c.mounts] == mounts
        assert list(c.annotations.values()) == list(annotations.values())
        for key in c.annotations:
            assert key.startswith("cdi.k8s.io/nvcontainer-device-plugin_") and len(key.split("/")[1]) <= 63
        assert [d.name for d in c.cdi_devices] == cdi
        assert not c.devices


def test_preferred_allocation_follows_numa_and_nvlink(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=8))
    u = [g["uuid"] for g in machine.description()["gpus"]]
    with serving(machine, tmp_path) as (kubelet, plugin):
        (reg,) = kubelet.wait_registered(1)
        stub = kubelet.plugin(reg.endpoint)
        plugin.wait_for("health watcher: watching 8 GPU(s)")
        time.sleep(0.3)     # the topology report follows the ready line

        def prefer(available, size, must=()):
            resp = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=[u[i] for i in available],
                                                       must_include_deviceIDs=[u[i] for i in must],
                                                       allocation_size=size)]))
            return sorted(u.index(i) for i in resp.container_responses[0].deviceIDs)

        assert prefer(range(8), 2, (1,)) == [0, 1]          # NVLink x2 beats the x1 bridge to 2
        assert prefer(range(8), 2, (2,)) == [2, 3]
        assert prefer(range(8), 4) == [0, 1, 2, 3]          # one NUMA node
        assert prefer([0, 4, 5, 6], 2) == [4, 5]
        assert prefer([1, 2, 4, 7], 2) == [1, 2]            # the only NVLink pair on one node
        assert prefer([0, 3, 4, 7], 2, (4,)) == [4, 7]      # same NUMA node beats nothing


def test_health_changes_reach_list_and_watch_within_a_second(private_machine, tmp_path):
    machine = private_machine(FakeSpec(gpus=8))
    u = [g["uuid"] for g in machine.description()["gpus"]]
    table = {"replicas": 2, "xid-recovery-seconds": 2}
    with serving(machine, tmp_path, table) as (kubelet, plugin):
        (reg,) = kubelet.wait_registered(1)
        stub = kubelet.plugin(reg.endpoint)
        watch = Watch(stub)
        devices = watch.next()
        assert sorted(devices) == sorted(f"{x}::{k}" for x in u for k in (0, 1))
        plugin.wait_for("health watcher: watching 8 GPU(s)")

        def unhealthy(devs):
            return sorted({i.split("::")[0] for i, (h, _) in devs.items() if h == "Unhealthy"})

        inject_event(machine, 3, 13)                # an application error: the GPU stays healthy
        started = time.monotonic()
        inject_event(machine, 5, 79)
        devices = watch.next(timeout=1.0)
        assert time.monotonic() - started < 1.0
        assert unhealthy(devices) == [u[5]]
        assert devices[f"{u[5]}::0"][0] == devices[f"{u[5]}::1"][0] == "Unhealthy"   # every replica
        with pytest.raises(grpc.RpcError) as err:
            stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
                devices_ids=[f"{u[5]}::1"])]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details() == f"device {u[5]}::1 of nvidia.com/gpu is unhealthy"

        set_driver_state(machine, "gpu2.lost=1")
        started = time.monotonic()
        devices = watch.until(lambda d: u[2] in unhealthy(d), timeout=2)
        assert time.monotonic() - started < 1.0
        set_driver_state(machine)
        devices = watch.until(lambda d: u[2] not in unhealthy(d), timeout=2)
        watch.until(lambda d: unhealthy(d) == [], timeout=4)    # the XID lapses after 2 s
        assert "healthy again" in plugin.wait_for(f"GPU 5 ({u[5]}) healthy again")

        before = plugin.watchers()
        set_driver_state(machine, "hang=1")          # the driver stops answering
        devices = watch.until(lambda d: len(unhealthy(d)) == 8, timeout=5)
        set_driver_state(machine)
        watch.until(lambda d: unhealthy(d) == [], timeout=10)
        assert plugin.watchers() and plugin.watchers() != before     # a new watcher
        err_text = plugin.stderr()
        assert err_text.count("every device unhealthy: no heartbeat") == 1
        watch.cancel()


def test_mig_instance_xid_marks_only_its_device(private_machine, tmp_path):
    machine = private_machine(MIG_MIXED2)
    gpus = machine.description()["gpus"]
    m1 = gpus[0]["migs"][1]                  # 2g.20gb
    with serving(machine, tmp_path, {"mig-strategy": "mixed"}) as (kubelet, plugin):
        regs = {r.resource_name: r for r in kubelet.wait_registered(3)}
        watches = {name: Watch(kubelet.plugin(r.endpoint)) for name, r in regs.items()}
        for w in watches.values():
            w.next()
        plugin.wait_for("health watcher: watching 2 GPU(s)")
        inject_event(machine, 0, 94, gi=m1["gi"], ci=m1["ci"])
        changed = watches["nvidia.com/mig-2g.20gb"].next(timeout=1)
        assert changed == {m1["uuid"]: ("Unhealthy", (0,))}
        with pytest.raises(Exception):
            watches["nvidia.com/mig-1g.10gb"].next(timeout=0.5)     # nothing changed there
        for w in watches.values():
            w.cancel()


def test_kubelet_restart_reregisters_and_keeps_state(private_machine, tmp_path):
    machine = private_machine(FakeSpec(gpus=2))
    u = [g["uuid"] for g in machine.description()["gpus"]]
    with serving(machine, tmp_path) as (kubelet, plugin):
        (reg,) = kubelet.wait_registered(1)
        watch = Watch(kubelet.plugin(reg.endpoint))
        watch.next()
        plugin.wait_for("health watcher: watching")
        inject_event(machine, 1, 48)
        watch.until(lambda d: d[u[1]][0] == "Unhealthy")
        old = (kubelet.directory / reg.endpoint).stat()
        kubelet.restart()                      # removes every socket, the plugin's too
        (again,) = kubelet.wait_registered(1, timeout=10)
        new = (kubelet.directory / again.endpoint).stat()
        assert again.endpoint == reg.endpoint and (new.st_ino, new.st_ctime_ns) != (old.st_ino, old.st_ctime_ns)
        watch2 = Watch(kubelet.plugin(again.endpoint))
        assert watch2.next() == {u[0]: ("Healthy", (0,)), u[1]: ("Unhealthy", (0,))}   # not forgotten
        watch2.cancel()
        with pytest.raises(grpc.RpcError):
            watch.next(timeout=5)               # the old stream ended with its server
        assert "was removed (kubelet restart?): serving it again" in plugin.stderr()


def test_a_kubelet_absent_or_refusing_is_retried_with_one_line_each(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=2))
    with serving(machine, tmp_path, kubelet=False) as (kubelet, plugin):
        plugin.wait_for("waiting for the kubelet: no kubelet.sock in")
        time.sleep(2.5)
        kubelet.refuse = "no such resource here"
        kubelet.start()
        plugin.wait_for("registration with the kubelet failed (FAILED_PRECONDITION: no such resource here)")
        time.sleep(3.5)                          # retries after 1 and 2 s: still one line
        kubelet.refuse = None
        kubelet.wait_registered(1, timeout=10)
        err = plugin.wait_for("registered nvidia.com/gpu with the kubelet")
        assert err.count("waiting for the kubelet") == 1 and err.count("registration with the kubelet failed") == 1


def test_bad_requests_and_dropped_clients_leave_it_serving(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=2))
    u = [g["uuid"] for g in machine.description()["gpus"]]
    with serving(machine, tmp_path) as (kubelet, plugin):
        (reg,) = kubelet.wait_registered(1)
        stub = kubelet.plugin(reg.endpoint)

        def refused(call, *args):
            with pytest.raises(grpc.RpcError) as err:
                call(*args)
            return err.value.code(), err.value.details()

        assert refused(stub.Allocate, pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[u[0], "GPU-nope\x1b[31m"])])) == (
            grpc.StatusCode.INVALID_ARGUMENT, "unknown device GPU-nope\\x1b[31m for nvidia.com/gpu")
        raw = kubelet.channel(reg.endpoint).unary_unary("/v1beta1.DevicePlugin/Allocate")
        code, details = refused(raw, b"\xff\xff\xff")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("malformed request")
        assert refused(stub.GetPreferredAllocation, pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=[u[0]], allocation_size=5)]))[0] == \
            grpc.StatusCode.INVALID_ARGUMENT
        code, _ = refused(raw, b"\x0a\x03" * (600 * 1024))            # over the 1 MiB limit
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _ in range(3):                                              # clients that hang up mid-stream
            w = Watch(stub)
            w.next()
            w.cancel()
        w = Watch(stub)
        assert sorted(w.next()) == sorted(u)
        w.cancel()
        assert stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[u[1]])])).container_responses[0].envs == \
            {"NVIDIA_VISIBLE_DEVICES": u[1]}
        err = plugin.stderr()
        lines = [line for line in err.splitlines() if "refused" in line]
        assert len(lines) == 3, err
        assert lines[0] == ("nvcontainer device-plugin: Allocate for nvidia.com/gpu refused: "
                            "unknown device GPU-nope\\x1b[31m for nvidia.com/gpu")


def test_sigterm_removes_its_socket_and_watcher(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=2))
    with serving(machine, tmp_path) as (kubelet, plugin):
        (reg,) = kubelet.wait_registered(1)
        plugin.wait_for("health watcher: watching")
        watchers = plugin.watchers()
        assert len(watchers) == 1
        assert plugin.terminate() == 0
        assert not (kubelet.directory / reg.endpoint).exists()
        assert kubelet.socket.is_socket()                            # the kubelet's is left alone
        assert not os.path.exists(f"/proc/{watchers[0]}")
        assert plugin.stderr().splitlines()[-1] == "nvcontainer device-plugin: stopped"


def test_a_planted_symlink_is_removed_not_followed(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=2))
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    directory = tmp_path / "device-plugins"
    directory.mkdir(mode=0o700)
    os.symlink(target, directory / "nvcontainer-gpu.sock")
    with serving(machine, tmp_path) as (kubelet, plugin):
        kubelet.wait_registered(1)
        assert (directory / "nvcontainer-gpu.sock").is_socket()
        assert "removing a symlink at nvcontainer-gpu.sock in the socket directory" in plugin.stderr()
    assert target.read_text() == "keep me\n"


def test_a_second_plugin_on_a_live_socket_refuses(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=2))
    directory = tmp_path / "device-plugins"
    directory.mkdir(mode=0o700)
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(directory / "nvcontainer-gpu.sock"))
    live.listen()
    try:
        with serving(machine, tmp_path, expect_exit=True) as (_, plugin):
            assert plugin.proc.wait(30) == 1
        assert plugin.stderr().strip().splitlines()[-1] == (
            "nvcontainer: input error: nvcontainer-gpu.sock: another process is listening on it (a second plugin?)")
    finally:
        live.close()


@pytest.mark.parametrize("spec, table, mode, line", [
    (MIG_MIXED2, {"mig-strategy": "single"}, 0o700,
     "nvcontainer: device error: mig-strategy single: MIG is enabled on GPU 0 but not on GPU 1; use mig-strategy mixed"),
    (FakeSpec(gpus=2), {"replicas": 65}, 0o700,
     "nvcontainer: config error: device-plugin.replicas: expected a whole number from 1 to 64, got 65"),
    (FakeSpec(gpus=2), {}, 0o777, "not be writable by group or others"),
])
def test_startup_errors_are_one_line(fake_machine_factory, tmp_path, spec, table, mode, line):
    machine = fake_machine_factory(spec)
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    directory.chmod(mode)
    with serving(machine, tmp_path, table, expect_exit=True) as (_, plugin):
        assert plugin.proc.wait(30) == 1
    (only,) = plugin.stderr().strip().splitlines()
    assert line in only


def test_help_and_the_allow_list(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=8))
    u = [g["uuid"] for g in machine.description()["gpus"]]
    with serving(machine, tmp_path, top='allowed-devices = ["2", "7"]') as (kubelet, _):
        (reg,) = kubelet.wait_registered(1)
        watch = Watch(kubelet.plugin(reg.endpoint))
        assert sorted(watch.next()) == sorted([u[2], u[7]])
        watch.cancel()
    res = run_in_fake_proc(machine, [sys.executable, "-m", "nvcontainer", "device-plugin", "--help"],
                           capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--device-list-strategy" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "nvcontainer", "device-plugin", "--replicas", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1


def test_only_the_socket_it_bound_is_removed(tmp_path):
    from nvcontainer.kubelet import sockets

    directory = tmp_path / "d"
    dirfd = sockets.open_dir(str(directory))
    try:
        assert oct(directory.stat().st_mode & 0o777) == "0o700"
        first = socket.socket(socket.AF_UNIX)
        first.bind(str(directory / "p.sock"))
        ours = sockets.identity(dirfd, "p.sock")
        first.close()
        os.unlink(directory / "p.sock")
        second = socket.socket(socket.AF_UNIX)
        second.bind(str(directory / "p.sock"))            # someone else's now, perhaps on our old inode
        assert not sockets.remove_if_ours(dirfd, "p.sock", ours)
        assert (directory / "p.sock").is_socket()
        second.close()
        os.unlink(directory / "p.sock")
        os.symlink(tmp_path, directory / "p.sock")
        assert sockets.identity(dirfd, "p.sock") is None
        assert not sockets.remove_if_ours(dirfd, "p.sock", ours)
        assert (directory / "p.sock").is_symlink()
    finally:
        os.close(dirfd)


def test_a_thousand_allocates_from_eight_clients(fake_machine_factory, tmp_path):
    """The benchmark's run (benchmarks/deviceplugin.py) as a test: every call answered, none in error."""
    from benchmarks.deviceplugin import measure

    result = measure(fake_machine_factory(FakeSpec(gpus=8)), tmp_path, calls=1000, clients=8)
    assert (result["calls"], result["errors"]) == (1000, 0), result["error_samples"]
    assert result["latency_ms"]["p99"] < 1000


def test_a_socket_that_replaced_ours_survives_its_exit(fake_machine_factory, tmp_path):
    """Someone else's socket at our name (a newer plugin after a kubelet restart, say) is never
    removed: not by our SIGTERM, and not by gRPC, which unlinks the path it bound on stop."""
    machine = fake_machine_factory(FakeSpec(gpus=2))
    with serving(machine, tmp_path, expect_exit=True) as (kubelet, plugin):
        (reg,) = kubelet.wait_registered(1)
        path = kubelet.directory / reg.endpoint
        os.unlink(path)
        other = socket.socket(socket.AF_UNIX)
        other.bind(str(path))
        other.listen()
        theirs = os.stat(path)
        plugin.proc.send_signal(15)
        assert plugin.proc.wait(30) in (0, 1)     # 1 if it saw the stranger first and refused it
    try:
        now = os.stat(path)
        assert path.is_socket() and (now.st_ino, now.st_ctime_ns) == (theirs.st_ino, theirs.st_ctime_ns)
        assert [p.name for p in kubelet.directory.iterdir() if p.name.startswith(".")] == []
    finally:
        other.close()
