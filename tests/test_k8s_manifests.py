"""deploy/kubernetes renders, with ``kubectl kustomize``, into what the code needs and no more.

Each overlay is rendered and its objects checked structurally: the paths the code opens (taken
from the code's own defaults and from the rendered config file, parsed by the code's own
parsers) are mounted from the host where they must be, the image is the package's version, the
containers get the driver through the ``nvidia`` runtime class, and their privileges are the
minimum this deployment argues for. kubectl is the one on PATH; ``NVCONTAINER_TEST_KUBECTL``
names more (colon-separated: Debian 12's kubectl 1.20 with kustomize v2.0.3, say), and every
overlay must render the same with all of them.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from nvcontainer import __version__  # noqa: E402
from nvcontainer.config import load as config_load  # noqa: E402
from nvcontainer.config.model import Config  # noqa: E402
from nvcontainer.deviceplugin import settings as dp_settings  # noqa: E402
from nvcontainer.labels import publish  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("mig-mixed", "time-slicing", "mps", "cdi-cri")
TARGETS = ("base",) + tuple(f"overlays/{o}" for o in OVERLAYS)
CAPABILITIES = {"SETUID", "SETGID", "KILL"}   # NVML's child drops to `user`; a hung one is killed
KERNEL_VIEWS = ("/proc", "/sys")              # the pod's own are the kernel's


def kubectls() -> list[str]:
    found = [shutil.which("kubectl")] + os.environ.get("NVCONTAINER_TEST_KUBECTL", "").split(":")
    return list(dict.fromkeys(k for k in found if k and os.access(k, os.X_OK)))


def render(target: str | Path, kubectl: str | None = None) -> str:
    kubectl = kubectl or (kubectls() or [None])[0]
    if kubectl is None:
        pytest.skip("no kubectl")
    done = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {target}: {done.stderr}"
    return done.stdout


def objects(target: str) -> list[dict]:
    return [o for o in yaml.safe_load_all(render(DEPLOY / target)) if o]


def one(objs, kind, name=None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} objects"
    return found[0]


def daemonsets(objs) -> list[dict]:
    return [o for o in objs if o["kind"] == "DaemonSet"]


def container_of(ds: dict) -> dict:
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return container


def rendered_config(objs) -> tuple[Config, dp_settings.Settings]:
    text = one(objs, "ConfigMap", "nvcontainer-config")["data"]["config.toml"]
    cfg = config_load.parse(text, "ConfigMap nvcontainer-config")
    return cfg, dp_settings.parse(cfg.device_plugin)


def command_word(container: dict) -> str:
    argv = container["command"]
    assert argv[:3] == ["nvcontainer", "--config", "/etc/nvcontainer/config.toml"]
    return argv[3]


def option(container: dict, name: str) -> str | None:
    argv = container["command"]
    return argv[argv.index(name) + 1] if name in argv else None


def mounts(ds: dict) -> dict[str, tuple[dict, dict]]:
    """mount path -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"].get("volumes", [])}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container_of(ds).get("volumeMounts", [])}


def covering(ds: dict, path: str) -> tuple[str, dict, dict] | None:
    """The mount that holds ``path`` in the container (the deepest), if any."""
    best = None
    for where, (mount, volume) in mounts(ds).items():
        if path == where or path.startswith(where.rstrip("/") + "/"):
            if best is None or len(where) > len(best[0]):
                best = (where, mount, volume)
    return best


