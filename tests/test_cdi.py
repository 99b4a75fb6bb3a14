"""``nvcontainer cdi generate|list|check`` and the CDI hooks, on fake GPU machines.

Podman consuming the specs is in test_cdi_podman.py. Golden specs for the fake machines are in
tests/golden/cdi (driver root written as @ROOT@, dynamic majors as @UVM_MAJOR@...); rewrite them after an intended change with
``NVC_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvcontainer import __version__
from nvcontainer.hook import cdi as cdi_hooks, main as hook
from nvcontainer.cdi import check, generate, spec, store, yamltext
from nvcontainer.errors import NvcError
from nvcontainer.inventory import ldcache
from nvcontainer.inventory.model import DeviceNode, DriverFile, Gpu, Inventory, MigDevice
from tests.fixtures import runtime
from tests.fixtures.fakegpu import FakeSpec, run_in_fake_proc
from tests.fixtures.docs import assert_documented, mentions, section

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "nvcontainer"]
HOOK = [sys.executable, "-m", "nvcontainer.hook"]
HOOK_PATH = "/usr/bin/nvcontainer-hook"
GOLDEN = Path(__file__).resolve().parent / "golden" / "cdi"
LIB_OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]


@pytest.fixture(scope="module")
def plain(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


@pytest.fixture(scope="module")
def mig(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2, mig=True))


def cli(machine, *args, timeout=60):
    return run_in_fake_proc(machine, [*CLI, "--root", str(machine.root), *args], capture_output=True, text=True,
                            timeout=timeout)


def generated(machine, *args, hook_path: str | None = HOOK_PATH) -> str:
    """The spec text; ``hook_path`` None: the installed hook, as a user gets it."""
    res = cli(machine, "cdi", "generate", *(["--hook-path", hook_path] if hook_path else []), *args)
    assert res.returncode == 0, res.stderr
    return res.stdout


def spec_of(machine, *args) -> dict:
    text = generated(machine, *args)
    return json.loads(text) if "json" in args else yamltext.load(text, "stdout")


def nodes(edits: dict) -> list[tuple[str, str, int, int]]:
    return [(n["path"], n.get("hostPath", n["path"]), n["major"], n["minor"]) for n in edits.get("deviceNodes", [])]


def hook_args(spec_dict: dict, name: str) -> list[str]:
    (hook,) = [h for h in spec_dict["containerEdits"]["hooks"] if h["args"][1] == name]
    return hook["args"][2:]


# --- generate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,fake", [("gpus2", FakeSpec(gpus=2)), ("mig", FakeSpec(gpus=2, mig=True))])
def test_golden_specs(fake_machine_factory, name, fake):
    machine = fake_machine_factory(fake)
    text = generated(machine).replace(str(machine.root), "@ROOT@")
    text = text.replace(f"nvcontainer {__version__} ", "nvcontainer @VERSION@ ")
    for piece, major in machine.description()["majors"].items():   # dynamic majors depend on the host
        if piece != "nvidia" and major is not None:
            text = text.replace(f"major: {major}\n", f"major: @{piece.upper()}_MAJOR@\n")
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("NVC_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_spec_follows_the_machine(plain):
    desc = plain.description()
    root = str(plain.root)
    s = spec_of(plain)
    assert s["cdiVersion"] == "0.5.0"          # digit names and hostPath; nothing newer
    assert s["kind"] == "nvidia.com/gpu"
    names = [d["name"] for d in s["devices"]]
    assert names == ["0", desc["gpus"][0]["uuid"], "1", desc["gpus"][1]["uuid"], "all"]
    by_name = {d["name"]: d["containerEdits"] for d in s["devices"]}
    for gpu in desc["gpus"]:
        want = [(f"/dev/nvidia{gpu['minor']}", f"{root}/dev/nvidia{gpu['minor']}", 195, gpu["minor"])]
        want += [(n["path"], root + n["path"], 226, n["minor"]) for n in gpu["dri"]]   # its card and render nodes
        assert len(want) == 3
        assert nodes(by_name[str(gpu["index"])]) == want
        assert nodes(by_name[gpu["uuid"]]) == want
    assert nodes(by_name["all"]) == nodes(by_name["0"]) + nodes(by_name["1"])
    common = s["containerEdits"]
    assert common["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    majors = desc["majors"]
    assert nodes(common) == [("/dev/nvidiactl", f"{root}/dev/nvidiactl", 195, 255),
                             ("/dev/nvidia-uvm", f"{root}/dev/nvidia-uvm", majors["uvm"], 0),
                             ("/dev/nvidia-uvm-tools", f"{root}/dev/nvidia-uvm-tools", majors["uvm"], 1),
                             ("/dev/nvidia-modeset", f"{root}/dev/nvidia-modeset", 195, 254)]
    mounts = {m["containerPath"]: m for m in common["mounts"]}
    files = [lib["path"] for lib in desc["libraries"] + desc["libraries32"]] + [b["path"] for b in desc["binaries"]]
    files += [f["path"] for f in desc["firmwares"]] + [lib["path"] for lib in desc["graphics"]["libraries"]]
    for path in files:   # every driver file, at its own path, read-only
        assert mounts[path] == {"hostPath": root + path, "containerPath": path, "options": LIB_OPTIONS}
    for f in desc["graphics"]["files"]:   # Vulkan, EGL, Xorg files: where loaders look, the real file behind
        assert mounts[f["name"]] == {"hostPath": root + f["path"], "containerPath": f["name"], "options": LIB_OPTIONS}
    for ipc in desc["ipcs"]:
        assert mounts[ipc["path"]]["options"] == ["nosuid", "nodev", "noexec", "rbind", "rprivate"]
    assert len(mounts) == len(files) + len(desc["graphics"]["files"]) + len(desc["ipcs"])
    assert not any(path.startswith("/proc/") for path in mounts)
    for hook in common["hooks"]:
        assert hook["hookName"] == "createRuntime" and hook["path"] == HOOK_PATH
        assert hook["env"] == list(generate.HOOK_ENV)      # never the runtime's or the image's environment
        assert hook["timeout"] == 20 + 30                  # the default deadline, and setup's margin
    links = hook_args(s, "create-symlinks")
    assert "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so" in links
    assert "libcuda.so.550.54.14::/usr/lib/x86_64-linux-gnu/libcuda.so.1" in links
    assert hook_args(s, "update-ldcache") == ["--folder", "/usr/lib/x86_64-linux-gnu", "--folder",
                                              "/usr/lib/i386-linux-gnu", "--ldconfig-path", "/sbin/ldconfig",
                                              "--host-driver-version", "550.54.14"]
    assert hook_args(s, "disable-device-node-modification") == []


def test_mig_devices_get_their_capability_nodes(mig):
    desc = mig.description()
    s = spec_of(mig, "--device-name-strategy", "type-index", "--device-name-strategy", "index")
    by_name = {d["name"]: d["containerEdits"] for d in s["devices"]}
    assert list(by_name) == ["gpu0", "0", "mig0:0", "0:0", "mig0:1", "0:1", "gpu1", "1", "all"]
    for m in desc["gpus"][0]["migs"]:
        want = [("/dev/nvidia0", 195, 0)] + [(c["path"], c["major"], c["minor"]) for c in (m["gi_cap"], m["ci_cap"])]
        got = [(p, a, b) for p, _, a, b in nodes(by_name[f"0:{m['index']}"])]
        assert got == want
        assert nodes(by_name[f"mig0:{m['index']}"]) == nodes(by_name[f"0:{m['index']}"])
    every = [n for name in ("0", "0:0", "0:1", "1") for n in nodes(by_name[name])]
    assert nodes(by_name["all"]) == list(dict.fromkeys(every))


def test_options_change_kind_names_and_version(plain):
    s = spec_of(plain, "--vendor", "example.com", "--class", "gpu.compute", "--device-name-strategy", "uuid",
                "--no-all-device")
    assert s["kind"] == "example.com/gpu.compute"
    assert s["cdiVersion"] == "0.6.0"          # a dot in the class
    assert all(d["name"].startswith("GPU-") for d in s["devices"]) and len(s["devices"]) == 2


def test_json_records_the_driver_in_an_annotation(plain):
    as_json = spec_of(plain, "--format", "json")
    as_yaml = spec_of(plain)
    assert as_json["annotations"] == {generate.DRIVER_ANNOTATION: "550.54.14"}
    assert as_json["cdiVersion"] == "0.6.0"
    del as_json["annotations"], as_json["cdiVersion"], as_yaml["cdiVersion"]
    assert as_json == as_yaml


def test_output_is_written_atomically(plain, tmp_path):
    out = tmp_path / "new" / "nvidia.json"
    assert generated(plain, "--output", str(out)) == ""
    first = out.read_text()
    assert json.loads(first)["kind"] == "nvidia.com/gpu"        # the format follows the extension
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    out.write_text("old")
    generated(plain, "-o", str(out))
    assert out.read_text() == first
    assert sorted(p.name for p in out.parent.iterdir()) == ["nvidia.json"]   # no temporary left behind
    assert store.read_spec(str(out)).spec["devices"]


@pytest.mark.parametrize("args,expected", [
    (["--vendor", "not a vendor"], "nvcontainer: input error: invalid CDI vendor"),
    (["--class", "-gpu"], "nvcontainer: input error: invalid CDI class"),
    (["--hook-path", "nvcontainer-hook"], "nvcontainer: input error: hook path nvcontainer-hook: must be absolute"),
    (["--device-name-strategy", "serial"], "nvcontainer: input error:"),
    (["--host-driver-root", "rel"], "nvcontainer: input error: --host-driver-root rel: must be an absolute path"),
])
def test_bad_options_are_one_line_errors(plain, args, expected):
    res = cli(plain, "cdi", "generate", *args)
    assert res.returncode == 1
    assert res.stderr.startswith(expected) and res.stderr.count("\n") == 1, res.stderr


def test_a_spec_generated_in_a_container_names_the_host_s_paths(plain):
    """--root where a pod sees the host's driver, --host-driver-root what the host calls it: the
    host's runtime reads the spec, and only host paths exist for it (issue 32)."""
    spec = spec_of(plain, "--host-driver-root", "/")
    every = [spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])]
    paths = [m["hostPath"] for e in every for m in e.get("mounts", ())] + \
        [n.get("hostPath", n["path"]) for e in every for n in e.get("deviceNodes", ())]
    root = str(plain.root)
    assert any("libcuda.so" in p for p in paths) and not [p for p in paths if p.startswith(root)]
    assert not [p for p in paths if not os.path.lexists(root + p)]          # each is the host's file
    plain_paths = [m["hostPath"] for m in spec_of(plain)["containerEdits"]["mounts"]]
    assert all(p.startswith(root + "/") for p in plain_paths)                # as read, by default


