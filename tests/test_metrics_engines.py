"""Two containers sharing one GPU, under dockerd and under podman, get separate per-container
memory series from ``nvcontainer metrics``: what a time-sliced GPU needs and dcgm-exporter
cannot give.

Each engine runs in the fake machine's world (private mount and PID namespaces); two containers
sleep there, the mock NVML is told that a process in each uses GPU 0 (different amounts), and the
exporter, started in that same world, is scraped once.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.fixtures import dockerd, runtime
from tests.fixtures.fakegpu.runner import fake_proc_command
from tests.fixtures.fakegpu.spec import FakeSpec

MIB = 1 << 20

# argv: repo, machine base, work dir, engine, then "name=pid" pairs. Points the mock NVML at the
# pids, runs the exporter in this world, prints one scrape's per-container memory series as JSON.
SCRAPE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.fixtures.exporter import Exporter, series
from tests.fixtures.fakegpu.build import FakeMachine
from tests.fixtures.fakegpu.readings import set_readings
machine = FakeMachine.load(Path(sys.argv[2]))
pids = dict(pair.split("=") for pair in sys.argv[5:])
used = {name: (i + 1) * 100 << 20 for i, name in enumerate(sorted(pids))}
set_readings(machine, {0: {"temp": 50}}, processes=tuple((0, int(pid), used[name], "compute", 10) for name, pid in pids.items()))
exp = Exporter(machine, Path(sys.argv[3]))
try:
    text = exp.wait()
    print("RESULT " + json.dumps({"used": used, "pids": pids,
                                   "memory": series(text, "nvcontainer_container_gpu_memory_bytes"),
                                   "procs": series(text, "nvcontainer_container_gpu_processes"),
                                   "stderr": exp.stderr()}))
finally:
    exp.stop()
"""

DOCKER = r"""
set -e
repo=$1 machine=$2 base=$3 daemon=$4 a=$5 b=$6
mount -t tmpfs -o mode=755 nvc-run /run
mkdir -p "$base/lib-upper" "$base/lib-work"
mount -t overlay nvc-lib -o "lowerdir=/var/lib,upperdir=$base/lib-upper,workdir=$base/lib-work" /var/lib
mkdir -p /var/lib/docker
""" + dockerd.START.replace('--data-root "$base/data"', "--data-root /var/lib/docker") + r"""
docker() { command docker -H "unix://$base/d.sock" "$@"; }
trap 'kill $daemon_pid; wait $daemon_pid 2>/dev/null' EXIT
docker import "$base/image.tar" nvc/busybox:test > /dev/null
docker run -d --name "$a" --network none nvc/busybox:test sleep 300 > /dev/null
docker run -d --name "$b" --network none nvc/busybox:test sleep 300 > /dev/null
pa=$(docker inspect -f '{{.State.Pid}}' "$a"); pb=$(docker inspect -f '{{.State.Pid}}' "$b")
"$NVC_PYTHON" -I -c "$SCRAPE" "$repo" "$machine" "$base" docker "$a=$pa" "$b=$pb"
docker rm -f "$a" "$b" > /dev/null
"""

PODMAN = r"""
set -e
podman_argv=$1 rootfs=$2 repo=$3 machine=$4 base=$5 a=$6 b=$7
$podman_argv run -d --name "$a" --network none --rootfs "$rootfs" /bin/sleep 300 > /dev/null
trap '$podman_argv rm -t 0 -f "$a" "$b" >/dev/null 2>&1' EXIT
$podman_argv run -d --name "$b" --network none --rootfs "$rootfs" /bin/sleep 300 > /dev/null
pa=$($podman_argv inspect -f '{{.State.Pid}}' "$a"); pb=$($podman_argv inspect -f '{{.State.Pid}}' "$b")
"$NVC_PYTHON" -I -c "$SCRAPE" "$repo" "$machine" "$base" podman "$a=$pa" "$b=$pb"
"""


@pytest.fixture(scope="module")
def machine(private_machine):
    return private_machine(FakeSpec(gpus=2))


def check(res: subprocess.CompletedProcess, engine: str) -> None:
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    got = json.loads(line[7:])
    mine = {labels["container_name"]: (labels, value) for labels, value in got["memory"]
            if labels["container_name"] in got["pids"]}
    assert set(mine) == set(got["pids"]), got
    for name, (labels, value) in mine.items():
        assert value == got["used"][name]
        assert labels["gpu"] == "0" and labels["engine"] == engine and len(labels["container_id"]) == 64
    assert len({labels["container_id"] for labels, _ in mine.values()}) == 2
    procs = {labels["container_name"]: value for labels, value in got["procs"]}
    assert all(procs[name] == 1 for name in got["pids"])
    assert "Traceback" not in got["stderr"]


def test_dockerd_two_containers_on_one_gpu(machine, tmp_path):
    if not all(map(shutil.which, ("dockerd", "docker", "runc", "unshare"))):
        pytest.skip("needs dockerd, docker, runc")
    base = dockerd.prepare(tmp_path / "d")
    (base / "daemon.json").write_text("{}\n")
    a, b = (f"nvc-m-{secrets.token_hex(3)}" for _ in range(2))
    inner = ["sh", "-c", DOCKER, "sh", str(runtime.REPO), str(machine.base), str(base), str(base / "daemon.json"),
             a, b]
    outer = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private", "--",
             *fake_proc_command(machine, inner)]
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "NVC_PYTHON": sys.executable,
           "HOME": str(base), "SCRAPE": SCRAPE}
    res = subprocess.run(outer, capture_output=True, text=True, timeout=300, env=env)
    if res.returncode != 0:
        print(dockerd.log(base))
    check(res, "docker")


def test_podman_two_containers_on_one_gpu(machine, tmp_path):
    if not all(map(shutil.which, ("podman", "crun", "unshare"))):
        pytest.skip("needs podman and crun")
    (tmp_path / "containers.conf").write_text(runtime.PODMAN_CONF)
    rootfs = runtime.busybox_rootfs(tmp_path / "rootfs")
    runroot = tempfile.mkdtemp(prefix="nvc-pm-")
    podman = " ".join(["podman", "--root", str(tmp_path / "storage"), "--runroot", runroot, "--storage-driver", "vfs",
                       "--cgroup-manager", "cgroupfs"])
    a, b = (f"nvc-m-{secrets.token_hex(3)}" for _ in range(2))
    argv = ["sh", "-c", runtime.V1_ONLY_WORLD, "sh", "sh", "-c", PODMAN, "sh", podman, str(rootfs),
            str(runtime.REPO), str(machine.base), str(tmp_path), a, b]
    env = dict(os.environ, CONTAINERS_CONF=str(tmp_path / "containers.conf"), NVC_PYTHON=sys.executable,
               SCRAPE=SCRAPE)
    try:
        res = subprocess.run(fake_proc_command(machine, argv), capture_output=True, text=True, env=env, timeout=300)
    finally:
        shutil.rmtree(runroot, ignore_errors=True)
    check(res, "podman")