def needs(ds: dict, cfg: Config, dp: dp_settings.Settings) -> dict[str, str]:
    """What the container's command opens, from the code's settings: path -> "host" (a host
    directory shared with the kubelet, NFD or other pods: hostPath at the same path, writable),
    "host-read" (the same, read-only is enough), "private" (any writable volume), "kernel"
    (the pod's own /proc, /sys)."""
    container = container_of(ds)
    word = command_word(container)
    paths = {cfg.cache_dir: "private", "/proc/driver/nvidia": "kernel", dp.sysfs: "kernel"}
    if word == "device-plugin":
        paths[dp.socket_dir] = "host"
        if dp.sharing == "mps":
            paths[dp.mps_root] = "host-read"
    elif word == "labels":
        paths[posixpath.dirname(option(container, "--output-file"))] = "host"
    elif word == "mps-daemon":
        paths[dp.mps_root] = "host"
    else:
        raise AssertionError(f"unknown command {word}")
    return paths


@pytest.fixture(scope="module", params=TARGETS)
def rendered(request):
    objs = objects(request.param)
    return request.param, objs


def test_every_overlay_renders_the_same_with_every_kubectl():
    found = kubectls()
    if len(found) < 2:
        pytest.skip("one kubectl only (set NVCONTAINER_TEST_KUBECTL to Debian's kubectl 1.20 to compare)")
    for target in TARGETS:
        outputs = {k: render(DEPLOY / target, k) for k in found}
        assert len(set(outputs.values())) == 1, f"{target} renders differently with {list(outputs)}"


def test_every_path_the_code_opens_is_there(rendered):
    target, objs = rendered
    cfg, dp = rendered_config(objs)
    for ds in daemonsets(objs):
        name = ds["metadata"]["name"]
        for path, how in needs(ds, cfg, dp).items():
            held = covering(ds, path)
            if how == "kernel":
                assert held is None or held[2].get("hostPath", {}).get("path") == held[0], \
                    f"{target} {name}: {path} hidden by a volume"
                assert path.startswith(KERNEL_VIEWS)
                continue
            assert held is not None, f"{target} {name}: nothing mounted at {path}"
            where, mount, volume = held
            if how == "private":
                assert "emptyDir" in volume and not mount.get("readOnly"), f"{target} {name}: {path}"
                continue
            assert where == path, f"{target} {name}: {path} is under {where}, not mounted itself"
            assert volume.get("hostPath", {}).get("path") == path, f"{target} {name}: {path} not the host's"
            assert volume["hostPath"].get("type") in ("Directory", "DirectoryOrCreate")
            if how == "host":
                assert not mount.get("readOnly"), f"{target} {name}: {path} must be writable"


def test_the_driver_comes_through_the_runtime_class(rendered):
    target, objs = rendered
    cfg, _dp = rendered_config(objs)
    assert one(objs, "RuntimeClass", "nvidia")["handler"] == "nvidia"
    assert cfg.root == "/", "the driver root is what the hook injected into the container"
    for ds in daemonsets(objs):
        spec = ds["spec"]["template"]["spec"]
        env = {e["name"]: e["value"] for e in container_of(ds).get("env", [])}
        assert spec["runtimeClassName"] == "nvidia", ds["metadata"]["name"]
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
        capabilities = set(env["NVIDIA_DRIVER_CAPABILITIES"].split(","))
        want = {"utility", "compute"} if command_word(container_of(ds)) == "mps-daemon" else {"utility"}
        assert capabilities == want, f"{target} {ds['metadata']['name']}: {capabilities}"
        assert covering(ds, "/") is None and not any(
            v.get("hostPath", {}).get("path") == "/" for v in spec.get("volumes", [])), "no host / mounted"


