"""NVIDIA's DRA quickstart demos (gpu-test1 to gpu-test6, gpu-test-mps; our own test data in
tests/fixtures/nodeharness/demos, the same claims) through the node harness: the shipped ``dra``
kustomization's DaemonSet runs from the image on a node holding the fake machine, publishes its
slices to the fake API server, the scheduler stand-in allocates each claim by the DeviceClasses'
and requests' CEL selectors, the fake kubelet prepares them, and each container is started by
podman (crun) with the CDI names the plugin answered. Each container must see exactly the GPUs
NVIDIA's driver would give it, with its env and mounts; and the device plugin's equivalent (a
pod asking nvidia.com/gpu, under the nvidia runtime class) the same way.

The node has 8 GPUs (A100s at 0, 1, 2, 4 and 6: gpu-test6's selector must pick by index as
well as by name); gpu-test4's node has 4 A100s in MIG mode, each split as the demo's claim
asks (1g.5gb twice, 2g.10gb, 3g.20gb)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.nodeharness import manifests
from tests.fixtures.nodeharness.kubelets import NodeDraKubelet, device_kubelet
from tests.fixtures.nodeharness.workload import Cluster, facts, run_container
from tests.fixtures.nodeharness import podspec
from tests.fixtures.kubelet import Watch
from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb

DEMOS = Path(__file__).resolve().parent / "fixtures/nodeharness/demos"
A100, T4, A6000 = "NVIDIA A100-SXM4-80GB", "Tesla T4", "NVIDIA RTX A6000"
NAMES = (A100, A100, A100, A6000, A100, T4, A100, A6000)
ARCHS = ("8.0", "8.0", "8.0", "8.6", "8.0", "7.5", "8.0", "8.6")
EIGHT = FakeSpec(gpus=8, names=NAMES, archs=ARCHS)
MIG = FakeSpec(gpus=4, names=(A100,) * 4, archs=("8.0",) * 4, mig=True, mig_gpus=4, mig_devices=4,
               mig_profiles=("1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"))


def _cluster(node):
    objects = manifests.render("dra")
    run = node.run_pod(manifests.daemonsets(objects)["nvcontainer-dra-driver"], objects)
    kubelet = NodeDraKubelet(node, timeout=60)
    kubelet.wait_registered(90)
    run.wait_for("registered with the kubelet")
    end = time.monotonic() + 60
    while len([d for s in node.api.node_slices(node.name) for d in s["spec"]["devices"]]) < node.spec.gpus:
        assert time.monotonic() < end, f"no slices: {node.api.slices}: {run.log()}"
        time.sleep(0.2)
    classes = manifests.of_kind(objects, "DeviceClass")
    return Cluster(node, classes, kubelet), run


@pytest.fixture(scope="module")
def cluster(harness_node_factory):
    node = harness_node_factory(EIGHT, api=True)
    c, run = _cluster(node)
    yield c
    c.kubelet.close()
    assert set(run.stop().values()) == {0}, run.log()


@pytest.fixture
def demo(cluster):
    yield cluster
    cluster.release()


def gpus_seen(node, output: str) -> set[int]:
    """The GPU indexes whose /dev/nvidia<minor> the container has."""
    by_minor = {g["minor"]: g["index"] for g in node.machine.description()["gpus"]}
    seen = set()
    for dev in facts(output).get("DEV", []):
        tail = dev.removeprefix("/dev/nvidia")
        if tail.isdigit():
            seen.add(by_minor[int(tail)])
    return seen


def allocated(cluster, ns: str, name: str, request: str | None = None) -> set[int]:
    results = cluster.claims[(ns, name)]["status"]["allocation"]["devices"]["results"]
    return {int(r["device"].removeprefix("gpu-")) for r in results if request in (None, r["request"])}


def run_demo(cluster, name: str) -> dict[str, dict[str, tuple[int, str]]]:
    pods = cluster.apply(manifests.load(DEMOS / f"{name}.yaml"))
    out = {}
    for pod in pods:
        out[pod["metadata"]["name"]] = got = cluster.run(pod)
        for cname, (rc, text) in got.items():
            assert rc == 0 and facts(text).get("DONE") == ["ok"], f"{cname}: {text}"
    return out


def shares_shm(first: str, then: str) -> bool:
    """Whether a container run after ``first`` (gone by then) found the file ``first`` left in
    /dev/shm: the same /dev/shm (the MPS daemon's), not each container's own."""
    return facts(first)["MARK"][0] in facts(then).get("SHM", [])


def no_mps(text: str) -> None:
    """Not an MPS client: no CUDA_MPS_ variable. (/tmp/nvidia-mps, the node's own pipe directory
    when it has one, is among the driver's IPC paths every spec mounts, as nvidia-ctk's.)"""
    assert not [e for e in facts(text).get("ENV", []) if e.startswith("CUDA_MPS_")], text


def test_gpu_test1_two_pods_two_gpus(demo):
    out = run_demo(demo, "gpu-test1")
    seen = [gpus_seen(demo.node, out[p]["ctr"][1]) for p in ("pod1", "pod2")]
    want = [allocated(demo, "gpu-test1", f"{p}-gpu") for p in ("pod1", "pod2")]
    assert seen == want and all(len(s) == 1 for s in seen) and seen[0] != seen[1], out


def test_gpu_test2_two_containers_share_the_pods_claim(demo):
    out = run_demo(demo, "gpu-test2")["pod"]
    want = allocated(demo, "gpu-test2", "pod-shared-gpu")
    assert len(want) == 1
    assert gpus_seen(demo.node, out["ctr0"][1]) == gpus_seen(demo.node, out["ctr1"][1]) == want, out


def test_gpu_test3_two_pods_share_one_claim(demo):
    out = run_demo(demo, "gpu-test3")
    want = allocated(demo, "gpu-test3", "single-gpu")
    assert len(want) == 1
    assert [gpus_seen(demo.node, out[p]["ctr"][1]) for p in ("pod1", "pod2")] == [want, want], out


def test_gpu_test6_even_a100s_time_sliced(demo):
    out = run_demo(demo, "gpu-test6")
    seen = [gpus_seen(demo.node, out[f"pod-{i}"]["ctr"][1]) for i in range(4)]
    assert sorted(g for s in seen for g in s) == [0, 2, 4, 6] and all(len(s) == 1 for s in seen), out
    for i in range(4):
        no_mps(out[f"pod-{i}"]["ctr"][1])
    assert not shares_shm(out["pod-0"]["ctr"][1], out["pod-1"]["ctr"][1])


def mps(*texts: str) -> None:
    """MPS clients of one daemon: its pipe directory, and one /dev/shm shared among them (the
    daemon's), not each container's own."""
    for text in texts:
        got = facts(text)
        assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in got.get("ENV", []), text
        assert {m.split()[0] for m in got.get("MOUNT", [])} == {"/dev/shm", "/tmp/nvidia-mps"}, text
    assert all(shares_shm(a, b) for a, b in zip(texts, texts[1:])), texts


def test_gpu_test5_time_sliced_and_mps_in_one_claim(demo):
    out = run_demo(demo, "gpu-test5")["pod0"]
    ts, mps_gpu = allocated(demo, "gpu-test5", "pod0-shared-gpus", "ts-gpu"), \
        allocated(demo, "gpu-test5", "pod0-shared-gpus", "mps-gpu")
    assert len(ts) == len(mps_gpu) == 1 and ts != mps_gpu
    for c in ("ts-ctr0", "ts-ctr1"):
        assert gpus_seen(demo.node, out[c][1]) == ts, out
        no_mps(out[c][1])
    for c in ("mps-ctr0", "mps-ctr1"):
        assert gpus_seen(demo.node, out[c][1]) == mps_gpu, out
    mps(out["mps-ctr0"][1], out["mps-ctr1"][1])
    assert not shares_shm(out["ts-ctr0"][1], out["ts-ctr1"][1])


def test_gpu_test_mps_two_clients_of_one_daemon(demo):
    out = run_demo(demo, "gpu-test-mps")["test-pod"]
    want = allocated(demo, "gpu-test-mps", "test-pod-shared-gpu")
    for c in ("mps-ctr0", "mps-ctr1"):
        assert gpus_seen(demo.node, out[c][1]) == want, out
    mps(out["mps-ctr0"][1], out["mps-ctr1"][1])


def test_gpu_test4_mig_devices_of_one_parent(harness_node_factory):
    node = harness_node_factory(MIG, api=True)
    cluster, run = _cluster(node)
    try:
        out = run_demo(cluster, "gpu-test4")
        parents = []
        for i in range(4):
            claim = cluster.claims[("gpu-test4", f"pod-{i}-mig-devices")]
            results = claim["status"]["allocation"]["devices"]["results"]
            assert len(results) == 4
            seen = [gpus_seen(node, out[f"pod-{i}"][f"ctr{j}"][1]) for j in range(4)]
            assert all(len(s) == 1 for s in seen) and len(set(map(frozenset, seen))) == 1, out   # one parent
            caps = [frozenset(d for d in facts(out[f"pod-{i}"][f"ctr{j}"][1]).get("DEV", []) if "caps" in d)
                    for j in range(4)]
            assert len(set(caps)) == 4, (caps, out[f"pod-{i}"])   # each container its MIG device's access nodes
            parents.append(seen[0])
        assert len(set(map(frozenset, parents))) == 4   # four claims, four parents
    finally:
        cluster.release()
        cluster.kubelet.close()
        run.stop()


def start_installer(node, objects):
    """The base's installer DaemonSet, when it has one: the plugin's init container waits for it."""
    sets = manifests.daemonsets(objects)
    return node.run_pod(sets["nvcontainer-installer"], objects) if "nvcontainer-installer" in sets else None


def test_device_plugin_pod_gets_exactly_its_gpu(cluster):
    """The device plugin's equivalent: the base kustomization's plugin from the image (on the
    same node, beside the DRA driver), a pod asking nvidia.com/gpu: 1 under the nvidia runtime
    class, its container started from what Allocate answered (the envvar strategy: the node's
    hook injects the GPU)."""
    node = cluster.node
    objects = manifests.render("base")
    installer = start_installer(node, objects)
    run = node.run_pod(manifests.daemonsets(objects)["nvcontainer-device-plugin"], objects)
    kubelet = device_kubelet(node)
    try:
        (reg,) = kubelet.wait_registered(1, timeout=90)
        watch = Watch(kubelet.plugin(reg.endpoint))
        try:
            devices = watch.until(lambda d: len(d) == node.spec.gpus, timeout=60)
        finally:
            watch.cancel()
        uuids = {g["uuid"]: g["index"] for g in node.machine.description()["gpus"]}
        pod_obj = {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": "default", "name": "gpu-pod"},
                   "spec": {"runtimeClassName": "nvidia", "automountServiceAccountToken": False,
                            "containers": [{"name": "cuda", "image": "ubuntu:22.04",
                                            "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
        pod = podspec.from_pod(pod_obj, node.facts(objects))
        (c,) = pod.containers
        assert c.extended == (("nvidia.com/gpu", 1),)
        for device in sorted(devices):
            resp = kubelet.plugin(reg.endpoint).Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[device])])).container_responses[0]
            assert not resp.mounts and not resp.devices and not resp.cdi_devices
            rc, text = run_container(node, pod, c, [], env=sorted(resp.envs.items()), objects=objects)
            assert rc == 0, text
            assert gpus_seen(node, text) == {uuids[device]}, text
    finally:
        kubelet.stop()
        assert set(run.stop().values()) == {0}, run.log()
        if installer is not None:
            installer.stop()


def test_a_spec_naming_the_plugins_own_view_is_caught(harness_node_factory):
    """The harness's own guard, as it caught the shipped DaemonSet's /host driver root: the DRA
    DaemonSet told that the host's driver root is where the pod mounts it (NVIDIA_DRIVER_ROOT
    set to the container's path) writes claim specs naming /driver-root/..., which the node does
    not have; the pod's containers never start."""
    node = harness_node_factory(FakeSpec(gpus=2), api=True)
    objects = manifests.render("dra")
    (ctr,) = manifests.daemonsets(objects)["nvcontainer-dra-driver"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in ctr["env"]}
    env["NVIDIA_DRIVER_ROOT"]["value"] = env["DRIVER_ROOT_CTR_PATH"]["value"]
    run = node.run_pod(manifests.daemonsets(objects)["nvcontainer-dra-driver"], objects)
    kubelet = NodeDraKubelet(node, timeout=60)
    try:
        kubelet.wait_registered(90)
        run.wait_for("registered with the kubelet")
        end = time.monotonic() + 60
        while not node.api.node_slices(node.name):
            assert time.monotonic() < end, run.log()
            time.sleep(0.2)
        cluster = Cluster(node, manifests.of_kind(objects, "DeviceClass"), kubelet)
        (pod, _) = cluster.apply(manifests.load(DEMOS / "gpu-test1.yaml"))
        with pytest.raises(AssertionError, match=r"host paths the node does not have: .*: /driver-root/"):
            cluster.prepare(pod)
        cluster.release()
    finally:
        kubelet.close()
        assert set(run.stop().values()) == {0}, run.log()
