"""Every shipped DaemonSet, executed as a node runs it (tests/fixtures/nodeharness): each
kustomization under deploy/kubernetes rendered by ``kubectl kustomize``, each DaemonSet's pod
run by podman from the image ``scripts/image`` builds, with the manifest's command, env,
securityContext and volumes, on a node whose root holds the 2-GPU fake machine; the fake
kubelets and the fake API server on the other side.

What each pod must do to count as up is checked per DaemonSet (a DaemonSet with no check of its
own must at least keep running without a traceback); every pod must then stop on SIGTERM with 0."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.kubelet import Watch
from tests.fixtures.nodeharness import manifests, podspec
from tests.fixtures.nodeharness.kubelets import NodeDraKubelet, device_kubelet

KUSTOMIZATIONS = [str(k) for k in manifests.kustomizations()]


def _pods_of(kustomization: str) -> str:
    """What a node runs for a kustomization: its DaemonSets and the ConfigMaps they read."""
    objects = manifests.render(kustomization)
    return json.dumps([manifests.daemonsets(objects), manifests.of_kind(objects, "ConfigMap"),
                       manifests.of_kind(objects, "RuntimeClass")], sort_keys=True)


def _distinct() -> list[str]:
    """The kustomizations, those rendering the same pods as one ('dra+dra/v1beta1': the served
    API version changes the DeviceClasses only): each distinct set of pods runs once."""
    groups: dict[str, list[str]] = {}
    for k in (k for k in KUSTOMIZATIONS if not _component(k)):
        groups.setdefault(_pods_of(k), []).append(k)
    return ["+".join(g) for g in groups.values()]
GPUS = 2
FEATURES = "/etc/kubernetes/node-feature-discovery/features.d/nvcontainer"


def _component(kustomization: str) -> bool:
    """A kustomize Component (the metrics' ServiceMonitor) only adds to the kustomizations that
    include it: it runs with them, and has no pod of its own."""
    text = (manifests.DEPLOY / kustomization / "kustomization.yaml").read_text()
    return any(line.strip() == "kind: Component" for line in text.splitlines())


def _cluster(kustomization: str) -> list[dict]:
    """What the cluster holds when a kustomization's pods run: its own objects and, for an add-on
    applied over the base (one without a Namespace of its own, as metrics), the base's objects
    but its DaemonSets: its namespace, ConfigMap and the RuntimeClass the add-on's pods name."""
    objects = manifests.render(kustomization)
    if any(o.get("kind") == "Namespace" for o in objects):
        return objects
    return [o for o in manifests.render("base") if o.get("kind") != "DaemonSet"] + objects


def test_every_kustomization_is_covered():
    """The list this module runs is every directory with a kustomization (a new one is picked
    up, not skipped), and every one of them but a Component has a DaemonSet to run."""
    found = {str(p.parent.relative_to(manifests.DEPLOY)) for p in manifests.DEPLOY.rglob("kustomization.yaml")}
    assert set(KUSTOMIZATIONS) == found and {"base", "dra"} <= found
    for k in KUSTOMIZATIONS:
        assert _component(k) or manifests.daemonsets(manifests.render(k)), k


@pytest.fixture(scope="module")
def node(harness_node_factory):
    return harness_node_factory(FakeSpec(gpus=GPUS), api=True)


def _device_plugin(node, run, objects):
    kubelet = device_kubelet(node)
    try:
        (reg,) = kubelet.wait_registered(1, timeout=90)
        assert reg.resource_name == "nvidia.com/gpu"
        config = _config(objects)
        replicas = 1 if "replicas = 1" in config or "replicas" not in config else 4
        watch = Watch(kubelet.plugin(reg.endpoint))
        try:
            devices = watch.until(lambda d: len(d) == GPUS * replicas, timeout=60)
        finally:
            watch.cancel()
        assert {h for h, _ in devices.values()} == {"Healthy"}
        ids = sorted(devices)
        got = kubelet.plugin(reg.endpoint).Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[ids[0]])]))
        assert got.container_responses[0].envs or got.container_responses[0].cdi_devices \
            or got.container_responses[0].annotations, got
    finally:
        kubelet.stop()


def _config(objects) -> str:
    cms = manifests.of_kind(objects, "ConfigMap")
    return "".join(cm.get("data", {}).get("config.toml", "") for cm in cms.values())


def _labeller(node, run, objects):
    path = node.host(FEATURES)
    end = time.monotonic() + 60
    while not path.exists():
        assert run.running() and time.monotonic() < end, run.log()
        time.sleep(0.2)
    text = path.read_text()
    labels = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    names = [g["name"] for g in node.machine.description()["gpus"]]
    product = next(n for n in names
                   if labels["nvidia.com/gpu.product"] in (n.replace(" ", "-"), n.replace(" ", "-") + "-SHARED"))
    assert labels["nvidia.com/gpu.count"] == str(names.count(product)), text


def _mps_daemon(node, run, objects):
    for i in range(GPUS):
        run.wait_for(f"MPS daemon for GPU {i} ", timeout=60)


def _dra_driver(node, run, objects):
    kubelet = NodeDraKubelet(node, timeout=20)
    try:
        info = kubelet.wait_registered(90)
        assert info.name == "gpu.nvidia.com"
        run.wait_for("registered with the kubelet")
        end = time.monotonic() + 30
        while len([d for s in node.api.node_slices(node.name) for d in s["spec"]["devices"]]) < GPUS:
            assert time.monotonic() < end, node.api.slices
            time.sleep(0.2)
    finally:
        kubelet.close()


