"""deploy/kubernetes/dra: it renders (kubectl kustomize when there is one, else as YAML), its RBAC
grants exactly the verbs kubeapi.py uses (found by calling every public call against the fake
API server), the DeviceClasses are NVIDIA's, and every attribute or capacity the examples'
selectors name is one our slices publish."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from nvcontainer.dra import kubeapi, slices
from nvcontainer.inventory.build import build
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.kubeapi import FakeApiServer

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes" / "dra"
PUBLIC_CALLS = {"get_claim", "get_node", "list_slices", "create_slice", "update_slice", "delete_slice"}
GROUPS = {"resourceclaims": "resource.k8s.io", "resourceslices": "resource.k8s.io", "nodes": ""}


def objects(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def deployed() -> list[dict]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return [o for name in kustomization["resources"] for o in objects(DEPLOY / name)]


def by_kind(kind: str) -> list[dict]:
    return [o for o in deployed() if o["kind"] == kind]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_kustomize_renders_the_same_objects():
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "unknown command" in out.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert out.returncode == 0, out.stderr
    rendered = sorted((o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(out.stdout) if o)
    assert rendered == sorted((o["kind"], o["metadata"]["name"]) for o in deployed())


def verbs_used(tmp_path) -> set[tuple[str, str]]:
    """(resource, RBAC verb) of every request the client's public calls make."""
    server = FakeApiServer()
    try:
        api = kubeapi.KubeApi(kubeapi.load_config(server.write_kubeconfig(str(tmp_path / "k"))))
        public = {n for n in dir(api) if not n.startswith("_") and callable(getattr(api, n))} - {"close"}
        assert public == PUBLIC_CALLS, "a new API call: add it here and to rbac.yaml"
        server.put_claim({"metadata": {"namespace": "ns", "name": "c"}, "spec": {}})
        api.get_claim("ns", "c")
        server.put_node("n")
        api.get_node("n")
        body = {"metadata": {"name": "s"}, "spec": {"driver": "gpu.nvidia.com", "nodeName": "n", "devices": [],
                                                    "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1}}}
        api.create_slice(body)
        api.update_slice(api.list_slices("n")[0])
        api.delete_slice("s")
        api.close()
    finally:
        server.stop()
    used = set()
    for method, path in server.requests:
        resource, named = re.match(r"/apis?/(?:resource\.k8s\.io/)?v1/(?:namespaces/[^/]+/)?(\w+)(/[^?]+)?",
                                   path).groups()
        verb = {"GET": "get" if named else "list", "POST": "create", "PUT": "update", "DELETE": "delete"}[method]
        used.add((resource, verb))
    return used


def test_rbac_grants_exactly_the_verbs_the_client_uses(tmp_path):
    (role,) = by_kind("ClusterRole")
    granted = set()
    for rule in role["rules"]:
        assert {GROUPS[r] for r in rule["resources"]} == set(rule["apiGroups"])
        granted |= {(r, v) for r in rule["resources"] for v in rule["verbs"]}
    used = verbs_used(tmp_path)
    assert granted == used == kubeapi.USED
    (binding,) = by_kind("ClusterRoleBinding")
    (account,) = by_kind("ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]


def test_only_kubeapi_talks_to_the_api_server():
    for module in (ROOT / "nvcontainer" / "dra").rglob("*.py"):
        if module.name != "kubeapi.py":
            assert not re.search(r"^\s*(from|import) (lightkube|httpx)", module.read_text(), re.M), module


def test_daemonset():
    (ds,) = by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (account,) = by_kind("ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    (ctr,) = pod["containers"]
    assert ctr["image"] == "nvcontainer:0.1.0"
    assert ctr["command"][0] == "nvcontainer" and "dra-driver" in ctr["command"]
    assert ctr["command"][ctr["command"].index("--hook-path") + 1] == "/usr/bin/nvcontainer-hook"   # the host's
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in ctr["env"]
    mounts = {m["mountPath"] for m in ctr["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi", "/host"} <= mounts
    (config,) = by_kind("ConfigMap")
    assert "/etc/nvcontainer-dra/config.toml" in ctr["command"]
    assert 'root = "/host"' in config["data"]["config.toml"]


def test_device_classes_are_nvidias():
    classes = {o["metadata"]["name"]: o["spec"]["selectors"] for o in by_kind("DeviceClass")}
    assert classes == {
        "gpu.nvidia.com": [{"cel": {"expression":
                                    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}}],
        "mig.nvidia.com": [{"cel": {"expression":
                                    "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"}}],
    }


def test_examples(fake_machine_factory):
    examples = {p.stem: objects(p) for p in sorted((DEPLOY / "examples").glob("*.yaml"))}
    assert set(examples) == {"one-gpu", "gpu-40gi", "mig-1g10gb", "shared-gpu"}
    shared = examples["shared-gpu"]
    assert [o["kind"] for o in shared] == ["ResourceClaim", "Pod", "Pod"]
    assert {o["spec"]["resourceClaims"][0]["resourceClaimName"] for o in shared[1:]} == {"shared-gpu"}
    # what the selectors name is what a slice of a MIG machine publishes
    machine = fake_machine_factory(FakeSpec(gpus=2, mig=True))
    inv = build(str(machine.root), proc=str(machine.proc))
    devices = slices.build(inv, "n")[0]["spec"]["devices"]
    attributes = {a for d in devices for a in d["attributes"]}
    capacity = {c for d in devices for c in d.get("capacity", {})}
    classes = {o["metadata"]["name"] for o in by_kind("DeviceClass")}
    text = "\n".join((DEPLOY / "examples" / f"{k}.yaml").read_text() for k in examples)
    named_attributes = set(re.findall(r"attributes\['gpu\.nvidia\.com'\]\.(\w+)", text))
    named_capacity = set(re.findall(r"capacity\['gpu\.nvidia\.com'\]\.(\w+)", text))
    assert named_attributes == {"profile"} and named_attributes <= attributes
    assert named_capacity == {"memory"} and named_capacity <= capacity
    assert set(re.findall(r"deviceClassName: (\S+)", text)) <= classes
    mig = [d for d in devices if d["attributes"]["type"] == {"string": "mig"}]
    assert {d["attributes"]["profile"]["string"] for d in mig} == {"1g.10gb"}      # the example's profile
