"""``allowed-devices``: a node that may hand out only some of its GPUs (a Mesos agent with
``--nvidia_gpu_devices``). The pure parts: config parsing, resolution against the inventory,
selection, the plan, and the info/list JSON; expectations come from the fake machine's own
description, not from the code under test.
"""

from __future__ import annotations

import json
import sys

import pytest

from nvcontainer.cli import views
from nvcontainer.config.load import parse
from nvcontainer.config.model import Config
from nvcontainer.plan.gather import host_proc, options_from_config
from nvcontainer.errors import NvcError
from nvcontainer.inventory.build import build
from nvcontainer.plan.build import build_plan
from nvcontainer.plan.container import ContainerFacts
from nvcontainer.request.decide import request_from_env, request_from_options
from nvcontainer.request.selection import allow_list, held_back, select
from tests.fixtures.fakegpu import FakeSpec

DEBIAN = ContainerFacts(libs_dir="/usr/lib/x86_64-linux-gnu", libs32_dir="/usr/lib/i386-linux-gnu", debian=True)


@pytest.fixture(scope="module")
def mig(fake_machine_factory):
    """GPU 0 in MIG mode with two MIG devices, GPU 1 whole."""
    m = fake_machine_factory(FakeSpec(gpus=2, mig=True))
    return m.description(), build(str(m.root), proc=str(m.proc)), host_proc(str(m.proc))


def plan(machine, env, allowed):
    truth, inv, hp = machine
    cfg = Config(allowed_devices=allowed)
    request = request_from_env(env, cfg, privileged=False)
    return build_plan(request, inv, DEBIAN, hp, options_from_config(cfg), rootfs="/rootfs", pid=42)


# --- config ---

def test_config_default_allows_everything():
    assert Config().allowed_devices is None
    assert parse("").allowed_devices is None


@pytest.mark.parametrize("text,expected", [
    ('allowed-devices = ["1"]', ("1",)),
    ('allowed-devices = "1, GPU-abc,0000:0f:00.0"', ("1", "GPU-abc", "0000:0f:00.0")),
    ('allowed-devices = ["0:1", "MIG-GPU-abc/1/0", "1", "1"]', ("0:1", "MIG-GPU-abc/1/0", "1")),
    ('allowed-devices = []', ()),
    ('allowed-devices = ["1", "all"]', None),
])
def test_config_parses_device_tokens(text, expected):
    assert parse(text).allowed_devices == expected


@pytest.mark.parametrize("text", [
    'allowed-devices = 1',
    'allowed-devices = [1]',
    'allowed-devices = ["nvidia.com/gpu=1"]',
    'allowed-devices = ["-1"]',
    'allowed-devices = ["0 1"]',
    f'allowed-devices = "{",".join(["1"] * 1025)}"',
])
def test_config_rejects_what_is_not_a_device_token(text):
    with pytest.raises(NvcError) as err:
        parse(text)
    assert err.value.category == "config"
    assert "allowed-devices" in err.value.detail


# --- resolution and selection ---

def test_gpu_tokens_of_every_form_name_the_same_gpu(mig):
    truth, inv, _ = mig
    g1 = truth["gpus"][1]
    for token in ("1", g1["uuid"], g1["uuid"][:10].lower(), g1["bus_id"], g1["proc_bus_id"]):
        allow = allow_list(inv, (token,))
        assert allow.gpus == {1} and allow.migs == frozenset() and allow.unknown == ()


def test_a_gpu_allows_its_mig_devices_and_a_mig_device_only_itself(mig):
    truth, inv, _ = mig
    whole = allow_list(inv, ("0",))
    assert whole.migs == {(0, m["index"]) for m in truth["gpus"][0]["migs"]}
    one = allow_list(inv, (truth["gpus"][0]["migs"][1]["uuid"],))
    assert one.gpus == frozenset() and one.migs == {(0, 1)}


def test_unknown_entries_allow_nothing_and_are_reported(mig):
    _, inv, _ = mig
    allow = allow_list(inv, ("7", "GPU-ffff"))
    assert allow.gpus == frozenset() and allow.migs == frozenset()
    assert allow.unknown == ("7", "GPU-ffff")
    assert allow_list(inv, None) is None and allow_list(inv, ("all",)) is None


def test_selection_outside_the_allow_list_is_refused_naming_the_token(mig):
    truth, inv, _ = mig
    allow = allow_list(inv, ("1",))
    for token in ("0", truth["gpus"][0]["uuid"], "0:1"):
        with pytest.raises(NvcError) as err:
            select(inv, ["1", token], allow)
        assert err.value.line() == f"nvcontainer: device error: {token}: not allowed on this node (allowed-devices)"
    assert [g.uuid for g in select(inv, ["1"], allow).gpus] == [truth["gpus"][1]["uuid"]]


def test_all_is_every_allowed_device(mig):
    truth, inv, _ = mig
    sel = select(inv, ["all"], allow_list(inv, ("1",)))
    assert [g.index for g in sel.gpus] == [1] and sel.migs == ()
    mig1 = truth["gpus"][0]["migs"][1]
    sel = select(inv, ["all"], allow_list(inv, (mig1["uuid"], "1")))
    assert [g.index for g in sel.gpus] == [0, 1]          # a MIG device brings its parent, as a request does
    assert [m.uuid for m in sel.migs] == [mig1["uuid"]]
    everything = select(inv, ["all"])
    assert len(everything.gpus) == 2 and len(everything.migs) == len(truth["gpus"][0]["migs"])