def _metrics(node, run, objects):
    """The exporter answers a scrape on the manifest's port (host network) with dcgm-exporter's
    series for each GPU of the node, labelled with the node's name from the downward API."""
    port = next(p["containerPort"] for ds in manifests.daemonsets(objects).values()
                for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", ())
                if p.get("name") == "metrics")
    run.wait_for("metrics: serving", timeout=60)
    end, text = time.monotonic() + 30, ""
    while "DCGM_FI_DEV_FB_FREE{" not in text:
        assert run.running() and time.monotonic() < end, f"{text}\n{run.log()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
                text = answer.read().decode()
        except OSError:
            time.sleep(0.5)
    series = [line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_FB_FREE{")]
    assert len(series) == GPUS, text
    assert all(f'Hostname="{node.name}"' in line for line in series), series


def _keeps_running(node, run, objects):
    time.sleep(5)
    assert run.running(), run.log()


CHECKS = {"nvcontainer-device-plugin": _device_plugin, "nvcontainer-node-labeller": _labeller,
          "nvcontainer-mps-daemon": _mps_daemon, "nvcontainer-dra-driver": _dra_driver,
          "nvcontainer-metrics": _metrics}
ORDER = ["nvcontainer-installer", "nvcontainer-mps-daemon"]   # the plugins wait for the installer; MPS, its daemon


@pytest.mark.parametrize("kustomizations", _distinct())
def test_daemonsets_run_from_the_image(node, kustomizations):
    objects = _cluster(kustomizations.split("+")[0])
    sets = manifests.daemonsets(objects)
    names = sorted(sets, key=lambda n: (n not in ORDER, n))
    runs = {}
    try:
        for name in names:
            runs[name] = node.run_pod(sets[name], objects)
        for name in names:
            CHECKS.get(name, _keeps_running)(node, runs[name], objects)
            assert "Traceback" not in runs[name].log(), runs[name].log()
    finally:
        codes = {name: run.stop() for name, run in runs.items()}
        node.host(FEATURES).unlink(missing_ok=True)
    for name, run in runs.items():
        assert set(codes[name].values()) == {0}, f"{name}: {codes[name]}: {run.log()}"
        assert "Traceback" not in run.log(), run.log()


def _daemonset(container: dict, **spec) -> dict:
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "x", "namespace": "n"},
            "spec": {"selector": {}, "template": {"spec": {"containers": [{"name": "c", "image": "nvcontainer",
                                                                            **container}], **spec}}}}


@pytest.mark.parametrize("container,spec,field", [
    ({"ports": [{"containerPort": 80, "hostPort": 80}]}, {}, "spec.template.spec.containers[0].ports[0].hostPort"),
    ({"livenessProbe": {}}, {}, "spec.template.spec.containers[0].livenessProbe"),
    ({"envFrom": []}, {}, "spec.template.spec.containers[0].envFrom"),
    ({"securityContext": {"seLinuxOptions": {}}}, {},
     "spec.template.spec.containers[0].securityContext.seLinuxOptions"),
    ({"volumeMounts": [{"name": "v", "mountPath": "/x", "subPath": "a"}]},
     {"volumes": [{"name": "v", "emptyDir": {}}]}, "spec.template.spec.containers[0].volumeMounts[0].subPath"),
    ({}, {"volumes": [{"name": "v", "secret": {"secretName": "s"}}]}, "spec.template.spec.volumes[0].secret"),
    ({}, {"dnsPolicy": "ClusterFirstWithHostNet"}, "spec.template.spec.dnsPolicy"),
    ({"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]}, {},
     "spec.template.spec.containers[0].env[0].valueFrom.fieldRef.fieldPath"),
])
def test_a_field_the_harness_does_not_implement_fails_naming_it(container, spec, field):
    facts = podspec.NodeFacts("node-a", {}, service_accounts={("n", "default"): False})
    with pytest.raises(podspec.Unsupported) as err:
        podspec.from_daemonset(_daemonset(container, **spec), facts)
    assert err.value.path == field, str(err.value)


def test_a_node_the_pod_does_not_select_keeps_it_off():
    facts = podspec.NodeFacts("node-a", {}, service_accounts={("n", "default"): False})
    with pytest.raises(podspec.NotSchedulable, match="nvidia.com/gpu.present"):
        podspec.from_daemonset(_daemonset({}, nodeSelector={"nvidia.com/gpu.present": "true"}), facts)


SEES = r"""
for p in /host/var/lib/kubelet/device-plugins /host/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 /host/dev/nvidia0 \
         "/host$1" "$1" /etc/debian_version; do
    if [ -e "$p" ]; then echo "SEES:$p"; fi
done
"""


def test_a_pod_sees_the_node_root_and_nothing_else_of_the_host(node):
    """A pod from the image with the node's / as a hostPath at /host: it finds the node's
    kubelet directory and the fake machine's driver files there, and neither there nor in its
    own filesystem anything of the test host's (this repository)."""
    ds = _daemonset({"command": ["sh", "-c", SEES, "sh", str(manifests.REPO)],
                     "volumeMounts": [{"name": "host", "mountPath": "/host"}]},
                    volumes=[{"name": "host", "hostPath": {"path": "/"}}], automountServiceAccountToken=False)
    run = node.run_pod(ds, [])
    assert run.wait() == {"c": 0}, run.log()
    seen = {line.removeprefix("SEES:") for line in run.log().splitlines() if line.startswith("SEES:")}
    assert seen == {"/host/var/lib/kubelet/device-plugins", "/host/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
                    "/host/dev/nvidia0", "/etc/debian_version"}, run.log()
