"""The runtime shim's Python half: argv, the low-level runtime, the spec edit (legacy and CDI),
the write-back and the program the native front runs. Real runtimes and engines driving the
shim are in test_runtime_engines.py; the native front itself in test_runtime_front.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from nvcontainer.records import replace
from pathlib import Path

import pytest

from nvcontainer.cdi import check, generate, store
from nvcontainer.config.load import parse as parse_config
from nvcontainer.config.model import Config
from nvcontainer.errors import NvcError
from nvcontainer.inventory.build import build as build_inventory
from nvcontainer.runtime import argv, bundle, cdiedits, edit, legacy, lowlevel, prepare
from tests.fixtures.fakegpu import FakeSpec

HOOK = legacy.hook_entry("/usr/bin/nvidia-container-runtime-hook", None, 30)


def spec_bytes(env=(), annotations=None, mounts=(), hooks=None, caps=("CAP_CHOWN",), **extra) -> bytes:
    spec = {
        "ociVersion": "1.0.2",
        "process": {"args": ["sh"], "env": ["PATH=/bin", *env], "capabilities": {"bounding": list(caps)}},
        "root": {"path": "rootfs"},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}, *mounts],
        "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]}},
    }
    if annotations is not None:
        spec["annotations"] = annotations
    if hooks is not None:
        spec["hooks"] = hooks
    spec.update(extra)
    return json.dumps(spec, indent=2).encode()


class Untouchable:
    """A world that fails the test if the edit consults it."""

    def hook(self):
        raise AssertionError("the hook was looked up")

    def inventory(self):
        raise AssertionError("the inventory was read")

    def cdi(self):
        raise AssertionError("the CDI specs were read")


# --- argv -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, command, bundle, name", [
    (["--root", "/r", "--log", "/l", "--log-format", "json", "create", "--bundle", "/b", "--pid-file", "/p", "id"],
     "create", "/b", "config.json"),
    (["--systemd-cgroup", "create", "-b", "/b/../c", "id"], "create", "/c", "config.json"),
    (["-root=/r", "run", "--bundle=/b", "-d", "id"], "run", "/b", "config.json"),
    (["create", "id"], "create", "/cwd", "config.json"),
    (["create", "--bundle", "rel", "id"], "create", "/cwd/rel", "config.json"),
    (["--cgroup-manager", "systemd", "create", "--config", "spec.json", "-b", "/b", "id"], "create", "/b", "spec.json"),
    (["create", "-f", "s.json", "id"], "create", "/cwd", "s.json"),
    (["--root", "/r", "start", "id"], "start", None, "config.json"),
    (["--root", "/r", "delete", "--force", "id"], "delete", None, "config.json"),
    (["--version"], None, None, "config.json"),
    (["--unknown-switch", "create", "--bundle", "/b", "id"], "create", "/b", "config.json"),
    (["--", "create", "id"], "create", "/cwd", "config.json"),
])
def test_argv(args, command, bundle, name):
    inv = argv.parse(args, "/cwd")
    assert (inv.command, inv.bundle, inv.spec_name) == (command, bundle, name)
    assert inv.edits_spec is (command in ("create", "run"))


def test_argv_global_options():
    inv = argv.parse(["--root", "/r", "--log=/l", "--log-format", "json", "--debug", "state", "x"], "/")
    assert inv.options == {"--root": "/r", "--log": "/l", "--log-format": "json", "--debug": True}


# --- the low-level runtime ---------------------------------------------------------------------

def _program(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_lowlevel_find(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _program(b / "crun")
    (a / "runc").write_text("not executable")
    search = f"{a}:{b}"
    assert lowlevel.find(("runc", "crun"), search) == str(b / "crun")
    assert lowlevel.find((str(b / "crun"),), "") == str(b / "crun")
    _program(a / "nvidia-container-runtime")
    assert lowlevel.find(("nvidia-container-runtime", "crun"), search) == str(b / "crun")   # never itself
    st = os.stat(b / "crun")
    with pytest.raises(NvcError, match="no low-level runtime found: none of runc, crun is an executable file"):
        lowlevel.find(("runc", "crun"), search, own=(st.st_dev, st.st_ino))


def test_lowlevel_default_search_is_fixed(monkeypatch, tmp_path):
    _program(tmp_path / "runc-from-env")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NvcError):
        lowlevel.find(("runc-from-env",))


# --- legacy mode ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two(fake_machine_factory):
    m = fake_machine_factory(FakeSpec(gpus=2))
    return m, build_inventory(str(m.root), proc=str(m.proc))


class Machine:
    def __init__(self, inv, view=None):
        self._inv, self._view = inv, view

    def hook(self):
        return HOOK

    def inventory(self):
        return self._inv

    def cdi(self):
        assert self._view is not None, "the CDI specs were read"
        return self._view


@pytest.mark.parametrize("env", [(), ("NVIDIA_VISIBLE_DEVICES=",), ("NVIDIA_VISIBLE_DEVICES=void",),
                                 ("NVIDIA_VISIBLE_DEVICES=0,void",), ("OTHER=NVIDIA_VISIBLE_DEVICES",)])
def test_a_container_that_asks_for_nothing_is_left_alone(env):
    result = edit.edit(spec_bytes(env), "/b", Config(), Untouchable())
    assert result.data is None and result.mode == "legacy"


def test_unprivileged_refused_is_left_alone():
    strict = Config(accept_envvar_unprivileged=False)
    result = edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=all"]), "/b", strict, Untouchable())
    assert result.data is None and "ignoring NVIDIA_VISIBLE_DEVICES" in result.warnings[0]


def test_legacy_adds_the_hook_and_the_plans_devices(two):
    machine, inv = two
    result = edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=1"]), "/b", Config(), Machine(inv))
    spec = json.loads(result.data)
    assert spec["hooks"]["prestart"] == [HOOK]
    assert HOOK["env"] == [f"PATH={lowlevel.SAFE_PATH}"] and HOOK["timeout"] == 60
    assert HOOK["args"] == ["nvidia-container-runtime-hook", "prestart"]
    uvm = machine.uvm_major
    nodes = [(d["path"], d["major"], d["minor"]) for d in spec["linux"]["devices"]]
    assert nodes == [("/dev/nvidiactl", 195, 255), ("/dev/nvidia-uvm", uvm, 0), ("/dev/nvidia-uvm-tools", uvm, 1),
                     ("/dev/nvidia1", 195, 1)]
    assert all(d["type"] == "c" and d["fileMode"] == 0o666 for d in spec["linux"]["devices"])
    assert spec["linux"]["resources"]["devices"] == [
        {"allow": False, "access": "rwm"},
        *({"allow": True, "type": "c", "major": a, "minor": b, "access": "rw"} for _, a, b in nodes)]
    # the rest of the document is the engine's
    original = json.loads(spec_bytes(["NVIDIA_VISIBLE_DEVICES=1"]))
    for key in ("process", "root", "mounts", "ociVersion"):
        assert spec[key] == original[key]
    # a second edit finds everything in place and writes nothing
    assert edit.edit(result.data, "/b", Config(), Machine(inv)).data is None


def test_legacy_keeps_a_hook_that_is_there(two):
    _, inv = two
    for entry in ({"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["x", "prestart"]},
                  {"path": "/usr/bin/other", "args": ["nvidia-container-toolkit", "prestart"]},
                  {"path": "/opt/nvc/bin/nvcontainer-hook-client", "args": ["c", "prestart"]},
                  {"path": "/opt/py", "args": ["/opt/py", "-I", "-S", "/x/nvcontainer/hook/client.py", "prestart"]}):
        result = edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=0"], hooks={"prestart": [entry]}), "/b", Config(),
                           Machine(inv))
        assert json.loads(result.data)["hooks"]["prestart"] == [entry]
    other = {"path": "/bin/true"}
    result = edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=0"], hooks={"prestart": [other]}), "/b", Config(),
                       Machine(inv))
    assert json.loads(result.data)["hooks"]["prestart"] == [other, HOOK]


def test_legacy_no_cgroups_adds_only_the_hook(two):
    _, inv = two
    result = edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=0"]), "/b", Config(no_cgroups=True), Machine(inv))
    spec = json.loads(result.data)
    assert spec["hooks"]["prestart"] == [HOOK] and "devices" not in spec["linux"]
    assert spec["linux"]["resources"]["devices"] == [{"allow": False, "access": "rwm"}]


def test_legacy_refusals_are_the_hooks(two):
    _, inv = two
    with pytest.raises(NvcError, match="device error: 7: unknown device"):
        edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=7"]), "/b", Config(), Machine(inv))
    with pytest.raises(NvcError, match="requirement error"):
        edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=99.0"]), "/b", Config(),
                  Machine(inv))
    with pytest.raises(NvcError, match="not allowed on this node"):
        edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=1"]), "/b", Config(allowed_devices=("0",)), Machine(inv))
    with pytest.raises(NvcError, match="CDI device name"):
        edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"]), "/b", Config(mode="legacy"), Machine(inv))


def test_mig_and_imex_nodes_come_from_the_plan(fake_machine_factory):
    m = fake_machine_factory(FakeSpec(gpus=2, mig=True))
    inv = build_inventory(str(m.root), proc=str(m.proc))
    mig = inv.gpus[0].migs[0]
    result = edit.edit(spec_bytes([f"NVIDIA_VISIBLE_DEVICES={mig.uuid}"]), "/b", Config(), Machine(inv))
    paths = [d["path"] for d in json.loads(result.data)["linux"]["devices"]]
    assert "/dev/nvidia0" in paths and any(p.startswith("/dev/nvidia-caps/nvidia-cap") for p in paths)


def test_graphics_dri_nodes_and_caps_rules_come_from_the_plan(two, fake_machine_factory):
    """The DRI nodes of a graphics container's GPU are the runtime's own devices and rules
    (issue 15.13); mig-config's nodes are reached through the /dev/nvidia-caps mount, so only
    their rules are written (issue 15.7)."""
    machine, inv = two
    card, render = machine.description()["gpus"][1]["dri"]
    result = edit.edit(spec_bytes(["NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=graphics,display"]), "/b",
                       Config(), Machine(inv))
    spec = json.loads(result.data)
    dri = [(d["path"], d["major"], d["minor"]) for d in spec["linux"]["devices"] if d["path"].startswith("/dev/dri/")]
    assert dri == [(n["path"], 226, n["minor"]) for n in (card, render)]
    rules = spec["linux"]["resources"]["devices"]
    assert {"allow": True, "type": "c", "major": 226, "minor": render["minor"], "access": "rw"} in rules
    m = fake_machine_factory(FakeSpec(gpus=2, mig=True))
    mig_inv = build_inventory(str(m.root), proc=str(m.proc))
    privileged = spec_bytes(["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_MIG_CONFIG_DEVICES=all"], caps=("CAP_SYS_ADMIN",))
    spec = json.loads(edit.edit(privileged, "/b", Config(), Machine(mig_inv)).data)
    assert not [d for d in spec["linux"]["devices"] if d["path"].startswith("/dev/nvidia-caps")]
    assert {"allow": True, "type": "c", "major": m.caps_major, "minor": 1, "access": "rw"} in spec["linux"]["resources"]["devices"]


@pytest.mark.parametrize("spec, message", [
    (b'{"ociVersion": "1", "root": {"path": "r"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}, "hooks": []}',
     "config.json: hooks: expected an object"),
    (b'{"ociVersion": "1", "root": {"path": "r"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}, '
     b'"hooks": {"prestart": {}}}', "config.json: hooks: prestart: expected a list"),
    (b'{"ociVersion": "1", "root": {"path": "r"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}, "linux": 5}',
     "config.json: linux: expected an object"),
    (b'{"ociVersion": "1", "root": {"path": "r"}, "process": {"env": "NVIDIA_VISIBLE_DEVICES=0"}}',
     "process.env: expected a list"),
    (b'{"ociVersion": "1", "root": {"path": "r"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}',
     "config.json: invalid JSON"),
    (b'[1]', "config.json: expected an object"),
])
def test_hostile_specs_are_one_line(two, spec, message):
    with pytest.raises(NvcError) as info:
        edit.edit(spec, "/b", Config(), Machine(two[1]))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("depth", [300, 600, 800, 900, 950, 990, 100_000])
def test_a_deep_spec_is_edited_or_one_line(two, depth):
    """A field nested as deep as the parser takes, or deeper: edited (its compare and write
    back take what the parse took), or one line (issue 35: every parse's failures one line)."""
    spec = (b'{"ociVersion": "1", "root": {"path": "r"}, "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}, '
            b'"x-deep": ' + b"[" * depth + b"]" * depth + b"}")
    try:
        result = edit.edit(spec, "/b", Config(), Machine(two[1]))
    except NvcError as err:
        assert "nested too deeply" in str(err) and "\n" not in str(err)
    else:
        assert result.data is None or json.loads(result.data)["linux"]["devices"]


# --- CDI mode --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cdi_world(two, tmp_path_factory):
    machine, inv = two
    spec_dir = tmp_path_factory.mktemp("cdi")
    hook = os.path.join(os.path.dirname(sys.executable), "nvcontainer-hook")
    spec = generate.generate(inv, generate.Options(hook_path=hook))
    (spec_dir / "nvidia.yaml").write_text(generate.render(spec, "yaml", inv.driver_version))
    specs, problems = store.scan([str(spec_dir)])
    now = check.running(str(machine.proc))

    def stale(spec_file):
        verdict = check.evaluate(spec_file, now, check.probe)
        return f"{spec_file.path} is stale: {verdict.problems[0]}" if verdict.stale else None

    view = edit.CdiView(tuple(specs), tuple(problems), stale, check.probe)
    return machine, Machine(inv, view), spec_dir


def _cdi_edit(world, config=Config(), **spec_args):
    return edit.edit(spec_bytes(**spec_args), "/b", config, world)


def test_cdi_name_in_the_environment_is_cdi_in_auto_mode(cdi_world):
    machine, world, spec_dir = cdi_world
    hook = {"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["h", "prestart"]}
    result = _cdi_edit(world, env=["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=1"], hooks={"prestart": [hook]})
    assert result.mode == "cdi" and "nvidia.com/gpu=1" in result.summary
    spec = json.loads(result.data)
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["process"]["env"]
    assert not any(e.startswith("NVIDIA_VISIBLE_DEVICES=nvidia") for e in spec["process"]["env"])
    paths = [d["path"] for d in spec["linux"]["devices"]]
    assert "/dev/nvidia1" in paths and "/dev/nvidia0" not in paths and "/dev/nvidiactl" in paths
    rules = spec["linux"]["resources"]["devices"]
    assert {"allow": True, "type": "c", "major": 195, "minor": 1, "access": "rwm"} in rules
    assert spec["hooks"]["prestart"] == []                    # NVIDIA's hook taken out, as upstream does
    assert [h["args"][1] for h in spec["hooks"]["createRuntime"]][:1] == ["create-symlinks"]
    libcuda = [m for m in spec["mounts"] if m["destination"].endswith("/libcuda.so.550.54.14")]
    assert libcuda and libcuda[0]["source"] == f"{machine.root}{libcuda[0]['destination']}"
    depths = [len(m["destination"].strip("/").split("/")) for m in spec["mounts"]]
    assert depths == sorted(depths)


def test_cdi_annotations_win_and_cdi_mode_qualifies_ids(cdi_world):
    _, world, _ = cdi_world
    result = _cdi_edit(world, env=["NVIDIA_VISIBLE_DEVICES=0"], annotations={"cdi.k8s.io/plugin": "nvidia.com/gpu=1"})
    assert result.mode == "cdi" and "/dev/nvidia0" not in [d["path"] for d in json.loads(result.data)["linux"]["devices"]]
    result = _cdi_edit(world, Config(mode="cdi"), env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert "nvidia.com/gpu=0" in result.summary
    result = _cdi_edit(world, Config(mode="cdi"), env=["NVIDIA_VISIBLE_DEVICES=all"])
    assert {"/dev/nvidia0", "/dev/nvidia1"} <= {d["path"] for d in json.loads(result.data)["linux"]["devices"]}
    assert _cdi_edit(world, Config(mode="cdi"), env=["NVIDIA_VISIBLE_DEVICES=void"]).data is None
    # in auto mode a plain id is the hook's
    assert _cdi_edit(Machine(world._inv), env=["NVIDIA_VISIBLE_DEVICES=0"]).mode == "legacy"


def test_cdi_volume_mounts(cdi_world):
    _, world, _ = cdi_world
    cfg = Config(accept_volume_mounts=True)
    for dest in ("/var/run/nvidia-container-devices/cdi/nvidia.com/gpu/1",
                 "/var/run/nvidia-container-devices/cdi/nvidia.com/gpu=1"):
        result = _cdi_edit(world, cfg, mounts=[{"source": "/dev/null", "destination": dest, "type": "bind"}])
        assert "nvidia.com/gpu=1" in result.summary


@pytest.mark.parametrize("spec_args, message", [
    ({"env": ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=9"]},
     "cdi error: unresolvable CDI device nvidia.com/gpu=9 (from NVIDIA_VISIBLE_DEVICES)"),
    ({"annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0,gpu0"}}, "'gpu0' is not a CDI device name"),
    ({"env": ["NVIDIA_VISIBLE_DEVICES=example.com/net=0"]}, "unresolvable CDI device example.com/net=0"),
])
def test_cdi_refusals(cdi_world, spec_args, message):
    with pytest.raises(NvcError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _cdi_edit(cdi_world[1], **spec_args)


def test_cdi_stale_spec_is_refused(cdi_world):
    _, world, _ = cdi_world
    view = replace(world._view, stale=lambda spec_file: f"{spec_file.path} is stale: made for driver 1.2")
    with pytest.raises(NvcError, match="nvidia.yaml is stale: made for driver 1.2"):
        _cdi_edit(Machine(world._inv, view), env=["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"])


def test_cdi_conflicting_specs_are_refused(cdi_world, tmp_path):
    _, world, spec_dir = cdi_world
    text = (spec_dir / "nvidia.yaml").read_text()
    (tmp_path / "a.yaml").write_text(text)
    (tmp_path / "b.yaml").write_text(text)
    specs, problems = store.scan([str(tmp_path)])
    view = replace(world._view, specs=tuple(specs))
    with pytest.raises(NvcError, match="defined twice at the same priority"):
        _cdi_edit(Machine(world._inv, view), env=["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"])


def test_cdi_edits_as_engines_apply_them():
    spec = {"process": {"env": ["A=1", "B=2", "A=3"]}, "mounts": [{"destination": "/a/b/c"}, {"destination": "/x"}],
            "linux": {"devices": [{"path": "/dev/foo", "type": "c", "major": 1, "minor": 1}]}}

    def probe(path):
        return {"/host/dev/foo": ("c", 10, 200)}.get(path)

    cdiedits.apply(spec, {
        "env": ["A=9", "C=4"],
        "deviceNodes": [{"path": "/dev/foo", "hostPath": "/host/dev/foo", "permissions": "rw"}],
        "mounts": [{"hostPath": "/h/x", "containerPath": "/x", "options": ["ro", "rbind"]},
                   {"hostPath": "/h/d", "containerPath": "/d/e"}],
        "hooks": [{"hookName": "createRuntime", "path": "/bin/hook", "args": ["hook", "x"], "env": ["PATH=/bin"]}],
        "additionalGids": [44],
    }, "test", probe)
    assert spec["process"]["env"] == ["A=9", "B=2", "C=4"]
    assert spec["linux"]["devices"] == [{"path": "/dev/foo", "type": "c", "major": 10, "minor": 200, "fileMode": 0o666}]
    assert spec["linux"]["resources"]["devices"] == [{"allow": True, "type": "c", "major": 10, "minor": 200,
                                                      "access": "rw"}]
    assert [m["destination"] for m in spec["mounts"]] == ["/x", "/d/e", "/a/b/c"]
    assert spec["mounts"][0] == {"source": "/h/x", "destination": "/x", "options": ["ro", "rbind"]}
    assert spec["hooks"] == {"createRuntime": [{"path": "/bin/hook", "args": ["hook", "x"], "env": ["PATH=/bin"]}]}
    assert spec["process"]["user"]["additionalGids"] == [44]


@pytest.mark.parametrize("edits, message", [
    ({"deviceNodes": [{"path": "/dev/x", "hostPath": "/missing"}]}, "device node /missing does not exist"),
    ({"deviceNodes": [{"path": "dev/x", "type": "c", "major": 1, "minor": 1}]}, "path: expected an absolute path"),
    ({"deviceNodes": [{"path": "/dev/x", "type": "c", "major": 1, "minor": 1, "permissions": "rwx"}]},
     "permissions: expected r, w and m"),
    ({"mounts": [{"hostPath": "/a", "containerPath": "rel"}]}, "containerPath: expected an absolute path"),
    ({"hooks": [{"hookName": "later", "path": "/bin/x"}]}, "hookName: later is not an OCI hook stage"),
    ({"netDevices": [{"hostInterfaceName": "eth0"}]}, "netDevices: not supported"),
])
def test_cdi_edit_refusals(edits, message):
    with pytest.raises(NvcError, match=message):
        cdiedits.apply({}, edits, "spec", lambda path: None)


# --- the write-back ---------------------------------------------------------------------------------

def test_write_back_keeps_mode_and_owner_and_leaves_nothing(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"{}")
    os.chmod(path, 0o640)
    os.chown(path, 1234, 5678)
    data, st = bundle.read(str(path))
    bundle.write_back(str(path), b'{"a":1}', st)
    after = os.stat(path)
    assert path.read_bytes() == b'{"a":1}' and stat.S_IMODE(after.st_mode) == 0o640
    assert (after.st_uid, after.st_gid) == (1234, 5678) and after.st_ino != st.st_ino
    assert sorted(os.listdir(tmp_path)) == ["config.json"]


def test_write_back_does_not_wait_for_the_disk(tmp_path, monkeypatch):
    """The edit is renamed into place without an fsync: no engine reads a bundle after a crash,
    and a flush would make the container's start wait for the filesystem's journal."""
    path = tmp_path / "config.json"
    path.write_bytes(b"{}")
    _, st = bundle.read(str(path))
    flushed = []
    monkeypatch.setattr(os, "fsync", lambda fd: flushed.append(fd))
    monkeypatch.setattr(os, "fdatasync", lambda fd: flushed.append(fd))
    bundle.write_back(str(path), b'{"a":1}', st)
    assert path.read_bytes() == b'{"a":1}' and flushed == []


def test_write_back_failure_leaves_the_file(tmp_path):
    """The rename fails (a directory is in the file's place): the new file is removed again."""
    path = tmp_path / "config.json"
    path.write_bytes(b"{}")
    _, st = bundle.read(str(path))
    path.unlink()
    path.mkdir()
    (path / "keep").write_text("x")
    with pytest.raises(NvcError, match="cannot write .*config.json: Is a directory"):
        bundle.write_back(str(path), b"[]", st)
    assert sorted(os.listdir(tmp_path)) == ["config.json"] and (path / "keep").read_text() == "x"


@pytest.mark.parametrize("kind", ["symlink", "fifo", "huge", "dir"])
def test_reading_a_hostile_spec_is_one_line(tmp_path, kind):
    path = tmp_path / "config.json"
    if kind == "symlink":
        (tmp_path / "real.json").write_text("{}")
        path.symlink_to("real.json")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate((16 << 20) + 1)
    else:
        path.mkdir()
    with pytest.raises(NvcError) as info:
        bundle.read(str(path))
    assert str(path) in str(info.value)


# --- the program the front runs -------------------------------------------------------------------

def _config(tmp_path, text: str) -> str:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return str(path)


def test_prepare_replies_with_the_runtime_and_edits_nothing_for_other_commands(tmp_path):
    runc = _program(tmp_path / "my-runc")
    cfg = _config(tmp_path, f'[nvidia-container-runtime]\nruntimes = ["{runc}"]\n')
    status, runtime = prepare.run(["--config", cfg, "--", "--root", "/x", "state", "id"])
    assert (status, runtime) == (0, str(runc))


def test_prepare_edits_the_bundle(two, tmp_path):
    machine, _ = two
    runc = _program(tmp_path / "my-runc")
    hook = _program(tmp_path / "my-hook")
    cfg = _config(tmp_path, f'[nvidia-container-runtime]\nruntimes = ["{runc}"]\n'
                            f'[nvidia-container-runtime-hook]\npath = "{hook}"\n'
                            f'[nvidia-container-cli]\nroot = "{machine.root}"\n'
                            f'[nvcontainer]\ncache-dir = "{tmp_path / "cache"}"\n')
    b = tmp_path / "bundle"
    b.mkdir()
    (b / "config.json").write_bytes(spec_bytes(["NVIDIA_VISIBLE_DEVICES=0"]))
    res = subprocess.run(["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                          f"mount --bind {machine.proc}/devices /proc/devices && "
                          f"mount -t tmpfs t /proc/driver && mkdir /proc/driver/nvidia && "
                          f"mount --bind {machine.proc}/driver/nvidia /proc/driver/nvidia && exec \"$@\"", "sh",
                          sys.executable, "-I", "-m", "nvcontainer.runtime", "--config", cfg, "--cwd", str(b),
                          "--reply-fd", "1", "--", "create", "id"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{runc}\n"
    spec = json.loads((b / "config.json").read_text())
    assert spec["hooks"]["prestart"] == [{"path": str(hook), "args": ["my-hook", "--config", cfg, "prestart"],
                                          "env": [f"PATH={lowlevel.SAFE_PATH}"],
                                          "timeout": int(Config().deadline) + legacy.TIMEOUT_MARGIN}]
    assert "/dev/nvidia0" in [d["path"] for d in spec["linux"]["devices"]]


def test_prepare_errors_go_to_stderr_and_the_runtime_log(tmp_path):
    cfg = _config(tmp_path, '[nvidia-container-runtime]\nruntimes = ["/nonexistent/runc"]\n')
    log = tmp_path / "log.json"
    res = subprocess.run([sys.executable, "-I", "-m", "nvcontainer.runtime", "--prog", "nvcontainer-runtime",
                          "--config", cfg, "--reply-fd", "1", "--", "--log", str(log), "--log-format", "json", "start",
                          "id"], capture_output=True, text=True, timeout=60)
    line = ("nvcontainer-runtime: runtime error: no low-level runtime found: none of /nonexistent/runc is an "
            "executable file")
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.startswith(line) and res.stderr.count("\n") == 1
    record = json.loads(log.read_text())
    assert record["level"] == "error" and record["msg"] == res.stderr.strip() and record["time"].endswith("Z")


def test_prepare_config_errors_name_the_file(tmp_path):
    cfg = _config(tmp_path, "[nvidia-container-runtime]\nmode = 'fast'\n")
    status, runtime = prepare.run(["--config", cfg, "--", "create", "id"])
    assert (status, runtime) == (1, None)


def test_hook_program_discovery(tmp_path):
    install = tmp_path / "bin"
    install.mkdir()
    _program(install / "nvidia-container-runtime-hook")
    assert prepare.hook_program(Config(), str(install)) == str(install / "nvidia-container-runtime-hook")
    _program(install / "nvcontainer-hook-client")   # where setup --serve builds the served client
    assert prepare.hook_program(Config(), str(install)) == str(install / "nvcontainer-hook-client")
    explicit = _program(tmp_path / "hook")
    assert prepare.hook_program(Config(hook_path=str(explicit)), str(install)) == str(explicit)
    with pytest.raises(NvcError, match="no prestart hook found: /missing/hook"):
        prepare.hook_program(Config(hook_path="/missing/hook"), str(install))


def test_config_hook_path_from_the_toolkit_file():
    assert parse_config('[nvidia-container-runtime-hook]\npath = "/usr/bin/nvidia-container-runtime-hook"').hook_path \
        == "/usr/bin/nvidia-container-runtime-hook"


@pytest.mark.parametrize("env, names", [
    (["DOCKER_RESOURCE_GPU=", "NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=all"], ("nvidia.com/gpu=all",)),
    (["DOCKER_RESOURCE_GPU= , ", "NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"], ("nvidia.com/gpu=0",)),
    (["DOCKER_RESOURCE_GPU=nvidia.com/gpu=1", "NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"], ("nvidia.com/gpu=1",)),
])
def test_cdi_names_an_empty_swarm_variable_counts_as_unset(env, names):
    """Issue 15 item 10 in the runtime's CDI reading too: a swarm resource variable that is set
    but empty does not take NVIDIA_VISIBLE_DEVICES away (upstream's bug)."""
    from nvcontainer.request.oci import parse_spec
    from nvcontainer.runtime import cdinames
    spec = parse_spec(spec_bytes(env, caps=("CAP_SYS_ADMIN",)), "/b")
    got = cdinames.asked(spec, Config(mode="cdi", swarm_resource=("DOCKER_RESOURCE_GPU",)), "cdi")
    assert got is not None and got.names == names
