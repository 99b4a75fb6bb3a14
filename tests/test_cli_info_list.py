"""``nvcontainer info`` and ``list`` as an operator runs them, against fake GPU machines.

The expected texts are written here from the reference formats (REFERENCE §1.2, §1.3) and the
fixture's own description of what it built, not from nvcontainer's renderers.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import run_in_fake_proc

NVCONTAINER = [sys.executable, "-m", "nvcontainer"]


def run(machine, *args):
    return run_in_fake_proc(machine, [*NVCONTAINER, "--root", str(machine.root), *args],
                            capture_output=True, text=True, timeout=60)


def ok(machine, *args) -> str:
    res = run(machine, *args)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    return res.stdout


def fails(machine, *args) -> str:
    res = run(machine, *args)
    assert res.returncode == 1
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def expected_info_text(truth) -> str:
    def line(label, value):
        return label + ":" + " " * (15 - len(label) - 1) + " " + str(value) + "\n"

    text = line("NVRM version", truth["driver_version"]) + line("CUDA version", truth["cuda_version"])
    for g in truth["gpus"]:
        text += "\n"
        text += line("Device Index", g["index"]) + line("Device Minor", g["minor"]) + line("Model", g["name"])
        text += line("Brand", g["brand"]) + line("GPU UUID", g["uuid"]) + line("Bus Location", g["bus_id"])
        text += line("Architecture", g["arch"])
    return text


def test_info_text_is_upstreams_format(fake_machine):
    out = ok(fake_machine, "info")
    assert out == expected_info_text(fake_machine.description())
    assert out.splitlines()[0] == "NVRM version:   550.54.14"  # value starts at column 17


def test_info_csv_is_upstreams_format(fake_machine):
    truth = fake_machine.description()
    rows = [",".join(str(g[k]) for k in ("index", "minor", "name", "brand", "uuid", "bus_id", "arch"))
            for g in truth["gpus"]]
    expected = (
        "NVRM version,CUDA version\n"
        f"{truth['driver_version']},{truth['cuda_version']}\n"
        "\n"
        "Device Index,Device Minor,Model,Brand,GPU UUID,Bus Location,Architecture\n"
        + "".join(r + "\n" for r in rows)
    )
    assert ok(fake_machine, "info", "--csv") == expected


def test_info_json(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(mig=True))
    data = json.loads(ok(machine, "info", "--json"))
    truth = machine.description()
    assert data["driver_version"] == truth["driver_version"]
    assert [g["uuid"] for g in data["gpus"]] == [g["uuid"] for g in truth["gpus"]]
    assert [m["uuid"] for m in data["gpus"][0]["mig_devices"]] == [m["uuid"] for m in truth["gpus"][0]["migs"]]


def test_info_never_prints_mig_devices(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(mig=True))
    out = ok(machine, "info")
    assert "MIG-" not in out
    assert out == expected_info_text(machine.description())


def control_nodes(truth):
    order = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
    present = {n["path"] for n in truth["device_nodes"]}
    return [p for p in order if p in present]


def test_list_default_is_everything_in_upstream_order(fake_machine):
    truth = fake_machine.description()
    expected = (
        control_nodes(truth)
        + [g["node"]["path"] for g in truth["gpus"]]
        + [b["path"] for b in truth["binaries"]]
        + [lib["path"] for lib in truth["libraries"]]
        + [lib["path"] for lib in truth["libraries32"]]
        + [i["path"] for i in truth["ipcs"]]
        + [f["path"] for f in truth["firmwares"]]
    )
    default = ok(fake_machine, "list")
    assert default.splitlines() == expected
    assert ok(fake_machine, "list", "-d", "all", "-l", "-b", "-i", "-f", "--compat32") == default
    # upstream looks up utility, compute, ngx, video, graphics: NGX closes the compute group
    names = [line.rsplit("/", 1)[1].split(".so")[0] for line in default.splitlines() if "/x86_64-linux-gnu/" in line]
    assert names[names.index("libnvidia-ngx") - 1:names.index("libnvidia-ngx") + 2] == [
        "libnvidia-tileiras", "libnvidia-ngx", "libvdpau_nvidia"]


def test_list_lists_everything_only_without_options(fake_machine):
    """Upstream's rule (its list_parser): the full list with no option at all, or with exactly
    one --imex-channel; any other option, --no-persistenced included, lists only what it asks."""
    truth = fake_machine.description()
    everything = ok(fake_machine, "list").splitlines()
    assert ok(fake_machine, "list", "--no-persistenced") == ""
    assert ok(fake_machine, "list", "--no-persistenced", "--no-fabricmanager", "--no-gsp-firmware") == ""
    assert ok(fake_machine, "list", "--mig-config", "all") == ""   # no device selected
    assert ok(fake_machine, "list", "--no-fabricmanager", "-i").splitlines() == [
        i["path"] for i in truth["ipcs"] if i["name"] != "fabricmanager"]
    channel = "/dev/nvidia-caps-imex-channels/channel0"
    with_channel = ok(fake_machine, "list", "--imex-channel=0").splitlines()
    devices = len(control_nodes(truth)) + len(truth["gpus"])
    assert with_channel == everything[:devices] + [channel] + everything[devices:]
    assert ok(fake_machine, "list", "--imex-channel=0", "--imex-channel=1").splitlines() == [
        channel, "/dev/nvidia-caps-imex-channels/channel1"]
    assert json.loads(ok(fake_machine, "list", "--json"))["libraries"] == [lib["path"] for lib in truth["libraries"]]
    assert ok(fake_machine, "list", "-d", "ALL") == ok(fake_machine, "list", "-d", "all")   # issue 15.8


def test_list_paths_are_relative_to_root(fake_machine):
    out = ok(fake_machine, "list")
    assert str(fake_machine.root) not in out
    assert all(line.startswith("/") for line in out.splitlines())


def test_list_sections(fake_machine):
    truth = fake_machine.description()
    assert ok(fake_machine, "list", "-l").splitlines() == [lib["path"] for lib in truth["libraries"]]
    assert ok(fake_machine, "list", "-l", "--compat32").splitlines() == (
        [lib["path"] for lib in truth["libraries"]] + [lib["path"] for lib in truth["libraries32"]])
    assert ok(fake_machine, "list", "-b").splitlines() == [b["path"] for b in truth["binaries"]]
    assert ok(fake_machine, "list", "-f").splitlines() == [f["path"] for f in truth["firmwares"]]
    assert ok(fake_machine, "list", "-i", "--no-persistenced").splitlines() == [
        i["path"] for i in truth["ipcs"] if i["name"] != "persistenced"]
    assert ok(fake_machine, "list", "-f", "--no-gsp-firmware") == ""


@pytest.mark.parametrize("token_of", [
    lambda g: str(g["index"]),
    lambda g: g["uuid"],
    lambda g: g["uuid"][:12].lower(),
    lambda g: g["bus_id"],
    lambda g: g["proc_bus_id"],
])
def test_list_one_device_by_each_token_form(fake_machine, token_of):
    truth = fake_machine.description()
    second = truth["gpus"][1]
    out = ok(fake_machine, "list", "-d", token_of(second)).splitlines()
    assert out == control_nodes(truth) + [second["node"]["path"]]


def test_list_mig_device(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(mig=True))
    truth = machine.description()
    mig = truth["gpus"][0]["migs"][1]
    # upstream prints both access files, then the nodes behind them (its list_command)
    expected = control_nodes(truth) + [
        truth["gpus"][0]["node"]["path"],
        mig["gi_access"], mig["ci_access"], mig["gi_cap"]["path"], mig["ci_cap"]["path"],
    ]
    assert ok(machine, "list", "-d", mig["uuid"]).splitlines() == expected
    assert ok(machine, "list", "-d", "0:1").splitlines() == expected
    legacy = f"MIG-{truth['gpus'][0]['uuid']}/{mig['gi']}/{mig['ci']}"
    assert ok(machine, "list", "-d", legacy).splitlines() == expected


def test_unknown_device_is_one_line(fake_machine):
    assert fails(fake_machine, "list", "-d", "7") == "nvcontainer: device error: 7: unknown device"
    assert fails(fake_machine, "list", "-d", "0,GPU-nope") == "nvcontainer: device error: GPU-nope: unknown device"
    # str.isdigit() is true for '²', which int() refuses: non-ASCII digits must not crash
    assert fails(fake_machine, "list", "-d", "\u00b2") == "nvcontainer: device error: \u00b2: unknown device"


def test_hostile_device_token_is_escaped(fake_machine):
    line = fails(fake_machine, "list", "-d", "x\x1b[31m\nevil")
    assert "\x1b" not in line and "\\x1b" in line and "\\n" in line


def test_list_mig_config_and_monitor(fake_machine_factory):
    """Upstream's list_command: for mig-config, then mig-monitor, the control file and its node,
    then for each selected MIG-capable GPU its /proc/driver/nvidia/capabilities/gpu<minor>
    directory, /dev/nvidia-caps and every node mig-minors gives that GPU."""
    machine = fake_machine_factory(FakeSpec(mig=True))
    truth = machine.description()
    minors = [line.split() for line in (machine.proc / "driver/nvidia-caps/mig-minors").read_text().splitlines()]
    gpu0 = truth["gpus"][0]
    assert gpu0["mig_capable"] and not truth["gpus"][1]["mig_capable"]
    per_gpu = [f"/proc/driver/nvidia/capabilities/gpu{gpu0['minor']}", "/dev/nvidia-caps"] + [
        f"/dev/nvidia-caps/nvidia-cap{minor}" for name, minor in minors if name.startswith(f"gpu{gpu0['minor']}/")]
    control = truth["mig_control"]
    devices = control_nodes(truth) + [g["node"]["path"] for g in truth["gpus"]]   # no MIG access files
    out = ok(machine, "list", "-d", "all", "--mig-config=all", "--mig-monitor=all").splitlines()
    assert out == (devices + [control["config"], control["config_cap"]["path"]] + per_gpu
                   + [control["monitor"], control["monitor_cap"]["path"]] + per_gpu)
    # a GPU that cannot run MIG brings nothing for it
    assert ok(machine, "list", "-d", "1", "--mig-monitor=all").splitlines() == (
        control_nodes(truth) + [truth["gpus"][1]["node"]["path"]])


def test_mig_config_accepts_only_all(fake_machine):
    assert fails(fake_machine, "list", "--mig-config", "0") == (
        "nvcontainer: mig-config error: only 'all' devices are currently supported")


def test_missing_nvml_error(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(missing=frozenset({"nvml"})))
    line = fails(machine, "info")
    assert line.startswith("nvcontainer: initialization error: load library failed: libnvidia-ml.so.1: ")


def test_driver_not_loaded_error(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(missing=frozenset({"driver"})))
    assert fails(machine, "info").startswith("nvcontainer: initialization error: nvml error: driver not loaded")


def test_missing_root_is_an_initialization_error(fake_machine, tmp_path):
    """upstream's category for a driver root it cannot use (issue 15.11); our text names it."""
    for missing in (tmp_path / "nowhere", fake_machine.root / "etc/ld.so.conf"):
        res = run_in_fake_proc(fake_machine, [*NVCONTAINER, "--root", str(missing), "list"],
                               capture_output=True, text=True, timeout=60)
        assert (res.returncode, res.stdout) == (1, "")
        assert res.stderr == f"nvcontainer: initialization error: driver root {missing}: not a directory\n"