def _inventory(root: str) -> Inventory:
    cuda = DriverFile("/usr/lib64/libcuda.so.1.2.3", "compute", "libcuda.so", "libcuda.so.1",
                      (("libcuda.so.1", "libcuda.so.1.2.3"),))
    vdpau = DriverFile("/usr/lib64/vdpau/libvdpau_nvidia.so.1.2.3", "video", "libvdpau_nvidia.so",
                       "libvdpau_nvidia.so.1", (("libvdpau_nvidia.so.1", "libvdpau_nvidia.so.1.2.3"),))
    mig = MigDevice(0, 0, "MIG-aaaa", 1, 0, "/proc/gi", "/proc/ci", DeviceNode("/dev/nvidia-caps/nvidia-cap12", 510, 12))
    gpu = Gpu(0, 3, "G", "Tesla", "GPU-1234", "00000000:07:00.0", "8.0", True, True, (mig,))
    return Inventory(root=root, driver_version="1.2.3", cuda_version="12.0", gpus=(gpu,),
                     ctl_devices=(DeviceNode("/dev/nvidiactl", 195, 255),), libraries=(cuda, vdpau))


def test_files_keep_their_host_directory():
    s = generate.generate(_inventory("/drv"), generate.Options(hook_path=HOOK_PATH)).to_dict()
    mounts = {m["containerPath"]: m["hostPath"] for m in s["containerEdits"]["mounts"]}
    assert mounts == {"/usr/lib64/libcuda.so.1.2.3": "/drv/usr/lib64/libcuda.so.1.2.3",
                      "/usr/lib64/vdpau/libvdpau_nvidia.so.1.2.3": "/drv/usr/lib64/vdpau/libvdpau_nvidia.so.1.2.3"}
    links = hook_args(s, "create-symlinks")[1::2]
    assert "libvdpau_nvidia.so.1.2.3::/usr/lib64/vdpau/libvdpau_nvidia.so.1" in links
    assert "libcuda.so.1::/usr/lib64/libcuda.so" in links
    assert hook_args(s, "update-ldcache")[:4] == ["--folder", "/usr/lib64", "--folder", "/usr/lib64/vdpau"]
    assert [d["name"] for d in s["devices"]] == ["0", "GPU-1234", "0:0", "MIG-aaaa", "all"]
    assert s["devices"][2]["containerEdits"]["deviceNodes"][1]["hostPath"] == "/drv/dev/nvidia-caps/nvidia-cap12"


