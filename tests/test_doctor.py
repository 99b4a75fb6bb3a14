"""``nvcontainer doctor``: verdicts decided from facts, facts read from fake machines and trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvcontainer.doctor import checks as doctor, gather, registrations
from nvcontainer.cdi.check import Verdict
from nvcontainer.doctor.checks import FAIL, OK, SKIP, WARN, Facts, Node
from tests.fixtures.fakegpu import FakeSpec, run_in_fake_proc

CLI = [sys.executable, "-m", "nvcontainer"]
ROOT = Path(__file__).resolve().parent.parent

HEALTHY = Facts(
    serve_state="listening",
    metrics={"state": "ours", "server": "nvcontainer-metrics", "up": 2, "gpus": 2},
    kernel_version="550.54.14",
    cache_libs={"libnvidia-ml.so.1": ["/usr/lib/libnvidia-ml.so.550.54.14"],
                "libcuda.so.1": ["/usr/lib/libcuda.so.550.54.14"]},
    nvml_version="550.54.14", nvml_gpus=2,
    nodes=(Node("/dev/nvidiactl", (195, 255), ("c", 195, 255)), Node("/dev/nvidia0", (195, 0), ("c", 195, 0))),
    cgroup_v2=True, persistenced=True, cdi_dirs=("/etc/cdi",),
    cdi_verdicts=(Verdict("/etc/cdi/nvidia.yaml", "550.54.14", 5, ()),),
)


def verdicts(facts: Facts) -> dict[str, tuple[str, str, str]]:
    return {c.name: (c.verdict, c.detail, c.fix) for c in doctor.evaluate(facts)}


def with_(**changes) -> Facts:
    return Facts(**{**HEALTHY.__dict__, **changes})


def test_healthy_node_is_all_ok():
    got = verdicts(HEALTHY)
    assert [v for v, _, _ in got.values()] == [OK] * len(got) and len(got) >= 13, got
    assert got["leases"][1] == "no GPU leased (/run/nvcontainer/leases.json)"
    assert got["hooks"][1] == "no hook registered: containers get GPUs through CDI only"


def test_no_driver_fails_and_skips_what_depends_on_it():
    got = verdicts(with_(kernel_version=None, nvml_version=None, nodes=()))
    assert got["driver loaded"][0] == FAIL and "modprobe nvidia" in got["driver loaded"][2]
    assert got["versions match"][0] == SKIP and got["device nodes"][0] == SKIP and got["NVML"][0] == SKIP


def test_library_version_mismatch():
    libs = {**HEALTHY.cache_libs, "libcuda.so.1": ["/usr/lib/libcuda.so.535.104.05"]}
    verdict, detail, fix = verdicts(with_(cache_libs=libs))["versions match"]
    assert verdict == FAIL
    assert detail == ("driver/library version mismatch: kernel module 550.54.14, "
                      "libcuda.so.1 is libcuda.so.535.104.05")
    assert "reboot" in fix


def test_missing_from_the_ld_cache():
    got = verdicts(with_(cache_libs={"libnvidia-ml.so.1": ["/usr/lib/libnvidia-ml.so.550.54.14"]}))
    assert got["ld cache"][:2] == (FAIL, "libcuda.so.1 not in /etc/ld.so.cache")
    assert got["versions match"][0] == SKIP


def test_device_nodes_wrong_numbers_and_missing():
    nodes = (Node("/dev/nvidiactl", (195, 255), ("c", 195, 255)), Node("/dev/nvidia0", (195, 0), ("c", 195, 3)),
             Node("/dev/nvidia1", (195, 1), None))
    verdict, detail, _ = verdicts(with_(nodes=nodes))["device nodes"]
    assert (verdict, detail) == (FAIL, "/dev/nvidia0 is 195:3, expected 195:0")
    verdict, detail, fix = verdicts(with_(nodes=nodes[::2]))["device nodes"]
    assert (verdict, detail) == (FAIL, "missing /dev/nvidia1") and "nvidia-modprobe" in fix


@pytest.mark.parametrize("v1,v2,systemd,verdict", [
    (True, True, True, WARN), (False, True, True, WARN), (True, False, False, OK), (False, True, False, OK),
    (False, False, False, WARN),
])
def test_cgroups(v1, v2, systemd, verdict):
    got = verdicts(with_(cgroup_v1_devices=v1, cgroup_v2=v2, systemd=systemd))["cgroups"]
    assert got[0] == verdict
    if systemd:
        assert "daemon-reload" in got[1] and "cdi generate" in got[2]


def test_persistence_off_is_a_warning():
    assert verdicts(with_(persistenced=False))["persistence"][0] == WARN


def test_persistence_mode_on_every_gpu_serves_without_the_daemon():
    """Seen on a real H100 node: nvidia-smi reports persistence mode Enabled, no daemon runs."""
    verdict, detail, _ = verdicts(with_(persistenced=False, nvml_persistence=(True, True)))["persistence"]
    assert (verdict, detail) == (OK, "persistence mode is on for every GPU (2); nvidia-persistenced is not running")
    verdict, detail, fix = verdicts(with_(persistenced=False, nvml_persistence=(True, False)))["persistence"]
    assert verdict == WARN and detail.startswith("persistence mode is off for GPU 1 and nvidia-persistenced")
    assert fix == "systemctl enable --now nvidia-persistenced"
    assert verdicts(with_(persistenced=False, nvml_persistence=(True, None)))["persistence"][0] == WARN


def test_stale_cdi_spec_fails():
    stale = Verdict("/etc/cdi/old.yaml", "535.104.05", 3, ("made for driver 535.104.05, the running driver is 550.54.14",))
    verdict, detail, fix = verdicts(with_(cdi_verdicts=(*HEALTHY.cdi_verdicts, stale)))["CDI specs"]
    assert verdict == FAIL
    assert detail == "1 of 2 stale: /etc/cdi/old.yaml: made for driver 535.104.05, the running driver is 550.54.14"
    assert fix.startswith("regenerate: nvcontainer cdi generate --output /etc/cdi/old.yaml")


def test_nothing_set_up_and_two_injectors_warn():
    got = verdicts(with_(cdi_verdicts=()))
    assert got["CDI specs"][0] == SKIP and got["hooks"][0] == WARN
    both = (("podman/CRI-O", "nvcontainer hook /usr/bin/nvcontainer-hook", "/etc/containers/oci/hooks.d/a.json"),
            ("docker", "nvidia-container-toolkit runtime 'nvidia' (/usr/bin/nvidia-container-runtime)",
             "/etc/docker/daemon.json"))
    assert verdicts(with_(registrations=both))["hooks"][0] == WARN
    assert verdicts(with_(registrations=both[:1]))["hooks"][0] == OK


def test_registrations_are_read_from_engine_configs(tmp_path):
    hooks = tmp_path / "etc/containers/oci/hooks.d"
    hooks.mkdir(parents=True)
    (hooks / "nvcontainer.json").write_text(json.dumps(
        {"version": "1.0.0", "hook": {"path": "/usr/local/bin/nvcontainer-hook"}, "stages": ["prestart"]}))
    (hooks / "other.json").write_text(json.dumps({"version": "1.0.0", "hook": {"path": "/usr/bin/oci-systemd-hook"}}))
    (hooks / "broken.json").write_text("{")
    (tmp_path / "etc/docker").mkdir()
    (tmp_path / "etc/docker/daemon.json").write_text(json.dumps(
        {"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}, "runsc": {"path": "/usr/bin/runsc"}}}))
    (tmp_path / "etc/containerd").mkdir()
    (tmp_path / "etc/containerd/config.toml").write_text(
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        '  BinaryName = "/usr/bin/nvidia-container-runtime"\n')
    assert registrations.registrations(str(tmp_path)) == [
        ("podman/CRI-O", "nvcontainer hook /usr/local/bin/nvcontainer-hook", "/etc/containers/oci/hooks.d/nvcontainer.json"),
        ("docker", "nvidia-container-toolkit runtime 'nvidia' (/usr/bin/nvidia-container-runtime)", "/etc/docker/daemon.json"),
        ("containerd", "nvidia-container-toolkit runtime handler 'nvidia' (/usr/bin/nvidia-container-runtime)",
         "/etc/containerd/config.toml"),
    ]
    assert registrations.registrations(str(tmp_path / "empty")) == []


def test_a_docker_registration_through_path_alone_is_seen(tmp_path):
    """dockerd's --gpus needs only nvidia-container-runtime-hook on its PATH: that is a registration
    (it used to be missed, and doctor said no engine was set up)."""
    (tmp_path / "opt/nvc/bin").mkdir(parents=True)
    (tmp_path / "opt/nvc/bin/nvcontainer").touch()
    (tmp_path / "usr/local/bin").mkdir(parents=True)
    os.symlink("/opt/nvc/bin/nvidia-container-runtime-hook", tmp_path / "usr/local/bin/nvidia-container-runtime-hook")
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/nvidia-container-cli").write_text("#!/bin/sh\n")   # NVIDIA's, for ctr --gpus
    found = registrations.registrations(str(tmp_path))
    assert found == [("docker --gpus", "nvcontainer nvidia-container-runtime-hook on dockerd's PATH",
                      "/usr/local/bin/nvidia-container-runtime-hook"),
                     ("containerd ctr --gpus", "nvidia-container-toolkit nvidia-container-cli on PATH",
                      "/usr/bin/nvidia-container-cli")]
    got = verdicts(with_(registrations=tuple(found), cdi_verdicts=()))
    assert got["hooks"][0] == WARN and "more than one injector" in got["hooks"][1]
    got = verdicts(with_(registrations=tuple(found[:1]), cdi_verdicts=()))
    assert got["hooks"][0] == OK


def test_node_facts_compare_numbers(fake_machine, tmp_path):
    """The reader side: nodes of the driver's GPUs (from the fake /proc) under a driver root."""
    (tmp_path / "dev").mkdir()
    os.mknod(tmp_path / "dev/nvidiactl", 0o666 | 0o020000, os.makedev(195, 255))
    os.mknod(tmp_path / "dev/nvidia0", 0o666 | 0o020000, os.makedev(195, 9))
    got = {n.path: (n.expected, n.found) for n in gather._node_facts(str(tmp_path), str(fake_machine.proc))}
    assert got[f"{tmp_path}/dev/nvidiactl"] == ((195, 255), ("c", 195, 255))
    assert got[f"{tmp_path}/dev/nvidia0"] == ((195, 0), ("c", 195, 9))
    assert got[f"{tmp_path}/dev/nvidia1"] == ((195, 1), None)
    uvm = fake_machine.description()["majors"]["uvm"]
    assert got[f"{tmp_path}/dev/nvidia-uvm"] == ((uvm, 0), None)