def test_privileges_are_the_minimum(rendered):
    target, objs = rendered
    cfg, dp = rendered_config(objs)
    for ds in daemonsets(objs):
        name = ds["metadata"]["name"]
        spec = ds["spec"]["template"]["spec"]
        container = container_of(ds)
        security = container["securityContext"]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert not spec.get("hostNetwork") and not spec.get("hostIPC"), name
        assert bool(spec.get("hostPID")) == (command_word(container) == "mps-daemon"), \
            f"{target} {name}: host PID namespace only for the MPS server, whose clients are other pods"
        assert spec["automountServiceAccountToken"] is False
        assert security["runAsUser"] == 0
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert security["capabilities"]["drop"] == ["ALL"]
        assert set(security["capabilities"]["add"]) == CAPABILITIES, f"{target} {name}"
        if dp.mig_strategy != "none" and command_word(container) != "mps-daemon":
            # MIG devices are listed by NVML only with the MIG monitor capability, which the
            # hook grants privileged containers only
            assert env.get("NVIDIA_MIG_MONITOR_DEVICES") == "all", f"{target} {name}"
            assert security["privileged"] is True and security["allowPrivilegeEscalation"] is True
        else:
            assert "NVIDIA_MIG_MONITOR_DEVICES" not in env
            assert security["privileged"] is False, f"{target} {name}: privileged"
            assert security["allowPrivilegeEscalation"] is False
        for mount, volume in mounts(ds).values():
            if "hostPath" in volume:
                host = volume["hostPath"]["path"]
                assert host in needs(ds, cfg, dp), f"{target} {name}: {host} mounted but never opened"


def test_the_image_is_the_package_version(rendered):
    target, objs = rendered
    with open(ROOT / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert version == __version__
    for ds in daemonsets(objs):
        assert container_of(ds)["image"] == f"nvcontainer:{version}", f"{target} {ds['metadata']['name']}"


def test_an_operator_overlay_can_name_the_image(tmp_path):
    overlay = tmp_path / "mine"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        f"bases:\n  - {os.path.relpath(DEPLOY / 'overlays' / 'mps', overlay)}\n"
        "images:\n  - name: nvcontainer\n    newName: registry.example.com/gpu/nvcontainer\n    newTag: 0.1.0-site1\n")
    objs = [o for o in yaml.safe_load_all(render(overlay)) if o]
    images = {container_of(ds)["image"] for ds in daemonsets(objs)}
    assert images == {"registry.example.com/gpu/nvcontainer:0.1.0-site1"}


def test_every_container_runs_a_command_of_ours(rendered):
    from nvcontainer.cli.main import cli

    _target, objs = rendered
    for ds in daemonsets(objs):
        word = command_word(container_of(ds))
        if word == "mps-daemon" and word not in cli.commands:
            pytest.skip("nvcontainer mps-daemon is not in this tree yet (branch mps)")
        assert word in cli.commands, word


def test_the_labeller_writes_nfd_s_feature_file(rendered):
    _target, objs = rendered
    labeller = container_of(one(objs, "DaemonSet", "nvcontainer-node-labeller"))
    assert command_word(labeller) == "labels"
    assert option(labeller, "--output-file") == publish.DEFAULT_FEATURE_FILE
    assert int(option(labeller, "--period")) > 0


def test_each_overlay_makes_its_choice():
    base_cfg, base = rendered_config(objects("base"))
    assert (base.mig_strategy, base.replicas, base.sharing) == ("none", 1, "time-slicing")

    _cfg, mig = rendered_config(objects("overlays/mig-mixed"))
    assert mig.mig_strategy == "mixed"

    _cfg, sliced = rendered_config(objects("overlays/time-slicing"))
    assert sliced.sharing == "time-slicing" and sliced.replicas > 1

    mps_objs = objects("overlays/mps")
    _cfg, mps = rendered_config(mps_objs)
    assert mps.sharing == "mps" and mps.replicas > 1 and mps.mig_strategy == "none"
    daemon = one(mps_objs, "DaemonSet", "nvcontainer-mps-daemon")
    assert command_word(container_of(daemon)) == "mps-daemon"
    assert daemon["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/mps.capable": "true"}
    assert not [o for o in objects("base") if o["metadata"]["name"] == "nvcontainer-mps-daemon"]

    _cfg, cdi = rendered_config(objects("overlays/cdi-cri"))
    assert cdi.device_list_strategy[0] == "cdi-cri"
    assert set(base.device_list_strategy).isdisjoint({"cdi-cri", "cdi-annotations"})