def test_lowest_version_when_nothing_newer_is_needed():
    opts = generate.Options(hook_path=HOOK_PATH, strategies=("uuid",))
    s = generate.generate(_inventory("/"), opts).to_dict()
    assert "hostPath" not in s["devices"][0]["containerEdits"]["deviceNodes"][0]   # same as path under /
    assert s["cdiVersion"] == "0.3.0"
    assert generate.generate(_inventory("/drv"), opts).to_dict()["cdiVersion"] == "0.5.0"


def test_no_gpu_no_spec():
    inv = Inventory(root="/", driver_version="1.2.3", cuda_version="12.0")
    with pytest.raises(NvcError, match="no GPUs"):
        generate.generate(inv, generate.Options(hook_path=HOOK_PATH))


# --- spec versions -----------------------------------------------------------------------------


def _spec(**extra_edits) -> dict:
    return {"kind": "v.com/c", "devices": [{"name": "x", "containerEdits": {"env": ["A=1"], **extra_edits}}]}


@pytest.mark.parametrize("change,version", [
    (lambda s: s, "0.3.0"),
    (lambda s: s["devices"][0]["containerEdits"].update(mounts=[{"hostPath": "/a", "containerPath": "/a",
                                                                  "type": "bind"}]), "0.4.0"),
    (lambda s: s["devices"][0].update(name="0"), "0.5.0"),
    (lambda s: s["devices"][0]["containerEdits"].update(deviceNodes=[{"path": "/d", "hostPath": "/h"}]), "0.5.0"),
    (lambda s: s.update(annotations={"a": "b"}), "0.6.0"),
    (lambda s: s["devices"][0].update(annotations={"a": "b"}), "0.6.0"),
    (lambda s: s.update(kind="v.com/c.d"), "0.6.0"),
    (lambda s: s.update(containerEdits={"additionalGids": [5]}), "0.7.0"),
    (lambda s: s["devices"][0]["containerEdits"].update(intelRdt={"closID": "x"}), "0.7.0"),
    (lambda s: s.update(containerEdits={"intelRdt": {"schemata": ["L3:0=f"]}}), "1.1.0"),
    (lambda s: s.update(containerEdits={"netDevices": [{"hostInterfaceName": "a", "name": "b"}]}), "1.1.0"),
])
def test_min_version(change, version):
    s = _spec()
    change(s)
    assert spec.min_version(s) == version


