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
from nvcontainer.deviceplugin import mps, settings as dp_settings  # noqa: E402
from nvcontainer.installer.settings import READY_FILE  # noqa: E402
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


def containers(ds: dict) -> list[dict]:
    spec = ds["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


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


def waits(container: dict) -> bool:
    """The init container that waits for the installer's ready file: no GPU, no privilege."""
    return command_word(container) == "install" and "--wait-ready" in container["command"]


def installs(ds: dict) -> bool:
    return any(command_word(c) == "install" and not waits(c) for c in containers(ds))


def mounts_shm(container: dict) -> bool:
    return command_word(container) == "mps-daemon" and "--mount-shm" in container["command"]


def mounts(ds: dict, container: dict) -> dict[str, tuple[dict, dict]]:
    """mount path -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"].get("volumes", [])}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container.get("volumeMounts", [])}


def covering(ds: dict, container: dict, path: str) -> tuple[str, dict, dict] | None:
    """The mount that holds ``path`` in the container (the deepest), if any."""
    best = None
    for where, (mount, volume) in mounts(ds, container).items():
        if path == where or path.startswith(where.rstrip("/") + "/"):
            if best is None or len(where) > len(best[0]):
                best = (where, mount, volume)
    return best


def needs(container: dict, cfg: Config, dp: dp_settings.Settings) -> dict[str, tuple[str, str | None, str]]:
    """What the container's command opens, from the code's settings: container path -> (how,
    host path, propagation). how: "host" (a host directory shared with the kubelet, NFD or other
    pods, writable), "host-read" (read-only is enough), "private" (any writable volume),
    "kernel" (the pod's own /proc, /sys)."""
    word = command_word(container)
    if waits(container):
        return {posixpath.dirname(READY_FILE): ("host-read", posixpath.dirname(READY_FILE), "")}
    if word == "install":   # the host's / (engine files, /usr/local, /run), seeing later mounts
        return {"/host": ("host", "/", "HostToContainer")}
    paths = {cfg.cache_dir: ("private", None, ""), "/proc/driver/nvidia": ("kernel", None, ""),
             dp.sysfs: ("kernel", None, "")}
    if word == "device-plugin":
        paths[dp.socket_dir] = ("host", dp.socket_dir, "")
        if dp.sharing == "mps":
            # it looks at the daemons' markers, which appear after it started
            paths[dp.mps_root] = ("host-read", dp.mps_root, "HostToContainer")
    elif word == "labels":
        directory = posixpath.dirname(option(container, "--output-file"))
        paths[directory] = ("host", directory, "")
    elif mounts_shm(container):
        # the tmpfs it mounts must be the host's
        return {dp.mps_root: ("host", dp.mps_root, "Bidirectional")}
    elif word == "mps-daemon":
        # each daemon's /dev/shm is its own <mps-root>/<resource>/<GPU>/shm, bound in a mount
        # namespace of the daemon's: nothing shared at the container's /dev/shm
        paths[dp.mps_root] = ("host", dp.mps_root, "HostToContainer")
    else:
        raise AssertionError(f"unknown command {word}")
    return paths


@pytest.fixture(scope="module", params=TARGETS)
def rendered(request):
    return request.param, objects(request.param)


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
        for container in containers(ds):
            name = f"{target} {ds['metadata']['name']}/{container['name']}"
            for path, (how, host, propagation) in needs(container, cfg, dp).items():
                held = covering(ds, container, path)
                if how == "kernel":
                    assert held is None, f"{name}: {path} hidden by a volume"
                    assert path.startswith(KERNEL_VIEWS)
                    continue
                assert held is not None, f"{name}: nothing mounted at {path}"
                where, mount, volume = held
                if how == "private":
                    assert "emptyDir" in volume and not mount.get("readOnly"), f"{name}: {path}"
                    continue
                assert where == path, f"{name}: {path} is under {where}, not mounted itself"
                assert volume.get("hostPath", {}).get("path") == host, f"{name}: {path} is not the host's {host}"
                assert volume["hostPath"].get("type") in ("Directory", "DirectoryOrCreate")
                assert mount.get("mountPropagation", "") == propagation, f"{name}: {path} propagation"
                if how == "host":
                    assert not mount.get("readOnly"), f"{name}: {path} must be writable"


def test_the_driver_comes_through_the_runtime_class(rendered):
    target, objs = rendered
    cfg, _dp = rendered_config(objs)
    assert one(objs, "RuntimeClass", "nvidia")["handler"] == "nvidia"
    assert cfg.root == "/", "the driver root is what the hook injected into the container"
    for ds in daemonsets(objs):
        spec = ds["spec"]["template"]["spec"]
        if installs(ds):   # it makes the runtime class work: it cannot run under it
            assert "runtimeClassName" not in spec
            continue
        assert spec["runtimeClassName"] == "nvidia", ds["metadata"]["name"]
        assert not any(v.get("hostPath", {}).get("path") == "/" for v in spec.get("volumes", [])), "no host /"
        for container in containers(ds):
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            if waits(container):
                assert "NVIDIA_VISIBLE_DEVICES" not in env, "waiting needs no GPU"
                continue
            if mounts_shm(container):
                assert "NVIDIA_VISIBLE_DEVICES" not in env, "the tmpfs mounter needs no GPU"
                continue
            assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
            capabilities = set(env["NVIDIA_DRIVER_CAPABILITIES"].split(","))
            want = {"utility", "compute"} if command_word(container) == "mps-daemon" else {"utility"}
            assert capabilities == want, f"{target} {ds['metadata']['name']}: {capabilities}"


def privileged_because(container: dict, dp: dp_settings.Settings) -> str | None:
    """Why a container may be privileged, or None: it may not."""
    if command_word(container) == "install" and not waits(container):
        return "it writes the engine's files and /usr/local, signals the engine, joins the host's namespaces"
    if command_word(container) == "mps-daemon":
        return "a bidirectional mount" if mounts_shm(container) else "the MPS server opens every GPU"
    if dp.mig_strategy != "none":
        return "NVML lists MIG devices only with the MIG monitor capability, granted to privileged containers"
    return None


def test_privileges_are_the_minimum(rendered):
    target, objs = rendered
    cfg, dp = rendered_config(objs)
    for ds in daemonsets(objs):
        spec = ds["spec"]["template"]["spec"]
        words = {command_word(c) for c in containers(ds)}
        assert not spec.get("hostNetwork") and not spec.get("hostIPC"), ds["metadata"]["name"]
        assert bool(spec.get("hostPID")) == ("mps-daemon" in words or installs(ds)), \
            f"{target}: host PID namespace only for the MPS server, whose clients are other pods, and the " \
            "installer, which signals the engine"
        assert spec["automountServiceAccountToken"] is False
        for container in containers(ds):
            name = f"{target} {ds['metadata']['name']}/{container['name']}"
            security = container["securityContext"]
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            if waits(container):
                assert security["runAsNonRoot"] is True and security["capabilities"]["drop"] == ["ALL"], name
                assert security["allowPrivilegeEscalation"] is False and "add" not in security["capabilities"]
            elif privileged_because(container, dp):
                assert security["privileged"] is True and security.get("allowPrivilegeEscalation", True), name
                if command_word(container) not in ("mps-daemon", "install"):
                    assert env.get("NVIDIA_MIG_MONITOR_DEVICES") == "all", name
            else:
                assert "NVIDIA_MIG_MONITOR_DEVICES" not in env
                assert security["privileged"] is False, f"{name}: privileged"
                assert security["allowPrivilegeEscalation"] is False
                assert security["runAsUser"] == 0
                assert security["seccompProfile"] == {"type": "RuntimeDefault"}
                assert security["capabilities"]["drop"] == ["ALL"]
                assert set(security["capabilities"]["add"]) == CAPABILITIES, name
            opened = {host for _how, host, _p in needs(container, cfg, dp).values() if host}
            for mount, volume in mounts(ds, container).values():
                if "hostPath" in volume:
                    assert volume["hostPath"]["path"] in opened, f"{name}: {volume['hostPath']['path']} never opened"


def test_the_image_is_the_package_version(rendered):
    target, objs = rendered
    with open(ROOT / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert version == __version__
    for ds in daemonsets(objs):
        for container in containers(ds):
            assert container["image"] == f"nvcontainer:{version}", f"{target} {ds['metadata']['name']}"


def test_an_operator_overlay_can_name_the_image(tmp_path):
    overlay = tmp_path / "mine"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        f"bases:\n  - {os.path.relpath(DEPLOY / 'overlays' / 'mps', overlay)}\n"
        "images:\n  - name: nvcontainer\n    newName: registry.example.com/gpu/nvcontainer\n    newTag: 0.1.0-site1\n")
    objs = [o for o in yaml.safe_load_all(render(overlay)) if o]
    images = {c["image"] for ds in daemonsets(objs) for c in containers(ds)}
    assert images == {"registry.example.com/gpu/nvcontainer:0.1.0-site1"}


def test_every_container_runs_a_command_of_ours(rendered):
    from nvcontainer.cli.main import cli

    _target, objs = rendered
    for ds in daemonsets(objs):
        for container in containers(ds):
            command = cli.commands[command_word(container)]
            options = {o for p in command.params for o in p.opts}
            given = {a for a in container["command"][4:] if a.startswith("-")}
            assert given <= options, given - options


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


def test_the_objects_hang_together(rendered):
    """What the API server would accept and the kubelet could start: each DaemonSet's selector
    matches its pods, every ConfigMap, ServiceAccount and RuntimeClass it names exists, and
    every namespaced object is in the namespace the kustomization creates."""
    target, objs = rendered
    namespace = one(objs, "Namespace")["metadata"]["name"]
    for obj in objs:
        if obj["kind"] not in ("Namespace", "RuntimeClass"):
            assert obj["metadata"]["namespace"] == namespace, f"{target} {obj['metadata']['name']}"
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for ds in daemonsets(objs):
        template = ds["spec"]["template"]
        assert ds["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        spec = template["spec"]
        assert ("ServiceAccount", spec["serviceAccountName"]) in names
        assert installs(ds) or ("RuntimeClass", spec["runtimeClassName"]) in names
        for volume in spec["volumes"]:
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names, f"{target}: {volume}"