def test_held_back(mig):
    truth, inv, _ = mig
    held = held_back(inv, allow_list(inv, ("1",)))
    assert [g.index for g in held.gpus] == [0] and held.migs == ()
    mig0 = truth["gpus"][0]["migs"][0]
    held = held_back(inv, allow_list(inv, ("0:1",)))
    assert [g.index for g in held.gpus] == [1]
    assert [m.uuid for m in held.migs] == [mig0["uuid"]]
    assert held_back(inv, None) == held_back(inv, allow_list(inv, ("all",)))
    assert held_back(inv, None).gpus == ()


# --- the plan ---

def gpu_nodes(p):
    return sorted(d.path for d in p.devices if d.path.startswith("/dev/nvidia") and d.path[11:].isdigit())


def test_plan_all_gives_only_the_allowed_gpu(mig):
    p = plan(mig, {"NVIDIA_VISIBLE_DEVICES": "all"}, ("1",))
    assert gpu_nodes(p) == ["/dev/nvidia1"]
    assert "c 195:0 rw" not in p.cgroup_rules and "c 195:1 rw" in p.cgroup_rules


def test_plan_refuses_a_gpu_outside_the_list(mig):
    with pytest.raises(NvcError) as err:
        plan(mig, {"NVIDIA_VISIBLE_DEVICES": "0,1"}, ("1",))
    assert err.value.line("nvcontainer-hook") == \
        "nvcontainer-hook: device error: 0: not allowed on this node (allowed-devices)"


def test_plan_without_the_key_is_unchanged(mig):
    unrestricted = plan(mig, {"NVIDIA_VISIBLE_DEVICES": "all"}, None)
    assert gpu_nodes(unrestricted) == ["/dev/nvidia0", "/dev/nvidia1"]


def test_plan_warns_about_entries_that_match_nothing(mig):
    p = plan(mig, {"NVIDIA_VISIBLE_DEVICES": "1"}, ("1", "GPU-0000dead"))
    assert gpu_nodes(p) == ["/dev/nvidia1"]
    assert "allowed-devices: GPU-0000dead matches no device on this node" in p.warnings


def test_mig_config_needs_gpus_allowed_whole(mig):
    truth, inv, hp = mig
    request = request_from_options(devices=["all"], mig_config="all")
    cfg = Config(allowed_devices=("0:1",))
    with pytest.raises(NvcError) as err:
        build_plan(request, inv, DEBIAN, hp, options_from_config(cfg), rootfs="/rootfs", pid=42)
    assert err.value.category == "mig-config" and "GPU 0" in err.value.detail
    ok = build_plan(request, inv, DEBIAN, hp, options_from_config(Config(allowed_devices=("0",))),
                    rootfs="/rootfs", pid=42)
    assert gpu_nodes(ok) == ["/dev/nvidia0"]


# --- info / list JSON ---

def test_info_json_marks_held_back(mig):
    truth, inv, _ = mig
    data = json.loads(views.info_json(inv, allow_list(inv, ("0:0",))))
    assert [g["held_back"] for g in data["gpus"]] == [False, True]
    assert [m["held_back"] for m in data["gpus"][0]["mig_devices"]] == [False, True]
    plain = json.loads(views.info_json(inv))
    assert not any(g["held_back"] for g in plain["gpus"])


def test_list_json_names_held_back_paths(mig):
    truth, inv, _ = mig
    sections = views.list_sections(inv, select(inv, ["all"]), views.ListOptions(devices=True))
    held = views.held_back_paths(held_back(inv, allow_list(inv, ("0:1",))))
    data = json.loads(views.list_json(sections, held))
    assert data["held_back"] == [truth["gpus"][1]["node"]["path"], truth["gpus"][0]["migs"][0]["ci_access"]]
    restricted = views.list_sections(inv, select(inv, ["all"], allow_list(inv, ("1",))), views.ListOptions(devices=True))
    assert truth["gpus"][0]["node"]["path"] not in views.list_text(restricted)
    assert truth["gpus"][1]["node"]["path"] in views.list_text(restricted)


# --- the command line ---

def cli(machine, config, *args):
    from tests.fixtures.fakegpu.runner import run_in_fake_proc

    return run_in_fake_proc(machine, [sys.executable, "-m", "nvcontainer", "--root", str(machine.root),
                                      "--config", str(config), *args], capture_output=True, text=True, timeout=60)


def test_cli_info_and_list_say_what_is_held_back(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=2))
    truth = machine.description()
    config = tmp_path / "config.toml"
    config.write_text(f'allowed-devices = ["{truth["gpus"][1]["uuid"]}"]\n')
    info = cli(machine, config, "--debug", str(tmp_path / "log"), "info")
    assert info.returncode == 0 and info.stderr == ""
    assert truth["gpus"][0]["uuid"] in info.stdout          # upstream's text form: every GPU
    assert f"holds back: GPU 0 ({truth['gpus'][0]['uuid']})" in (tmp_path / "log").read_text()
    data = json.loads(cli(machine, config, "info", "--json").stdout)
    assert [g["held_back"] for g in data["gpus"]] == [True, False]
    listed = cli(machine, config, "list", "--json", "-d", "all")
    assert listed.returncode == 0 and listed.stderr == ""
    sections = json.loads(listed.stdout)
    assert "/dev/nvidia1" in sections["devices"] and "/dev/nvidia0" not in sections["devices"]
    assert sections["held_back"] == ["/dev/nvidia0"]
    refused = cli(machine, config, "list", "-d", "0")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == "nvcontainer: device error: 0: not allowed on this node (allowed-devices)\n"