def test_corrupt_ldcache_error(fake_machine, tmp_path):
    bad = fake_machine.root / "etc"
    # a cache file in another root that is truncated: --ldcache is relative to --root
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/ld.so.cache").write_bytes((bad / "ld.so.cache").read_bytes()[:100])
    res = run_in_fake_proc(fake_machine, [*NVCONTAINER, "--root", str(root), "info"],
                           capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr.startswith(f"nvcontainer: ldcache error: {root}/etc/ld.so.cache: ")
    assert len(res.stderr.splitlines()) == 1


def test_usage_errors_are_one_line(fake_machine):
    assert fails(fake_machine, "info", "--bogus").startswith("nvcontainer: input error: ")
    assert fails(fake_machine, "frobnicate").startswith("nvcontainer: input error: ")


def test_debug_log_is_glog_style_and_quiet_otherwise(fake_machine, tmp_path):
    log = tmp_path / "debug.log"
    res = run_in_fake_proc(fake_machine, [*NVCONTAINER, "--root", str(fake_machine.root), "--debug", str(log), "list"],
                           capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr == ""
    lines = log.read_text().splitlines()
    assert lines[0] == "-- WARNING, the following logs are for debugging purposes only --"
    import re
    pattern = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ [\w.]+:\d+\] .+$")
    assert all(pattern.match(line) for line in lines[1:]), lines[1:5]
    assert any("missing compat32 library" in line for line in lines)


def test_user_option_loads_nvml_as_that_user(fake_machine):
    assert ok(fake_machine, "--user=0:0", "info") == ok(fake_machine, "info")
    assert ok(fake_machine, "-u0:0", "info") == ok(fake_machine, "info")
    assert fails(fake_machine, "--user=nosuchuser", "info") == (
        "nvcontainer: input error: invalid user: nosuchuser: unknown user")
    assert fails(fake_machine, "-unosuchuser", "info") == (
        "nvcontainer: input error: invalid user: nosuchuser: unknown user")


@pytest.mark.parametrize("words", [("--user",), ("-u",), ("-nu",), ("-u", "-n"), ("--user", "--no-pivot")])
def test_user_takes_a_value_only_when_attached(fake_machine, words):
    """argp's optional argument (REFERENCE §1.1 ``-u, --user[=UID[:GID]]``): a separate word
    after a bare ``--user`` is the command, as with NVIDIA's cli, not the user."""
    assert ok(fake_machine, *words, "info") == ok(fake_machine, "info")
    assert ok(fake_machine, *words, "list") == ok(fake_machine, "list")
    # the word after a bare --user is the command word, and an unknown one is a usage error
    assert fails(fake_machine, *words, "0:0", "info").startswith("nvcontainer: input error: No such command")


def test_version_and_help():
    res = __import__("subprocess").run([*NVCONTAINER, "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("nvcontainer ")
    res = __import__("subprocess").run([*NVCONTAINER, "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "info" in res.stdout and "list" in res.stdout