def run_doctor(machine, *args):
    return run_in_fake_proc(machine, [*CLI, "--root", str(machine.root), "doctor", *args],
                            capture_output=True, text=True, timeout=120)


def test_doctor_on_a_healthy_fake_machine(fake_machine, tmp_path):
    res = run_doctor(fake_machine, "--json", "--spec-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    report = {c["name"]: c for c in json.loads(res.stdout)}
    assert list(report) == ["driver loaded", "ld cache", "versions match", "NVML", "device nodes", "cgroups",
                            "ldconfig", "persistence", "CDI specs", "hooks", "hook server", "leases", "metrics",
                            "configuration"]
    for name in ("driver loaded", "ld cache", "versions match", "NVML", "device nodes", "ldconfig", "persistence"):
        assert report[name]["verdict"] == OK, report[name]
    assert report["NVML"]["detail"] == "driver 550.54.14, 2 GPU(s)"
    assert report["ldconfig"]["detail"] == "/sbin/ldconfig: a static binary, run sealed in each container"
    assert report["device nodes"]["detail"] == "5 present with the driver's numbers"
    assert report["CDI specs"]["verdict"] == SKIP
    text = run_doctor(fake_machine, "--spec-dir", str(tmp_path)).stdout
    assert text.splitlines()[0].split() == ["ok", "driver", "loaded", "kernel", "module", "550.54.14"]


def test_doctor_reads_each_gpu_s_persistence_mode_from_nvml(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=2, missing={"persistenced"}))
    report = {c["name"]: c for c in json.loads(run_doctor(machine, "--json", "--spec-dir", str(tmp_path)).stdout)}
    assert report["persistence"]["verdict"] == OK, report["persistence"]
    assert report["persistence"]["detail"].startswith("persistence mode is on for every GPU (2)")
    machine.nvml_config.write_text(machine.nvml_config.read_text().replace("gpu1.persistence=1", "gpu1.persistence=0"))
    report = {c["name"]: c for c in json.loads(run_doctor(machine, "--json", "--spec-dir", str(tmp_path)).stdout)}
    assert report["persistence"]["verdict"] == WARN
    assert report["persistence"]["detail"].startswith("persistence mode is off for GPU 1 and")