def test_validate_refuses_what_engines_refuse():
    good = {"cdiVersion": "0.5.0", **_spec()}
    assert spec.validate(good, "f") is good
    for bad, message in [({**good, "cdiVersion": "0.9.9"}, "unknown cdiVersion"),
                         ({**good, "kind": "nokind"}, "invalid kind"),
                         ({**good, "cdiVersion": "0.3.0", "annotations": {"a": "b"}}, "content needs 0.6.0"),
                         ({**good, "devices": [{"name": "x"}, {"name": "x"}]}, "defined twice"),
                         ({**good, "containerEdits": {"hooks": [{"hookName": "later", "path": "/x"}]}},
                          "not an OCI hook stage"),
                         ({**good, "containerEdits": {"deviceNodes": [{"path": "/d", "major": "195"}]}},
                          "expected int")]:
        with pytest.raises(NvcError, match=message):
            spec.validate(bad, "f")


# --- YAML --------------------------------------------------------------------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                     st.text(st.characters(blacklist_categories=("Cs",)), max_size=20))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=20)


@given(_values)
def test_yaml_round_trip(value):
    assert yamltext.load(yamltext.dump(value, ["a comment"]), "t") == value


@pytest.mark.parametrize("text", ["0", "0:1", "1e3", "yes", "No", "on", "null", "~", "true", "-1", "-", "a: b",
                                  "x #y", " lead", "trail ", "", "[x]", "*a", "&a", "!t", "%d", "@x", "'q'", "a\nb",
                                  ".inf", "0x1f", "0o7", "--link", "a::b"])
def test_yaml_keeps_strings_strings(text):
    assert yamltext.load(yamltext.dump({"k": [text]}), "t") == {"k": [text]}


