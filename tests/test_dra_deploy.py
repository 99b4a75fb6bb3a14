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
from nvcontainer.dra.driverroot import roots
from nvcontainer.errors import NvcError
from nvcontainer.inventory.build import build
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.kubeapi import FakeApiServer

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes" / "dra"
PUBLIC_CALLS = {"get_claim", "get_node", "list_slices", "create_slice", "update_slice", "delete_slice"}
GROUPS = {"resourceclaims": "resource.k8s.io", "resourceslices": "resource.k8s.io", "nodes": ""}


def objects(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def deployed(where: Path = DEPLOY) -> list[dict]:
    """The objects of a kustomization (its ``bases`` directories, then its resource files)."""
    kustomization = yaml.safe_load((where / "kustomization.yaml").read_text())
    out = [o for base in kustomization.get("bases", ()) for o in deployed((where / base).resolve())]
    for name in kustomization.get("resources", ()):
        out += deployed(where / name) if (where / name).is_dir() else objects(where / name)
    return out


def by_kind(kind: str) -> list[dict]:
    return [o for o in deployed() if o["kind"] == kind]


VERSIONS = {"": "resource.k8s.io/v1", "v1beta1": "resource.k8s.io/v1beta1", "v1beta2": "resource.k8s.io/v1beta2"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_kustomize_renders_the_same_objects(version):
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / version)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "unknown command" in out.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert out.returncode == 0, out.stderr
    rendered = [o for o in yaml.safe_load_all(out.stdout) if o]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in rendered) == \
        sorted((o["kind"], o["metadata"]["name"]) for o in deployed(DEPLOY / version))
    # the default is v1 (all Kubernetes 1.34 serves); each older version's overlay its own
    assert {o["apiVersion"] for o in rendered if o["kind"] == "DeviceClass"} == {VERSIONS[version]}


def test_each_version_has_the_same_driver_and_device_classes():
    def strip(objs):
        return sorted((o["kind"], yaml.safe_dump({k: v for k, v in o.items() if k != "apiVersion"})) for o in objs)

    default = deployed()
    for version, api in VERSIONS.items():
        objs = deployed(DEPLOY / version)
        assert strip(objs) == strip(default)
        assert {o["apiVersion"] for o in objs if o["kind"] == "DeviceClass"} == {api}


def test_the_v1_examples_are_the_v1beta1_ones_with_requests_under_exactly():
    def to_v1(obj):
        if obj["apiVersion"] == "resource.k8s.io/v1beta1":
            obj = {**obj, "apiVersion": "resource.k8s.io/v1"}
            spec = obj["spec"]["spec"] if obj["kind"] == "ResourceClaimTemplate" else obj["spec"]
            spec["devices"]["requests"] = [{"name": r.pop("name"), "exactly": r} for r in spec["devices"]["requests"]]
        return obj

    for path in sorted((DEPLOY / "examples").glob("*.yaml")):
        old = objects(DEPLOY / "examples" / "v1beta1" / path.name)
        assert [to_v1(o) for o in old] == objects(path), path.name
        assert any(o["apiVersion"] == "resource.k8s.io/v1" for o in objects(path))


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
    assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi", "/driver-root"} <= mounts
    (config,) = by_kind("ConfigMap")
    assert "/etc/nvcontainer-dra/config.toml" in ctr["command"]
    # NVIDIA's chart's layout: the host's driver root (/) read at /driver-root, named as the host's
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    volume = next(m["name"] for m in ctr["volumeMounts"] if m["mountPath"] == env["DRIVER_ROOT_CTR_PATH"])
    host = next(v["hostPath"]["path"] for v in pod["volumes"] if v["name"] == volume)
    assert host == env["NVIDIA_DRIVER_ROOT"] == "/"
    assert roots(env["NVIDIA_DRIVER_ROOT"], env["DRIVER_ROOT_CTR_PATH"], "/") == ("/driver-root", "/")
    assert "root =" not in config["data"]["config.toml"]       # no driver root of the pod's own


def test_driver_roots_as_nvidia_s_plugin_takes_them():
    def never(_):
        return False

    assert roots(None, None, "/", isdir=lambda p: p == "/driver-root") == ("/driver-root", "/")
    assert roots("/run/nvidia/driver", None, "/", isdir=lambda p: p == "/driver-root") == \
        ("/driver-root", "/run/nvidia/driver")
    assert roots(None, "/mnt/d", "/", isdir=never) == ("/mnt/d", "/")
    assert roots(None, None, "/fake", isdir=never) == ("/fake", "/fake")          # on the host itself
    assert roots("/run/nvidia/driver", None, "/", isdir=never) == ("/run/nvidia/driver",) * 2
    with pytest.raises(NvcError, match="--container-driver-root rel: must be an absolute path"):
        roots(None, "rel", "/")


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
