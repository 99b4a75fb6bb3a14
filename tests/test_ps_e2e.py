"""``nvcontainer ps`` against real runc containers on the fake machine, cgroup v1 and v2.

One driver script runs in the fake machine's world (so runc, the hook and ``ps`` all see the
fake driver, and, for v2, cgroup2 at /sys/fs/cgroup): it starts two detached containers through
our hook (an explicit NVIDIA_VISIBLE_DEVICES=1 with cgroupsPath /docker/<id>, and a leased
NVIDIA_VISIBLE_DEVICES=free found by runc's state), points the mock NVML's running processes at
their init PIDs, at a host process and at a process that has exited, runs ``ps`` (table,
--json, --gpu), then removes the containers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.fixtures import runtime
from tests.fixtures.fakegpu.runner import fake_proc_command
from tests.fixtures.fakegpu.spec import FakeSpec

MIB = 1 << 20

DRIVER = r"""
import json, os, secrets, subprocess, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.fixtures.fakegpu.build import FakeMachine, set_activity
base, bundles, cfg = Path(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
leases_file = os.path.join(os.path.dirname(cfg), "run", "leases.json")
machine = FakeMachine.load(base)
names = {}
try:
    for key, bundle in bundles.items():
        name = f"nvc-ps-{key}-{secrets.token_hex(4)}"
        err = open(os.path.join(bundle, "..", f"{name}.err"), "w")
        res = subprocess.run(["runc", "run", "-d", "--bundle", bundle, name], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=err, timeout=120)
        if res.returncode:
            sys.exit(f"runc run {key} failed: " + open(err.name).read())
        names[key] = name
    pids = {k: json.loads(subprocess.run(["runc", "state", n], capture_output=True, check=True).stdout)["pid"]
            for k, n in names.items()}
    (lease,) = json.load(open(leases_file))["leases"]
    gone = subprocess.Popen(["true"]); gone.wait()
    set_activity(machine, processes=(
        (1, pids["explicit"], 300 << 20, "compute", 40),
        (lease["indexes"][0], pids["second"], 100 << 20, "compute", 5),
        (0, os.getpid(), 1 << 20, "graphics", 0),
        (0, gone.pid, 7 << 20, "compute", 0),
    ), utilization=((25, 10), (60, 30)))
    def ps(*args):
        r = subprocess.run([sys.executable, "-I", "-m", "nvcontainer", "--root", str(machine.root), "--config", cfg, "ps", *args],
                           capture_output=True, text=True, env={"PYTHONPATH": sys.argv[1], "PATH": os.environ["PATH"]})
        return {"rc": r.returncode, "out": r.stdout, "err": r.stderr}
    print(json.dumps({"pids": pids, "names": names, "lease": lease, "host": os.getpid(), "gone": gone.pid,
                      "json": ps("--json"), "text": ps(), "gpu1": ps("--json", "--gpu", "1"),
                      "bad": ps("--gpu", "7")}))
finally:
    for n in names.values():
        subprocess.run(["runc", "delete", "-f", n], capture_output=True)
"""


def need_tools():
    if not all(map(shutil.which, ("runc", "busybox", "unshare"))):
        pytest.skip("needs runc, busybox and unshare")


@pytest.fixture(scope="module")
def machine(private_machine):
    return private_machine(FakeSpec(gpus=2))


DOCKER_ID = "ab" * 32
GPU_KEYS = {"index", "minor", "uuid", "model", "utilization", "memory_utilization", "containers", "host_processes"}
CONTAINER_KEYS = {"id", "name", "command", "engine", "pid", "how", "running", "evidence", "memory", "processes"}
PROCESS_KEYS = {"pid", "command", "memory", "sm", "kinds"}


def run_driver(machine, tmp_path, cgroup2: bool) -> dict:
    need_tools()
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[nvcontainer]\ncache-dir = "{tmp_path / "run"}"\n')
    hook_args = ("--config", str(cfg), "--socket", "")
    explicit = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=1"], "sleep 600", hook_args=hook_args,
                                   extra_spec=lambda s: s["linux"].update(cgroupsPath=f"/docker/{DOCKER_ID}"))
    second = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=free"], "sleep 600", hook_args=hook_args)
    argv = [sys.executable, "-I", "-c", DRIVER, str(runtime.REPO), str(machine.base),
            json.dumps({"explicit": str(explicit), "second": str(second)}), str(cfg)]
    if cgroup2:
        argv = ["sh", "-c", runtime.CGROUP2_WORLD, "sh", *argv]
    res = subprocess.run(fake_proc_command(machine, argv), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def by_pid(gpu: dict) -> dict:
    return {c["pid"]: c for c in gpu["containers"]}


@pytest.mark.parametrize("cgroup2", [False, True], ids=["cgroup-v1", "cgroup-v2"])
def test_ps_shows_containers_under_their_gpus(machine, tmp_path, cgroup2):
    got = run_driver(machine, tmp_path, cgroup2)
    assert got["json"]["rc"] == 0 and got["json"]["err"] == "", got["json"]["err"]   # quiet, vanished pid included
    view = json.loads(got["json"]["out"])["gpus"]
    pids, names = got["pids"], got["names"]
    gpu0, gpu1 = view
    leased = got["lease"]["indexes"][0]
    assert got["lease"]["container"] == names["second"] and got["lease"]["pid"] == pids["second"]
    assert (gpu0["index"], gpu1["index"]) == (0, 1)
    assert gpu1["uuid"] == machine.description()["gpus"][1]["uuid"]
    assert (gpu0["utilization"], gpu0["memory_utilization"], gpu1["utilization"]) == (25, 10, 60)

    assert all(set(g) == GPU_KEYS for g in view)
    assert all(set(c) == CONTAINER_KEYS for g in view for c in g["containers"])
    assert all(set(p) == PROCESS_KEYS for g in view for c in g["containers"] for p in c["processes"])

    # GPU 1: the explicit request, found by its cgroup and its mount, with its NVML process
    explicit = by_pid(gpu1)[pids["explicit"]]
    assert explicit["pid"] == pids["explicit"]
    assert (explicit["id"], explicit["engine"], explicit["how"]) == (DOCKER_ID, "docker", "request")
    assert {"cgroup", "mount", "process"} <= set(explicit["evidence"])
    assert explicit["memory"] == 300 * MIB
    assert [(p["pid"], p["memory"], p["sm"]) for p in explicit["processes"]] == [(pids["explicit"], 300 * MIB, 40)]

    # its leased GPU: the second container (runc's state names it) by lease
    (second,) = [c for c in view[leased]["containers"] if c["pid"] == pids["second"]]
    assert (second["id"], second["engine"], second["how"], second["running"]) == (names["second"], "runc", "lease", True)
    assert second["memory"] == 100 * MIB and {"cgroup", "mount", "process", "lease"} <= set(second["evidence"])
    # each under its GPU only (the host may run other GPU containers: ps shows every one)
    ours = [(g["index"], c["pid"]) for g in view for c in g["containers"] if c["pid"] in pids.values()]
    assert sorted(ours) == sorted([(1, pids["explicit"]), (leased, pids["second"])])
    # GPU 0: the host's process; the exited one is left out
    assert [p["pid"] for p in gpu0["host_processes"]] == [got["host"]]
    listed = [p["pid"] for g in view for c in g["containers"] for p in c["processes"]]
    assert got["gone"] not in listed + [p["pid"] for g in view for p in g["host_processes"]]

    text = got["text"]["out"]
    assert got["text"]["rc"] == 0
    assert "GPU 1  " in text and DOCKER_ID[:12] in text and "300.0 MiB" in text and names["second"] in text
    assert text.index(DOCKER_ID[:12]) > text.index("GPU 1  ")
    assert text.index(names["second"]) > text.index(f"GPU {leased}  ")

    only = json.loads(got["gpu1"]["out"])["gpus"]
    assert [g["index"] for g in only] == [1] and pids["explicit"] in by_pid(only[0])
    assert got["bad"]["rc"] == 1 and got["bad"]["err"].count("\n") == 1 and "--gpu" in got["bad"]["err"]


PODMAN_SCRIPT = r"""
set -e
podman_argv="$1"; shift
name=$1 rootfs=$2; shift 2
id=$($podman_argv run -d --name "$name" --network none --env NVIDIA_VISIBLE_DEVICES=0 --rootfs "$rootfs" /bin/sleep 600)
trap '$podman_argv rm -t 0 -f "$name" >/dev/null 2>&1' EXIT
echo "ID:$id"
"$@"
"""


def test_podman_container_by_its_engine_id_and_name(machine, tmp_path):
    """podman runs crun with cgroupsPath /libpod_parent/libpod-<id>; its name is in
    containers/storage's containers.json beside the bundle."""
    import os
    import secrets
    import tempfile

    need_tools()
    if not all(map(shutil.which, ("podman", "crun"))):
        pytest.skip("needs podman and crun")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for i, entry in enumerate(runtime.hook_entries(machine)):
        (hooks / f"{i:02d}-hook.json").write_text(json.dumps(
            {"version": "1.0.0", "hook": entry, "when": {"always": True}, "stages": ["prestart"]}))
    (tmp_path / "containers.conf").write_text(runtime.PODMAN_CONF)
    rootfs = runtime.busybox_rootfs(tmp_path / "rootfs")
    runroot = tempfile.mkdtemp(prefix="nvc-pd-")
    podman = " ".join(["podman", "--root", str(tmp_path / "storage"), "--runroot", runroot, "--storage-driver", "vfs",
                       "--cgroup-manager", "cgroupfs", "--hooks-dir", str(hooks)])
    name = f"nvc-ps-{secrets.token_hex(4)}"
    argv = ["sh", "-c", runtime.V1_ONLY_WORLD, "sh", "sh", "-c", PODMAN_SCRIPT, "sh", podman, name, str(rootfs),
            sys.executable, "-I", "-m", "nvcontainer", "--root", str(machine.root), "ps", "--json"]
    env = dict(os.environ, CONTAINERS_CONF=str(tmp_path / "containers.conf"), PYTHONPATH=str(runtime.REPO))
    try:
        res = subprocess.run(fake_proc_command(machine, argv), capture_output=True, text=True, env=env, timeout=300)
    finally:
        shutil.rmtree(runroot, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    container_id = res.stdout.split("ID:", 1)[1].split()[0]
    view = json.loads(res.stdout.split("\n", 1)[1])["gpus"]
    (mine,) = [c for c in view[0]["containers"] if c["id"] == container_id]
    assert (mine["engine"], mine["name"], mine["how"]) == ("podman", name, "request")
    assert {"cgroup", "mount"} <= set(mine["evidence"])
    assert container_id not in json.dumps(view[1])