def test_doctor_reports_a_spec_for_another_driver(fake_machine_factory, fake_machine, tmp_path):
    old = fake_machine_factory(FakeSpec(gpus=1, driver_version="535.104.05"))
    made = run_in_fake_proc(old, [*CLI, "--root", str(old.root), "cdi", "generate", "-o", str(tmp_path / "old.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    res = run_doctor(fake_machine, "--spec-dir", str(tmp_path))
    assert res.returncode == 1
    line = next(line for line in res.stdout.splitlines() if "CDI specs" in line)
    assert line.split(None, 3)[0] == FAIL
    assert f"1 of 1 stale: {tmp_path}/old.yaml: made for driver 535.104.05, the running driver is 550.54.14" in line
    assert res.stderr == "nvcontainer: doctor error: 1 check(s) failed: CDI specs\n"


def test_doctor_without_a_driver(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=1, missing=frozenset({"driver"})))
    res = run_doctor(machine, "--json", "--spec-dir", str(tmp_path))
    assert res.returncode == 1
    report = {c["name"]: c["verdict"] for c in json.loads(res.stdout)}
    assert report["driver loaded"] == FAIL
    assert report["versions match"] == report["NVML"] == report["device nodes"] == SKIP


def test_doctor_options_are_documented():
    out = subprocess.run([*CLI, "doctor", "--help"], capture_output=True, text=True, check=True, timeout=60).stdout
    page = (ROOT / "man" / "nvcontainer-doctor.1").read_text()
    for option in ("--json", "--spec-dir"):
        assert option in out and option.replace("-", "\\-") in page
    for check in doctor.evaluate(HEALTHY):
        assert f".B {check.name}" in page, f"check {check.name!r} is not described in man/nvcontainer-doctor.1"


def test_configuration_reports_inert_keys_and_two_files():
    assert verdicts(with_(config_lines=("configuration: /etc/x.toml",)))["configuration"] == \
        (OK, "configuration: /etc/x.toml", "")
    verdict, detail, fix = verdicts(with_(config_lines=(
        "configuration: /etc/nvcontainer/config.toml", "both ... exist: /etc/nvcontainer/config.toml is read",
        "/etc/nvcontainer/config.toml: nvidia-ctk.path = \"x\": no effect here (why)")))["configuration"]
    assert verdict == WARN and "nvidia-ctk.path" in detail and "is read" in detail and "remove the keys" in fix


def test_hook_server_states():
    assert verdicts(with_(serve_state="listening"))["hook server"][0] == OK
    absent = verdicts(with_(serve_state="absent"))["hook server"]
    assert absent[0] == SKIP and "enables nvcontainer-serve.socket" in absent[2]
    client = ("podman/CRI-O", "nvcontainer hook /opt/nvc/bin/python (client of nvcontainer serve)", "/etc/x.json")
    waiting = verdicts(with_(serve_state="absent", registrations=(client,)))["hook server"]
    assert waiting[0] == WARN and "none listens" in waiting[1] and "enable --now nvcontainer-serve.socket" in waiting[2]
    runtime = ("docker", "nvcontainer runtime 'nvidia' (/usr/lib/nvcontainer/bin/nvidia-container-runtime)", "/x")
    assert verdicts(with_(serve_state="absent", registrations=(runtime,)))["hook server"][0] == WARN
    assert verdicts(with_(serve_state="stale"))["hook server"][0] == WARN


def test_hook_server_is_probed(tmp_path):
    import socket

    path = tmp_path / "hook.sock"
    assert gather.serve_state(str(path)) == "absent"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(str(path))
    server.listen(1)
    assert gather.serve_state(str(path)) == "listening"
    server.close()
    assert gather.serve_state(str(path)) == "stale"
    path.unlink()
    path.write_text("")
    assert gather.serve_state(str(path)) == "absent"


def test_a_script_for_ldconfig_fails(fake_machine, tmp_path):
    """The default as on Ubuntu without the binary beside the script (or a configuration that
    names a script): the hook's own check, so doctor says what every GPU start would meet."""
    script = tmp_path / "ldconfig"
    script.write_text('#!/bin/sh\nexec /sbin/ldconfig.real "$@"\n')
    script.chmod(0o755)
    config = tmp_path / "config.toml"
    config.write_text(f'ldconfig = "@{script}"\n')
    res = run_in_fake_proc(fake_machine, [*CLI, "--root", str(fake_machine.root), "--config", str(config), "doctor",
                                          "--json", "--spec-dir", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    check = next(c for c in json.loads(res.stdout) if c["name"] == "ldconfig")
    assert check["verdict"] == FAIL
    assert check["detail"].startswith(f"{script}: not an ELF file: every GPU container would be refused")
    assert 'set ldconfig = "@PATH"' in check["fix"]
    assert res.stderr == "nvcontainer: doctor error: 1 check(s) failed: ldconfig\n"


def test_the_metrics_exporter():
    assert verdicts(HEALTHY)["metrics"] == (OK, "nvcontainer metrics answers on :9400 (2 GPU(s))", "")
    lost = verdicts(with_(metrics={"state": "ours", "up": 1, "gpus": 2}))["metrics"]
    assert lost[0] == WARN and "1 of 2 GPU(s)" in lost[1]
    assert verdicts(with_(metrics={"state": "other", "server": "dcgm-exporter"}))["metrics"][0] == OK
    absent = verdicts(with_(metrics={"state": "absent"}))["metrics"]
    assert absent[0] == SKIP and "nvcontainer-metrics" in absent[2]
