"""The node harness's workloads through containerd's CRI (1.6, Debian 12's), as a kubelet on a
containerd node starts them: RunPodSandbox with the RuntimeClass's handler, CreateContainer,
StartContainer (tests/fixtures/cri.py), containerd set up by ``nvcontainer setup containerd``.
The plugins run from the image in pods of the harness node; the workload containers get what
they answered: the device plugin's env under the ``nvidia`` handler, and a DRA claim's CDI names
as ``cdi.k8s.io/`` annotations through the ``nvidia`` handler (containerd 1.6 has no CDI of its
own: the runtime shim resolves them, from the runtime's view of the node's CDI specs)."""

from __future__ import annotations

import pytest

from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb
from tests.fixtures import cri
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.kubelet import Watch
from tests.fixtures.nodeharness import manifests
from tests.fixtures.nodeharness.kubelets import device_kubelet
from tests.fixtures.nodeharness.workload import PROBE, facts
from tests.test_engines_setup import cri_node, node   # noqa: F401 (node: a fixture, on this module's machine)
from tests.test_nodeharness_dra_demos import DEMOS, _cluster, allocated, gpus_seen, start_installer


@pytest.fixture(scope="module")
def hnode(harness_node_factory):
    return harness_node_factory(FakeSpec(gpus=2), api=True)


@pytest.fixture(scope="module")
def machine(hnode):
    return hnode.machine


def _cri(hnode, node, tmp_path, containers, *, cdi: bool = False):   # noqa: F811
    base, main, prefix = cri_node(node, tmp_path)
    etc = tmp_path / "etc"
    (etc / "nvcontainer").mkdir(parents=True)
    config = (node / "etc/nvcontainer/config.toml").read_text()
    if cdi:
        dropin = prefix / "etc/containerd/conf.d/99-nvidia.toml"
        header = '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        dropin.write_text(dropin.read_text().replace(header, header + 'container_annotations = ["cdi.k8s.io/*"]\n'))
        config += f'[nvidia-container-runtime.modes.cdi]\nspec-dirs = ["{hnode.runtime_cdi}"]\n'
    (etc / "nvcontainer/config.toml").write_text(config)
    results, res = cri.run(hnode.machine, base, main, f"{prefix / 'etc'}:{etc}", containers)
    context = f"{res.stdout}\n{res.stderr}\n{cri.log(base)}"
    got = {r["name"]: (r["rc"], r["log"]) for r in results}
    assert len(got) == len(containers), context
    return got, context


def test_device_plugin_pod_through_the_cri(hnode, node, tmp_path):   # noqa: F811
    objects = manifests.render("base")
    installer = start_installer(hnode, objects)
    run = hnode.run_pod(manifests.daemonsets(objects)["nvcontainer-device-plugin"], objects)
    kubelet = device_kubelet(hnode)
    try:
        (reg,) = kubelet.wait_registered(1, timeout=90)
        watch = Watch(kubelet.plugin(reg.endpoint))
        try:
            devices = sorted(watch.until(lambda d: len(d) == 2, timeout=60))
        finally:
            watch.cancel()
        handler = manifests.of_kind(objects, "RuntimeClass")["nvidia"]["handler"]
        containers = []
        for i, device in enumerate(devices):
            resp = kubelet.plugin(reg.endpoint).Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[device])])).container_responses[0]
            containers.append({"name": f"gpu{i}", "handler": handler, "script": PROBE,
                               "env": [f"{k}={v}" for k, v in sorted(resp.envs.items())]})
    finally:
        kubelet.stop()
        assert set(run.stop().values()) == {0}, run.log()
        if installer is not None:
            installer.stop()
    got, context = _cri(hnode, node, tmp_path, containers)
    index = {g["uuid"]: g["index"] for g in hnode.machine.description()["gpus"]}
    for i, device in enumerate(devices):
        rc, text = got[f"gpu{i}"]
        assert rc == 0 and facts(text)["DONE"] == ["ok"], context
        assert gpus_seen(hnode, text) == {index[device]}, context


def test_gpu_test1_through_the_cri(hnode, node, tmp_path):   # noqa: F811
    cluster, run = _cluster(hnode)
    try:
        containers = []
        for pod in cluster.apply(manifests.load(DEMOS / "gpu-test1.yaml")):
            spec, names = cluster.prepare(pod)
            annotations = {f"cdi.k8s.io/nvc-{spec.name}": ",".join(names["ctr"])}
            containers.append({"name": spec.name, "handler": "nvidia", "env": [], "script": PROBE,
                               "annotations": annotations})
        got, context = _cri(hnode, node, tmp_path, containers, cdi=True)
        seen = [gpus_seen(hnode, got[p][1]) for p in ("pod1", "pod2")]
        assert seen == [allocated(cluster, "gpu-test1", f"{p}-gpu") for p in ("pod1", "pod2")], context
        assert seen[0] != seen[1] and all(len(s) == 1 for s in seen), context
    finally:
        cluster.release()
        cluster.kubelet.close()
        run.stop()