def test_yaml_reads_nvidia_ctk_output():
    text = """---
cdiVersion: 0.5.0
containerEdits:
  deviceNodes:
  - path: /dev/nvidiactl
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  hooks:
  - args:
    - nvidia-cdi-hook
    - create-symlinks
    - --link
    - libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so
    env:
    - NVIDIA_CTK_DEBUG=false
    hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
  mounts:
  - containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14
    hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14
    options: [ro, nosuid, nodev, bind]   # flow style
devices:
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: "0"
kind: 'nvidia.com/gpu'
"""
    s = store.parse_text(text, "nvidia.yaml")
    assert s["cdiVersion"] == "0.5.0" and s["kind"] == "nvidia.com/gpu"
    assert s["devices"] == [{"containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}, "name": "0"}]
    assert s["containerEdits"]["hooks"][0]["args"][2:] == ["--link", "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so"]
    assert s["containerEdits"]["mounts"][0]["options"] == ["ro", "nosuid", "nodev", "bind"]


@pytest.mark.parametrize("text,message", [
    ("a: &x 1\n", "line 1: unsupported YAML"),
    ("a:\n\tb: 1\n", "line 2: tab in indentation"),
    ("a: 1\n---\nb: 2\n", "line 2: more than one YAML document"),
    ("a: 1\na: 2\n", "line 2: duplicate key"),
    ("a: |\n  text\n", "line 1: unsupported YAML"),
    ("a: \"open\n", "line 1: unterminated"),
    ("a:\n  - 1\n   b: 2\n", "line 3"),
    ("a: 1\n  b: 2\n", "line 2: unexpected indentation"),
])
def test_yaml_refuses_what_it_does_not_support(text, message):
    with pytest.raises(NvcError, match=message):
        yamltext.load(text, "f")


def test_yaml_depth_is_bounded():
    deep = "".join(" " * i + "- \n" for i in range(0, 200, 2)) + " " * 200 + "- x\n"
    with pytest.raises(NvcError, match="nested too deeply"):
        yamltext.load(deep, "f")


# --- list --------------------------------------------------------------------------------------


def _write_spec(path: Path, names: list[str], kind: str = "nvidia.com/gpu") -> None:
    devices = [{"name": n, "containerEdits": {"env": [f"D={n}"]}} for n in names]
    path.write_text(yamltext.dump({"cdiVersion": "0.5.0", "kind": kind, "devices": devices}))


def test_list_resolves_priorities_and_conflicts(tmp_path):
    low, high = tmp_path / "etc", tmp_path / "run"
    low.mkdir()
    high.mkdir()
    _write_spec(low / "a.yaml", ["0", "1"])
    _write_spec(high / "b.yaml", ["1", "2"])
    (high / "c.json").write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                                             "devices": [{"name": "2", "containerEdits": {"env": ["X=1"]}}]}))
    _write_spec(high / "d.yml", ["x"], kind="example.com/net")
    (high / "broken.yaml").write_text("cdiVersion: [\n")
    (high / "notes.txt").write_text("ignored")
    res = subprocess.run([*CLI, "cdi", "list", "--spec-dir", str(low), "--spec-dir", str(high)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert res.stdout.splitlines() == [
        "example.com/net=x",
        "nvidia.com/gpu=0",
        "nvidia.com/gpu=1",
        f"nvidia.com/gpu=2 (conflict: {high}/b.yaml {high}/c.json)",
    ]
    assert f"nvcontainer: warning: {high}/broken.yaml: line 1" in res.stderr
    names = {n.name: n for n in store.resolve_names(store.scan([str(low), str(high)])[0])}
    assert names["nvidia.com/gpu=1"].path == f"{high}/b.yaml"      # the higher-priority directory wins


# --- check -------------------------------------------------------------------------------------


def test_check_fresh_spec_is_ok(plain, tmp_path):
    generated(plain, "-o", str(tmp_path / "nvidia.yaml"), hook_path=None)
    res = cli(plain, "cdi", "check", "--spec-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{tmp_path}/nvidia.yaml: ok (driver 550.54.14, 5 devices)\n"


def test_spec_for_another_driver_is_stale(fake_machine_factory, plain, tmp_path):
    old = fake_machine_factory(FakeSpec(gpus=1, driver_version="535.104.05"))
    generated(old, "--format", "json", "-o", str(tmp_path / "old.json"), hook_path=None)
    res = cli(plain, "cdi", "check", str(tmp_path / "old.json"))
    assert res.returncode == 1
    bus1 = plain.description()["gpus"][1]["proc_bus_id"]
    assert res.stdout.splitlines() == [
        f"{tmp_path}/old.json: stale (driver 535.104.05)",
        "  made for driver 535.104.05, the running driver is 550.54.14",
        f"  GPU {bus1} (/dev/nvidia1) is not in the spec",
        f"  fix: nvcontainer cdi generate --output {tmp_path}/old.json (with the options used before)",
    ]
    assert res.stderr == f"nvcontainer: cdi error: {tmp_path}/old.json is stale\n"


def test_check_finds_missing_files_and_changed_numbers(plain, tmp_path):
    s = spec_of(plain)
    s["devices"][0]["containerEdits"]["deviceNodes"][0]["minor"] = 7
    s["containerEdits"]["mounts"][0]["hostPath"] += ".gone"
    s["containerEdits"]["deviceNodes"][0]["hostPath"] = "/nonexistent/nvidiactl"
    s["containerEdits"]["hooks"][0]["path"] = "/nonexistent/hook"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(s))
    res = cli(plain, "cdi", "check", str(path))
    assert res.returncode == 1
    lines = res.stdout.splitlines()
    assert lines[0] == f"{path}: stale (driver 550.54.14)"     # inferred from the libcuda it mounts
    assert "  missing device node /nonexistent/nvidiactl" in lines
    assert f"  {plain.root}/dev/nvidia0 is 195:0, the spec says 195:7" in lines
    assert f"  missing {s['containerEdits']['mounts'][0]['hostPath']}" in lines
    assert "  missing hook program /nonexistent/hook" in lines


def test_check_with_no_spec_says_so(tmp_path):
    res = subprocess.run([*CLI, "cdi", "check", "--spec-dir", str(tmp_path / "none")], capture_output=True, text=True,
                         timeout=60)
    assert (res.returncode, res.stdout) == (0, f"no CDI specs in {tmp_path}/none\n")


def test_check_without_a_driver():
    sf = store.SpecFile("/x.yaml", 0, {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": []},
                        f"# {generate.DRIVER_COMMENT} 550.54.14\n")
    verdict = check.evaluate(sf, check.Running(None), lambda path: None)
    assert verdict.problems == ("no NVIDIA driver is loaded",)


def test_a_gpu_missing_from_a_per_claim_spec_is_no_sign_of_age():
    """A node spec without a GPU the node has is stale (made before the GPU came); the DRA
    driver's spec of one claim holds only the claim's GPUs by design."""
    node = {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}
    now = check.Running("550.54.14", gpus=((0, "0000:07:00.0"), (1, "0000:08:00.0")))

    def verdict(kind):
        spec = {"cdiVersion": "0.5.0", "kind": kind, "devices": [{"name": "u-gpu-1", "containerEdits": {
            "deviceNodes": [node]}}]}
        return check.evaluate(store.SpecFile("/x.yaml", 0, spec, ""), now, lambda path: ("c", 195, 1))

    assert verdict("nvidia.com/gpu").problems == ("GPU 0000:07:00.0 (/dev/nvidia0) is not in the spec",)
    assert verdict("k8s.gpu.nvidia.com/claim").problems == ()


# --- the CDI hooks -----------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["create-symlinks"], "at least one --link TARGET::LINK"),
    (["create-symlinks", "--link"], "--link needs a value"),
    (["update-ldcache", "--folder", "/a", "--link", "x::/y"], "unknown option --link"),
    (["disable-device-node-modification", "--folder", "/a"], "unknown option --folder"),
])
def test_hook_usage_errors(argv, message):
    res = subprocess.run([*HOOK, *argv], capture_output=True, text=True, timeout=60, input="")
    assert res.returncode == 2
    assert res.stderr == f"nvcontainer-hook: input error: {argv[0]}: {message}\n"


@pytest.mark.parametrize("value", ["x", "x::y", "::/y", "x::/", "x::/a/..", "x::/a/."])
def test_bad_links_are_refused(value):
    with pytest.raises(NvcError, match="--link"):
        cdi_hooks.parse_link(value)


def test_params_rewrite():
    text = "RmLogonRC: 1\nModifyDeviceFiles: 1\nDeviceFileUID: 0\n"
    assert cdi_hooks.params_without_modify(text) == "RmLogonRC: 1\nModifyDeviceFiles: 0\nDeviceFileUID: 0\n"
    assert cdi_hooks.params_without_modify("ModifyDeviceFiles: 0\n") is None
    assert cdi_hooks.params_without_modify(None) is None


@pytest.fixture
def container(tmp_path):
    """A stand-in for a container at createRuntime: a process in its own mount namespace whose
    rootfs has procfs-like /proc/driver (a tmpfs) mounted only there."""
    bundle = tmp_path / "bundle"
    rootfs = runtime.busybox_rootfs(bundle / "rootfs")
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"}}))
    (rootfs / "proc/driver").mkdir(parents=True)
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                             'mount -t tmpfs -o mode=555 nvc-test "$1" && echo ready && exec sleep 120', "sh",
                             str(rootfs / "proc/driver")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    yield proc.pid, bundle, rootfs
    proc.kill()
    proc.wait()


def run_hook(machine, pid, bundle, *argv):
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": pid, "bundle": str(bundle)})
    return run_in_fake_proc(machine, [*HOOK, *argv], input=state, capture_output=True, text=True, timeout=60)


def in_container(pid, *argv) -> str:
    return subprocess.run(["nsenter", "-t", str(pid), "-m", *argv], capture_output=True, text=True, check=True,
                          timeout=30).stdout


def test_create_symlinks_hook(plain, container):
    pid, bundle, rootfs = container
    (rootfs / "usr/lib/x86_64-linux-gnu/libfoo.so").write_text("an image's own file")
    res = run_hook(plain, pid, bundle, "create-symlinks", "--link", "libfoo.so.1::/usr/lib/x86_64-linux-gnu/libfoo.so",
                   "--link", "../../x::/opt/new/dir/link", "--link", "libbar.so.1::/usr/lib/x86_64-linux-gnu/libbar.so")
    assert res.returncode == 0, res.stderr
    assert (rootfs / "usr/lib/x86_64-linux-gnu/libfoo.so").read_text() == "an image's own file"   # not replaced
    assert os.readlink(rootfs / "opt/new/dir/link") == "../../x"
    assert os.readlink(rootfs / "usr/lib/x86_64-linux-gnu/libbar.so") == "libbar.so.1"


def test_disable_device_node_modification_hook(plain, container):
    pid, bundle, rootfs = container
    before = runtime_mounts()
    res = run_hook(plain, pid, bundle, "disable-device-node-modification")
    assert res.returncode == 0, res.stderr
    host_params = (plain.proc / "driver/nvidia/params").read_text()
    inside = in_container(pid, "cat", str(rootfs / "proc/driver/nvidia/params"))
    assert "ModifyDeviceFiles: 1" in host_params
    assert inside == host_params.replace("ModifyDeviceFiles: 1", "ModifyDeviceFiles: 0")
    options = in_container(pid, "findmnt", "-n", "-o", "OPTIONS", str(rootfs / "proc/driver/nvidia/params"))
    assert {"ro", "nosuid", "nodev", "noexec"} <= set(options.strip().split(","))
    assert not (rootfs / "proc/driver/nvidia").exists()      # only in the container's namespace
    assert runtime_mounts() == before


def runtime_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return sorted(" ".join(line.split()[3:5]) for line in f)


def test_update_ldcache_hook(plain, container):
    pid, bundle, rootfs = container
    libdir = rootfs / "opt/nv"
    libdir.mkdir(parents=True)
    shutil.copy(plain.root / "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14", libdir)
    res = run_hook(plain, pid, bundle, "update-ldcache", "--folder", "/opt/nv", "--ldconfig-path", "/sbin/ldconfig")
    assert res.returncode == 0, res.stderr
    assert (rootfs / "etc/ld.so.conf.d/00-nvcontainer-cdi.conf").read_text() == "/opt/nv\n"
    entries = {(e.key, e.value) for e in ldcache.read(str(rootfs / "etc/ld.so.cache"))}
    assert ("libcuda.so.1", "/opt/nv/libcuda.so.1") in entries
    assert os.readlink(libdir / "libcuda.so.1") == "libcuda.so.550.54.14"


@pytest.mark.parametrize("compat_major,used", [(999, True), (550, False), (470, False)])
def test_update_ldcache_hook_gives_cuda_forward_compatibility(plain, container, compat_major, used):
    """With --host-driver-version (the spec has it unless cuda-compat-mode is disabled), an
    image's compat libcuda newer than the host driver is what the container's loader finds
    first; an equal or older one (CUDA errors 803/804) is left out."""
    pid, bundle, rootfs = container
    libdir, compat = rootfs / "opt/nv", rootfs / "usr/local/cuda/compat"
    libdir.mkdir(parents=True)
    compat.mkdir(parents=True)
    shutil.copy(plain.root / "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14", libdir)
    shutil.copy(plain.root / "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14", compat / f"libcuda.so.{compat_major}.1.2")
    res = run_hook(plain, pid, bundle, "update-ldcache", "--folder", "/opt/nv", "--ldconfig-path", "/sbin/ldconfig",
                   "--host-driver-version", "550.54.14")
    assert res.returncode == 0, res.stderr
    first = "/usr/local/cuda/compat\n" if used else ""
    assert (rootfs / "etc/ld.so.conf.d/00-nvcontainer-cdi.conf").read_text() == first + "/opt/nv\n"
    found = [e.value for e in ldcache.read(str(rootfs / "etc/ld.so.cache")) if e.key == "libcuda.so.1"]
    assert found[0] == ("/usr/local/cuda/compat/libcuda.so.1" if used else "/opt/nv/libcuda.so.1"), found


@pytest.mark.parametrize("value", ["", "x", "550.54.14.1.2", "550..1", "-1", "5500000.1"])
def test_host_driver_version_is_checked(value):
    res = subprocess.run([*HOOK, "update-ldcache", "--folder", "/a", "--host-driver-version", value],
                         capture_output=True, text=True, timeout=60, input="")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "--host-driver-version" in res.stderr and "Traceback" not in res.stderr


def test_hook_at_create_container_stage_is_explained(plain, tmp_path):
    res = run_hook(plain, 1, tmp_path, "create-symlinks", "--link", "a::/b")
    assert res.returncode == 1
    assert "CDI hooks run at createRuntime" in res.stderr and res.stderr.count("\n") == 1


# --- documentation -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", [("cdi", "generate"), ("cdi", "list"), ("cdi", "check")])
def test_cdi_options_are_in_the_cdi_page(command):
    out = subprocess.run([*CLI, *command, "--help"], capture_output=True, text=True, check=True, timeout=60).stdout
    options = [(short or None, long) for short, long in re.findall(r"^ {2}(?:(-[A-Za-z]), )?(--[a-z][a-z-]*)", out, re.M)
               if long != "--help"]
    assert options, out
    text = (ROOT / "man" / "nvcontainer-cdi.1").read_text()
    assert_documented(options, section(text, f".SS {command[1]}"), f"man/nvcontainer-cdi.1 ({command[1]})")


def test_hook_dispatches_every_cdi_hook():
    assert hook.CDI_HOOKS == cdi_hooks.SUBCOMMANDS


def test_cdi_hooks_are_in_the_hook_page():
    text = (ROOT / "man" / "nvcontainer-hook.1").read_text()
    for name in (*cdi_hooks.SUBCOMMANDS, "--link", "--folder", "--ldconfig-path", "--host-driver-version",
                 "createRuntime"):
        assert mentions(text, name), f"{name} is not documented in man/nvcontainer-hook.1"


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
@pytest.mark.parametrize("page", ["nvcontainer-cdi.1", "nvcontainer-doctor.1"])
def test_new_pages_render_without_warnings(page):
    env = dict(os.environ, MANWIDTH="80")
    res = subprocess.run(["man", "--warnings", "-l", str(ROOT / "man" / page)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    assert res.returncode == 0 and res.stderr == ""


def test_cdi_hook_owner_counts_only_while_the_pinned_process_lives():
    """The owner is read through /proc/PID; a container gone by then could have handed its number
    to a host process, whose owner must not be taken for the container's."""
    from nvcontainer.apply.pin import pin

    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "60"])   # not our mount ns
    for _ in range(500):
        if os.readlink(f"/proc/{proc.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
            break
        time.sleep(0.01)
    pinned = pin(proc.pid)
    try:
        assert cdi_hooks._owner(pinned) == (os.stat(f"/proc/{proc.pid}").st_uid, os.stat(f"/proc/{proc.pid}").st_gid)
        os.kill(proc.pid, 9)   # a zombie: /proc/PID still answers, as a reused number would
        for _ in range(500):
            if not pinned.alive():
                break
            time.sleep(0.01)
        assert os.path.exists(f"/proc/{proc.pid}")
        with pytest.raises(NvcError, match="exited during configuration"):
            cdi_hooks._owner(pinned)
    finally:
        pinned.close()
        proc.kill()
        proc.wait()


def test_a_spec_offers_only_what_allowed_devices_permits(mig, tmp_path):
    """An engine resolving nvidia.com/gpu=0 must not get a GPU the node holds back."""
    desc = mig.description()
    config = tmp_path / "config.toml"
    config.write_text(f'allowed-devices = ["1", "{desc["gpus"][0]["migs"][1]["uuid"]}"]\n')
    s = spec_of(mig, "--device-name-strategy", "index")   # the whole node, for comparison
    assert [d["name"] for d in s["devices"]] == ["0", "0:0", "0:1", "1", "all"]
    res = run_in_fake_proc(mig, [*CLI, "--root", str(mig.root), "--config", str(config), "cdi", "generate",
                                 "--hook-path", HOOK_PATH, "--device-name-strategy", "index"],
                           capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    by_name = {d["name"]: d["containerEdits"] for d in yamltext.load(res.stdout, "stdout")["devices"]}
    assert list(by_name) == ["0:1", "1", "all"]          # GPU 0 itself and its MIG 0:0 are held back
    assert nodes(by_name["all"]) == list(dict.fromkeys(nodes(by_name["0:1"]) + nodes(by_name["1"])))
    config.write_text('allowed-devices = ["GPU-nothing-here"]\n')
    res = run_in_fake_proc(mig, [*CLI, "--root", str(mig.root), "--config", str(config), "cdi", "generate",
                                 "--hook-path", HOOK_PATH], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr.endswith("allowed-devices permits no device on this node: a CDI spec needs at least one\n")
    assert res.stderr.count("\n") == 1


def test_graphics_in_the_spec(mig):
    """Issue 15.13, as NVIDIA's CDI generator has it: a GPU's device brings its DRI nodes and a
    hook for their /dev/dri/by-path links; a MIG device brings none (no graphics instance); the
    common edits give the Xorg GLX module its unversioned link."""
    desc = mig.description()
    s = spec_of(mig, "--device-name-strategy", "index")
    by_name = {d["name"]: d["containerEdits"] for d in s["devices"]}
    every = []
    for gpu in desc["gpus"]:
        edits = by_name[str(gpu["index"])]
        assert [n[0] for n in nodes(edits)][1:] == [n["path"] for n in gpu["dri"]]
        card, render = (n["path"].rsplit("/", 1)[1] for n in gpu["dri"])
        links = [f"../{card}::/dev/dri/by-path/pci-{gpu['proc_bus_id']}-card",
                 f"../{render}::/dev/dri/by-path/pci-{gpu['proc_bus_id']}-render"]
        (hook,) = edits["hooks"]
        assert hook["args"] == ["nvcontainer-hook", "create-symlinks", "--link", links[0], "--link", links[1]]
        assert hook["hookName"] == "createRuntime" and hook["env"] == list(generate.HOOK_ENV) and hook["timeout"] == 50
        every += links
    for mig_device in desc["gpus"][0]["migs"]:
        edits = by_name[f"0:{mig_device['index']}"]
        assert not any(n[0].startswith("/dev/dri/") for n in nodes(edits)) and "hooks" not in edits
    (hook,) = by_name["all"]["hooks"]
    assert hook["args"][2:] == [arg for link in every for arg in ("--link", link)]
    glx = f"libglxserver_nvidia.so.{desc['driver_version']}"
    assert f"{glx}::/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so" in hook_args(s, "create-symlinks")


def test_hook_timeout_follows_the_configured_deadline(plain, tmp_path):
    """Without a timeout a runtime waits for a stuck hook for ever: each hook gets the
    configuration's deadline (rounded up) plus 30 s, so the hook's own error comes first."""
    config = tmp_path / "config.toml"
    config.write_text("deadline = 7.5\n")
    res = run_in_fake_proc(plain, [*CLI, "--root", str(plain.root), "--config", str(config), "cdi", "generate",
                                   "--hook-path", HOOK_PATH], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    hooks = yamltext.load(res.stdout, "stdout")["containerEdits"]["hooks"]
    assert [h["timeout"] for h in hooks] == [38] * len(hooks) and len(hooks) == 3
    spec.validate({"cdiVersion": "0.5.0", "kind": "a.com/b", "devices": [], "containerEdits": {"hooks": hooks}}, "x")


def test_update_ldcache_hook_checks_ldconfig_before_placing_anything(plain, container):
    """The program is opened in the host process before the worker starts: a bad one is a
    one-line refusal, and the container gets no drop-in naming folders no cache lists."""
    pid, bundle, rootfs = container
    res = run_hook(plain, pid, bundle, "update-ldcache", "--folder", "/opt/nv", "--ldconfig-path", "/nowhere/ldconfig")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "/nowhere/ldconfig" in res.stderr, res.stderr
    assert not (rootfs / "etc/ld.so.conf.d/00-nvcontainer-cdi.conf").exists()


@pytest.mark.parametrize("image", ["none", "own", "link-to-host", "dangling-link"])
def test_update_ldcache_hook_gives_an_image_without_ld_so_conf_one(plain, container, tmp_path, image):
    """As upstream's hook: an image with no /etc/ld.so.conf gets ``include
    /etc/ld.so.conf.d/*.conf``, so that an ldconfig run later in the container keeps the
    drop-in's folders. Whatever an image has at that name stays exactly as it was: its own
    file, or a link (to a host file that must not be written through, or to nothing)."""
    pid, bundle, rootfs = container
    conf = rootfs / "etc/ld.so.conf"
    host_file = tmp_path / "host-ld.so.conf"
    host_file.write_text("host\n")
    conf.unlink()
    if image == "own":
        conf.write_text("/opt/image-libs\n")
    elif image == "link-to-host":
        conf.symlink_to(host_file)
    elif image == "dangling-link":
        conf.symlink_to("/nowhere/ld.so.conf")
    libdir = rootfs / "opt/nv"
    libdir.mkdir(parents=True)
    shutil.copy(plain.root / "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14", libdir)
    res = run_hook(plain, pid, bundle, "update-ldcache", "--folder", "/opt/nv")
    assert res.returncode == 0, res.stderr
    if image == "none":
        assert conf.read_text() == "include /etc/ld.so.conf.d/*.conf\n" and not conf.is_symlink()
    elif image == "own":
        assert conf.read_text() == "/opt/image-libs\n"
    else:
        assert os.readlink(conf) == (str(host_file) if image == "link-to-host" else "/nowhere/ld.so.conf")
    assert host_file.read_text() == "host\n"
    assert not list((rootfs / "etc").glob(".nvcontainer-*"))   # no temporary left behind
    entries = {(e.key, e.value) for e in ldcache.read(str(rootfs / "etc/ld.so.cache"))}
    assert ("libcuda.so.1", "/opt/nv/libcuda.so.1") in entries
