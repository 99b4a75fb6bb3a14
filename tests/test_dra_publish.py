"""Publishing this node's ResourceSlices through the fake API server: first publish, nothing
written when nothing changed, updates on an inventory change, unhealthy GPUs withdrawn (by the
device plugin's own watcher on the fake machine's mock NVML) and back, conflicts, an API server
that is down or slow (bounded, retried, said once), and removal on uninstall."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from nvcontainer.config.model import Config
from nvcontainer.dra.publishing import health, publish, snapshot
from nvcontainer.dra import kubeapi
from nvcontainer.errors import NvcError
from tests.fixtures.fakegpu import FakeSpec, inventory_of
from tests.fixtures.fakegpu.spec import gpu_uuid
from tests.fixtures.kubeapi import FakeApiServer, fake_api, kube_client  # noqa: F401 (fixtures)
from tests.fixtures.kubelet import inject_event, set_driver_state

NODE = "node-a"



@pytest.fixture
def server(fake_api):
    fake_api.put_node(NODE)
    return fake_api


@pytest.fixture
def api(kube_client):
    return kube_client


def names_on(server):
    return [[d["name"] for d in s["spec"]["devices"]] for s in server.node_slices(NODE)]


def test_first_publish_then_nothing_to_write(fake_machine, server, api):
    p = publish.Publisher(api, NODE, sysfs=str(fake_machine.sysfs))
    p.inv = inventory_of(fake_machine)
    assert p.sync() is True
    assert names_on(server) == [["gpu-0", "gpu-1"]]
    (stored,) = server.node_slices(NODE)
    assert stored["spec"]["pool"]["generation"] == 1
    assert stored["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": f"node-uid-{NODE}", "controller": True}]
    assert stored["spec"]["devices"][0]["attributes"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    writes = len(server.writes)
    assert p.sync() is False and len(server.writes) == writes


def test_a_node_the_api_server_does_not_know_publishes_nothing(fake_machine, server, api):
    p = publish.Publisher(api, "node-b")
    p.inv = inventory_of(fake_machine)
    with pytest.raises(NvcError, match="get node node-b: not found"):
        p.sync()
    assert server.writes == []


def test_inventory_change_updates_and_bumps_the_generation(fake_machine, fake_machine_factory, server, api):
    p = publish.Publisher(api, NODE)
    p.inv = inventory_of(fake_machine)
    p.sync()
    # the same node after a MIG reconfiguration: GPU 0 now offers two 1g.10gb devices
    p.inv = inventory_of(fake_machine_factory(FakeSpec(gpus=2, mig=True)))
    assert p.sync() is True
    assert names_on(server) == [["gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1", "gpu-1"]]
    assert server.node_slices(NODE)[0]["spec"]["pool"]["generation"] == 2
    assert [w[0] for w in server.writes] == ["create", "update"]


def test_someone_elses_write_between_read_and_update_is_read_again(fake_machine, server, api):
    p = publish.Publisher(api, NODE)
    p.inv = inventory_of(fake_machine)
    p.sync()
    p.bad = {gpu_uuid(0): "XID 79"}
    real_update = api.update_slice

    def racing_update(obj, **kw):
        api.update_slice = real_update
        with server.lock:                           # another writer bumps the resourceVersion first
            server.slices[obj["metadata"]["name"]]["metadata"]["resourceVersion"] = "999999"
        return real_update(obj, **kw)

    api.update_slice = racing_update
    assert p.sync() is True
    assert names_on(server) == [["gpu-1"]]


def test_slices_of_other_nodes_and_drivers_are_left_alone(fake_machine, server, api):
    server.slices["node-b-x"] = {"metadata": {"name": "node-b-x", "resourceVersion": "1"},
                                 "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-b", "devices": []}}
    server.slices["node-a-other"] = {"metadata": {"name": "node-a-other", "resourceVersion": "1"},
                                     "spec": {"driver": "other.example.com", "nodeName": NODE, "devices": []}}
    server.slices["node-a-stale"] = {"metadata": {"name": "node-a-stale", "resourceVersion": "1"},
                                     "spec": {"driver": "gpu.nvidia.com", "nodeName": NODE, "devices": [],
                                              "pool": {"name": NODE, "generation": 7, "resourceSliceCount": 1}}}
    p = publish.Publisher(api, NODE)
    p.inv = inventory_of(fake_machine)
    p.sync()
    assert sorted(server.slices) == ["node-a-gpu.nvidia.com-0", "node-a-other", "node-b-x"]
    assert server.slices["node-a-gpu.nvidia.com-0"]["spec"]["pool"]["generation"] == 8
    assert publish.remove_slices(api, NODE) == "removed 1 ResourceSlice(s) of gpu.nvidia.com on node node-a"
    assert sorted(server.slices) == ["node-a-other", "node-b-x"]


def run_loop(loop: publish.Loop, script, seconds: float):
    async def main():
        task = asyncio.create_task(loop.run())
        try:
            await script()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), seconds))


async def until(predicate, seconds=5.0):
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.02)


def test_loop_withdraws_an_unhealthy_gpu_and_brings_it_back(fake_machine, server, api):
    said = []
    loop = publish.Loop(publish.Publisher(api, NODE, say=said.append), resync=60)

    async def script():
        loop.inventory(inventory_of(fake_machine))
        await until(lambda: names_on(server) == [["gpu-0", "gpu-1"]])
        loop.health({gpu_uuid(1): "XID 79"})
        await until(lambda: names_on(server) == [["gpu-0"]])
        loop.health({})
        await until(lambda: names_on(server) == [["gpu-0", "gpu-1"]])

    run_loop(loop, script, 20)
    assert said == []


def test_loop_survives_a_down_server_says_so_once_and_catches_up(fake_machine, server, api):
    said = []
    loop = publish.Loop(publish.Publisher(api, NODE, say=said.append), resync=60, budget=0.5,
                        retry_first=0.05, retry_max=0.2)

    async def script():
        server.down = True
        loop.inventory(inventory_of(fake_machine))
        await until(lambda: loop.syncs >= 4, 10)
        assert names_on(server) == []
        server.down = False
        await until(lambda: names_on(server) == [["gpu-0", "gpu-1"]] and not loop.failing, 10)

    run_loop(loop, script, 30)
    assert len(said) == 2, said
    assert said[0].startswith("slices not published: get node node-a: http://127.0.0.1:")
    assert said[0].endswith("(retrying, at most every 0.2 s)")
    assert said[1] == "slices published again"


def test_slow_server_sync_is_bounded(fake_machine, server, api):
    p = publish.Publisher(api, NODE)
    p.inv = inventory_of(fake_machine)
    server.slow = 3
    start = time.monotonic()
    with pytest.raises(NvcError, match=r"no answer in 1 s \(\d+ attempt"):
        p.sync(time.monotonic() + 1.5)
    assert time.monotonic() - start < 2.5


def test_snapshot_child_gives_the_inventory_this_process_has(fake_machine, tmp_path):
    from nvcontainer.inventory.cache import cached_inventory

    config = Config(root=str(fake_machine.root), cache_dir=str(tmp_path / "cache"))
    here = cached_inventory(config, proc=str(fake_machine.proc))
    entries = sorted(os.listdir(tmp_path / "cache"))
    got = snapshot.current(config, proc=str(fake_machine.proc))
    assert got == here                  # no spurious change at start
    assert sorted(os.listdir(tmp_path / "cache")) == entries     # it read this process's entry
    assert [g.uuid for g in got.gpus] == [gpu_uuid(0), gpu_uuid(1)]
    assert got.gpus[0].memory == 80 << 30


def test_snapshot_child_failure_is_one_line(tmp_path):
    with pytest.raises(NvcError) as err:
        snapshot.current(Config(root=str(tmp_path / "nothing-here"), cache_dir=str(tmp_path / "cache")),
                         proc=str(tmp_path / "proc"))
    assert "\n" not in str(err.value)
    assert str(err.value).endswith("nothing-here: not a directory")


@pytest.fixture
def machine_own(private_machine):
    machine = private_machine(FakeSpec(gpus=2))
    set_driver_state(machine)
    yield machine
    set_driver_state(machine)


def test_the_device_plugins_watcher_withdraws_a_gpu_with_a_critical_xid(machine_own, server, api):
    inv = inventory_of(machine_own)
    said = []
    loop = publish.Loop(publish.Publisher(api, NODE, say=said.append), resync=60)
    config = Config(root=str(machine_own.root), device_plugin={"heartbeat-seconds": 0.1,
                                                                "heartbeat-timeout-seconds": 2})
    monitor = health.monitor(config, inv, loop.health, said.append)

    async def script():
        loop.inventory(inv)
        watching = asyncio.create_task(monitor.run())
        try:
            await until(lambda: names_on(server) == [["gpu-0", "gpu-1"]] and monitor.starts, 10)
            await until(lambda: any("watching 2 GPU(s)" in line for line in said), 10)
            inject_event(machine_own, 1, 79)
            await until(lambda: names_on(server) == [["gpu-0"]], 10)
            inject_event(machine_own, 0, 13)            # an application XID: stays
            await asyncio.sleep(0.5)
            assert names_on(server) == [["gpu-0"]]
        finally:
            await monitor.close(watching)

    run_loop(loop, script, 40)


def test_keeper_publishes_again_when_the_inventory_changes(fake_machine, fake_machine_factory, server, api,
                                                           monkeypatch):
    from nvcontainer.dra.publishing import keeper

    before = inventory_of(fake_machine)
    after = inventory_of(fake_machine_factory(FakeSpec(gpus=2, mig=True)))
    reads = []

    def current(config, proc):
        reads.append(proc)
        return before if len(reads) < 3 else after

    monkeypatch.setattr(keeper.snapshot, "current", current)
    said = []
    config = Config(root=str(fake_machine.root), device_plugin={"health-checks": False})

    async def main():
        task = asyncio.create_task(keeper.keep_published(config, api, NODE, before, say=said.append,
                                                         proc=str(fake_machine.proc), check_every=0.05))
        try:
            await until(lambda: names_on(server) == [["gpu-0", "gpu-1"]])
            await until(lambda: names_on(server) == [["gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1", "gpu-1"]])
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 20))
    assert "the inventory changed: 2 GPU(s); publishing again" in said
    assert reads[0] == str(fake_machine.proc)


@pytest.mark.parametrize("versions", [("v1beta2", "v1beta1"), ("v1beta1",)])
def test_publish_to_older_api_servers(fake_machine_factory, tmp_path, versions):
    """1.33 (v1beta2) and 1.32 (v1beta1, attributes under ``basic``): written, validated by the
    server, read back equal, so a second sync writes nothing."""
    server = FakeApiServer(versions=versions)
    server.put_node(NODE)
    try:
        api = kubeapi.KubeApi(kubeapi.load_config(server.write_kubeconfig(str(tmp_path / "k"))))
        p = publish.Publisher(api, NODE)
        p.inv = inventory_of(fake_machine_factory(FakeSpec(gpus=2, mig=True)))
        assert p.sync() is True
        (stored,) = server.node_slices(NODE)
        assert stored["apiVersion"] == f"resource.k8s.io/{versions[0]}"
        first = stored["spec"]["devices"][0]
        assert ("basic" in first) == (versions[0] == "v1beta1")
        assert p.sync() is False and len(server.writes) == 1
    finally:
        server.stop()
