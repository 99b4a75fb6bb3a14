"""MPS sharing end to end on the 2-GPU fake machine: ``nvcontainer mps-daemon`` runs the fake
driver's ``nvidia-cuda-mps-control`` (a stand-in that records what it is told, see
tests/fixtures/fakegpu/mps_control.c), the plugin serves the tests' fake kubelet, and an
Allocate response is applied to a runc bundle with our hook.

What is checked comes from the machine's description and the stand-in's record, not from the
code under test: 4 devices per GPU with ``replicas = 4``, Healthy only while that GPU's daemon is
up; the daemon's clean environment and the limits it was told; a container that gets the pipe
directory, ``/dev/shm`` and the limits, and reaches the daemon through the pipe; the faults
(a daemon that never starts, one that dies, replicas that do not divide the memory, MIG)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import fake_proc_command
from tests.fixtures.kubelet import Watch, plugin_config
from tests.test_deviceplugin_server import MIG_MIXED2, serving
from tests.test_orchestrators import run

REPO = Path(__file__).resolve().parent.parent
A100, T4 = 81920, 15360                      # the fake machine's GPU 0 and 1 (spec.MEMORY_MIB)
THREADS_25 = "set_default_active_thread_percentage 25"


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


class MpsDaemon:
    """``nvcontainer mps-daemon`` in the fake machine's world."""

    def __init__(self, machine, tmp_path: Path, table: dict, args=("--interval", "0.2")):
        self.machine = machine
        self.root = tmp_path / "mps"
        config = plugin_config(tmp_path / "mps-config.toml", tmp_path / "mps-cache",
                               {"sharing": "mps", "mps-root": str(self.root), **table})
        argv = [sys.executable, "-m", "nvcontainer", "--root", str(machine.root), "--config", str(config),
                "--debug", str(tmp_path / "mps-debug.log"), "mps-daemon", *args]
        self.stderr_path = tmp_path / "mps-daemon.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(fake_proc_command(machine, argv), stdout=subprocess.DEVNULL,
                                     stderr=self._stderr, cwd=REPO)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_for(self, text: str, count: int = 1, timeout: float = 30) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            out = self.stderr()
            if out.count(text) >= count:
                return out
            if self.proc.poll() is not None:
                raise AssertionError(f"mps-daemon exited ({self.proc.returncode}): {out}")
            time.sleep(0.05)
        raise AssertionError(f"{text!r} (x{count}) not in mps-daemon's stderr: {self.stderr()}")

    def directory(self, gpu: int) -> Path:
        return self.root / "nvidia.com/gpu" / self.machine.description()["gpus"][gpu]["uuid"]

    def daemon_pid(self, gpu: int) -> int:
        return int((self.directory(gpu) / "pipe/nvidia-cuda-mps-control.pid").read_text())

    def stop(self, timeout: float = 30) -> int:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self._stderr.close()
            assert "Traceback" not in self.stderr(), self.stderr()


def record(machine) -> list[tuple[str, int, str]]:
    """The stand-in's record: (kind, daemon pid, text) per line."""
    out = []
    for line in machine.mps_record.read_text().splitlines():
        kind, pid, text = (line.split(" ", 2) + [""])[:3]
        out.append((kind, int(pid), text))
    return out


def told(machine, pid: int, until=lambda got: True, timeout: float = 10) -> list[str]:
    """The commands daemon ``pid`` recorded, once ``until`` holds for them (the stand-in's client
    returns when its line is in the pipe; the daemon records it a moment later)."""
    end = time.monotonic() + timeout
    while True:
        got = [text for kind, p, text in record(machine) if kind == "command" and p == pid]
        if until(got) or time.monotonic() > end:
            return got
        time.sleep(0.05)


def shm_seen(machine, pid: int) -> tuple[int, int]:
    """(device, inode) of the /dev/shm daemon ``pid`` saw."""
    [text] = [t for kind, p, t in record(machine) if kind == "shm" and p == pid]
    dev, ino = text.split(":")
    return int(dev), int(ino)


def has(command: str):
    return lambda got: command in got


@pytest.fixture
def fresh_record(machine):
    for path in (machine.mps_record, Path(f"{machine.mps_record}.state")):
        if path.exists():
            path.unlink()
    yield machine.mps_record
    Path(f"{machine.mps_record}.state").unlink(missing_ok=True)


def uuids(machine) -> list[str]:
    return [g["uuid"] for g in machine.description()["gpus"]]


def health_of(devices: dict) -> dict[str, set[str]]:
    """GPU UUID → the health values of its replicas, from a :class:`Watch` list."""
    out: dict[str, set[str]] = {}
    for device_id, (health, _) in devices.items():
        out.setdefault(device_id.split("::")[0], set()).add(health)
    return out


def all_are(health: str):
    return lambda devices: bool(devices) and all(h == health for h, _ in devices.values())


def test_daemon_told_its_limits_in_a_clean_environment_and_cleans_up(machine, tmp_path, fresh_record):
    daemon = MpsDaemon(machine, tmp_path, {"replicas": 4})
    try:
        daemon.wait_for("ready", count=2)
        for gpu, memory in ((0, A100), (1, T4)):
            pid = daemon.daemon_pid(gpu)
            env = dict(text.split("=", 1) for kind, p, text in record(machine) if kind == "env" and p == pid)
            pipe = str(daemon.directory(gpu) / "pipe")
            assert env == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CUDA_MPS_PIPE_DIRECTORY": pipe,
                           "CUDA_MPS_LOG_DIRECTORY": str(daemon.directory(gpu) / "log"),
                           "CUDA_VISIBLE_DEVICES": uuids(machine)[gpu]}
            assert told(machine, pid, has(THREADS_25))[:2] == [f"set_default_device_pinned_mem_limit 0 {memory // 4}M",
                                                               THREADS_25]
            assert (daemon.directory(gpu) / ".ready").is_file()
            assert (daemon.directory(gpu) / "log/control.log").is_file()
        # a daemon that dies is started again, and told its limits again
        dead = daemon.daemon_pid(0)
        os.kill(dead, signal.SIGKILL)
        out = daemon.wait_for("ready", count=3)
        assert out.count("stopped answering") == 1 and "GPU 0" in out.split("stopped answering")[0].splitlines()[-1]
        assert daemon.daemon_pid(0) != dead
        assert told(machine, daemon.daemon_pid(0), has(THREADS_25))[:2] == [
            f"set_default_device_pinned_mem_limit 0 {A100 // 4}M", THREADS_25]
        pids = [daemon.daemon_pid(0), daemon.daemon_pid(1)]
    finally:
        assert daemon.stop() == 0
    assert [told(machine, pid, has("quit"))[-1] for pid in pids] == ["quit", "quit"]
    assert sorted(p for kind, p, _ in record(machine) if kind == "quit") == sorted(pids)
    assert sorted(os.listdir(daemon.root)) == []               # the per-GPU directories are gone
    assert "stopped" in daemon.stderr()


def test_cuda13_control_socket_is_a_ready_daemon(machine, tmp_path, fresh_record):
    """CUDA 13's nvidia-cuda-mps-control serves a Unix socket named ``control``, not a named pipe
    (seen on a real H200, docs/real-gpu.md): the daemon is ready, its replicas healthy, and it is
    told to quit at the end, as with a pipe."""
    Path(f"{machine.mps_record}.state").write_text("socket\n")
    daemon = MpsDaemon(machine, tmp_path, {"replicas": 2})
    try:
        daemon.wait_for("ready", count=2)
        assert stat.S_ISSOCK(os.lstat(daemon.directory(0) / "pipe" / "control").st_mode)
        table = {"sharing": "mps", "replicas": 2, "mps-root": str(daemon.root)}
        with serving(machine, tmp_path, table) as (kubelet, plugin):
            (reg,) = kubelet.wait_registered(1)
            watch = Watch(kubelet.plugin(reg.endpoint))
            try:
                assert sorted(watch.until(all_are("Healthy"))) == sorted(
                    f"{u}::{k}" for u in uuids(machine) for k in range(2))
            finally:
                watch.cancel()
        pids = [daemon.daemon_pid(0), daemon.daemon_pid(1)]
    finally:
        assert daemon.stop() == 0
    assert [told(machine, pid, has("quit"))[-1] for pid in pids] == ["quit", "quit"]
    assert "did not start" not in daemon.stderr()


def test_four_replicas_per_gpu_healthy_only_while_the_daemon_is_up(machine, tmp_path, fresh_record):
    daemon = MpsDaemon(machine, tmp_path, {"replicas": 4})
    try:
        daemon.wait_for("ready", count=2)
        table = {"sharing": "mps", "replicas": 4, "mps-root": str(daemon.root)}
        with serving(machine, tmp_path, table) as (kubelet, plugin):
            (reg,) = kubelet.wait_registered(1)
            assert reg.resource_name == "nvidia.com/gpu"
            watch = Watch(kubelet.plugin(reg.endpoint))
            try:
                first = watch.until(all_are("Healthy"))
                assert sorted(first) == sorted(
                    f"{u}::{k}" for u in uuids(machine) for k in range(4))
                # GPU 1's daemon dies (and cannot be started again for now): its four replicas
                # go Unhealthy, GPU 0's stay Healthy
                Path(f"{machine.mps_record}.state").write_text("fail_start\n")
                os.kill(daemon.daemon_pid(1), signal.SIGKILL)
                down = watch.until(lambda m: health_of(m)[uuids(machine)[1]] == {"Unhealthy"})
                assert health_of(down)[uuids(machine)[0]] == {"Healthy"}
                daemon.wait_for("stopped answering")
                daemon.wait_for("did not start")
                # ... once it can, the mps-daemon starts it again: Healthy again
                Path(f"{machine.mps_record}.state").unlink()
                watch.until(all_are("Healthy"))
                daemon.wait_for("ready", count=3)
            finally:
                watch.cancel()
            plugin.wait_for("replicas unhealthy")
            plugin.wait_for("replicas healthy")
    finally:
        assert daemon.stop() == 0


MPS_CHECKS = r"""
echo "PIPE:$CUDA_MPS_PIPE_DIRECTORY"
echo "THREADS:$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
echo "MEMORY:$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
echo "VISIBLE:$NVIDIA_VISIBLE_DEVICES"
echo "CONTROL:$(test -p "$CUDA_MPS_PIPE_DIRECTORY/control" && echo fifo)"
echo "SHM:$(touch /dev/shm/from-container && echo written)"
echo "get_server_list" > "$CUDA_MPS_PIPE_DIRECTORY/control" && echo "SENT:yes"
"""


@pytest.mark.parametrize("gpu", [0, 1])
def test_allocate_applied_to_a_runc_bundle_reaches_the_daemon(machine, tmp_path, fresh_record, gpu):
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    daemon = MpsDaemon(machine, tmp_path, {"replicas": 4})
    try:
        daemon.wait_for("ready", count=2)
        (tmp_path / "plugin").mkdir()
        table = {"sharing": "mps", "replicas": 4, "mps-root": str(daemon.root), "device-list-strategy": ["envvar"]}
        with serving(machine, tmp_path / "plugin", table) as (kubelet, _):
            (reg,) = kubelet.wait_registered(1)
            watch = Watch(kubelet.plugin(reg.endpoint))
            try:
                watch.until(all_are("Healthy"))
            finally:
                watch.cancel()
            got = kubelet.plugin(reg.endpoint).Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[f"{uuids(machine)[gpu]}::2"])]))
        (response,) = got.container_responses

        def apply(spec):
            for m in response.mounts:
                spec["mounts"].append({"destination": m.container_path, "type": "bind", "source": m.host_path,
                                       "options": ["rbind", "ro" if m.read_only else "rw"]})

        env = [f"{k}={v}" for k, v in response.envs.items()]
        _, res = run(machine, tmp_path, env, extra_spec=apply, script=MPS_CHECKS)
        assert res.returncode == 0, res.stderr
        lines = dict(line.split(":", 1) for line in res.stdout.splitlines() if ":" in line)
        memory = (A100, T4)[gpu] // 4
        assert lines == {"PIPE": "/mps/nvidia.com/gpu/pipe", "THREADS": "25", "MEMORY": f"0={memory}M",
                         "VISIBLE": uuids(machine)[gpu], "CONTROL": "fifo", "SHM": "written", "SENT": "yes"}
        # the container's /dev/shm is its GPU's daemon's own (issue 35: never one for every GPU)
        assert (daemon.directory(gpu) / "shm/from-container").exists()
        assert not (daemon.directory(1 - gpu) / "shm/from-container").exists()
        pid = daemon.daemon_pid(gpu)
        shm = os.stat(daemon.directory(gpu) / "shm")
        assert shm_seen(machine, pid) == (shm.st_dev, shm.st_ino) != shm_seen(machine, daemon.daemon_pid(1 - gpu))
        assert "get_server_list" in told(machine, pid, has("get_server_list"))    # that GPU's daemon, not the other's
        assert "get_server_list" not in told(machine, daemon.daemon_pid(1 - gpu))
    finally:
        assert daemon.stop() == 0


def test_a_daemon_that_never_starts_is_said_and_its_replicas_stay_unhealthy(machine, tmp_path, fresh_record):
    Path(f"{machine.mps_record}.state").write_text("fail_start\n")
    daemon = MpsDaemon(machine, tmp_path, {"replicas": 2})
    try:
        out = daemon.wait_for("did not start", count=2)
        line = next(x for x in out.splitlines() if "GPU 0" in x and "did not start" in x)
        assert "failed to start" in line and "trying again" in line
        assert out.count("did not start") == 2                    # said once per GPU, not per try
        with serving(machine, tmp_path, {"sharing": "mps", "replicas": 2, "mps-root": str(daemon.root)}) \
                as (kubelet, plugin):
            (reg,) = kubelet.wait_registered(1)
            watch = Watch(kubelet.plugin(reg.endpoint))
            try:
                first = watch.until(all_are("Unhealthy"))
                assert len(first) == 4
                Path(f"{machine.mps_record}.state").unlink()      # the driver is fixed
                watch.until(all_are("Healthy"))
            finally:
                watch.cancel()
            plugin.wait_for("no marker")
    finally:
        assert daemon.stop() == 0


def test_replicas_that_do_not_divide_the_memory(machine, tmp_path, fresh_record):
    daemon = MpsDaemon(machine, tmp_path, {"replicas": 7})
    try:
        out = daemon.wait_for("ready", count=2)
        assert f"GPU 0 ({uuids(machine)[0]}): 81920 MiB do not divide into 7 replicas; each client may pin " \
               "11702 MiB (rounded down, 6 MiB unused)" in out
        threads = "set_default_active_thread_percentage 14"
        assert told(machine, daemon.daemon_pid(1), has(threads))[:2] == ["set_default_device_pinned_mem_limit 0 2194M",
                                                                         threads]
    finally:
        assert daemon.stop() == 0


def test_mig_and_mps_are_refused_by_both(fake_machine_factory, tmp_path):
    mig = fake_machine_factory(MIG_MIXED2)
    daemon = MpsDaemon(mig, tmp_path, {"replicas": 2, "mig-strategy": "mixed"})
    assert daemon.proc.wait(60) == 1
    daemon.stop()
    (line,) = daemon.stderr().splitlines()
    assert "cannot be shared with MPS" in line
    with serving(mig, tmp_path, {"sharing": "mps", "replicas": 2, "mig-strategy": "mixed"}, kubelet=False,
                 expect_exit=True) as (_, plugin):
        assert plugin.proc.wait(60) == 1
    assert "cannot be shared with MPS" in plugin.stderr() and len(plugin.stderr().splitlines()) == 1


def test_mps_daemon_refuses_without_mps(machine, tmp_path):
    daemon = MpsDaemon(machine, tmp_path, {"replicas": 1})
    assert daemon.proc.wait(60) == 1
    daemon.stop()
    assert daemon.stderr() == ('nvcontainer: config error: device-plugin.sharing is "mps" with replicas = 1: '
                               'mps-daemon needs sharing = "mps" and replicas above 1\n')


def test_mount_shm_makes_a_tmpfs_once(machine, tmp_path):
    """--mount-shm (the init container's job) in a mount namespace of the test's own."""
    root = tmp_path / "mps"
    config = plugin_config(tmp_path / "c.toml", tmp_path / "cache", {"sharing": "mps", "mps-root": str(root)})
    cmd = [sys.executable, "-m", "nvcontainer", "--config", str(config), "mps-daemon", "--mount-shm"]
    script = (f'{" ".join(cmd)} && {" ".join(cmd)} && grep " {root}/shm " /proc/self/mountinfo')
    res = subprocess.run(["unshare", "-m", "--propagation", "private", "--", "/bin/sh", "-c", script],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    (mount,) = res.stdout.splitlines()
    assert " - tmpfs shm " in mount and "nosuid" in mount and "nodev" in mount and "noexec" in mount
    assert res.stderr.splitlines() == [f"nvcontainer mps-daemon: {root}/shm: tmpfs mounted",
                                       f"nvcontainer mps-daemon: {root}/shm: already a mount"]
    assert not os.path.ismount(root / "shm")            # only in that namespace


def test_a_link_in_a_gpu_directory_s_place_is_not_followed(machine, tmp_path, fresh_record):
    outside = tmp_path / "outside"
    outside.mkdir()
    gpu_dir = tmp_path / "mps/nvidia.com/gpu" / uuids(machine)[0]
    gpu_dir.parent.mkdir(parents=True)
    gpu_dir.symlink_to(outside)
    daemon = MpsDaemon(machine, tmp_path, {"replicas": 2})
    try:
        daemon.wait_for("ready", count=2)
        assert not gpu_dir.is_symlink() and gpu_dir.is_dir()
        assert list(outside.iterdir()) == []
    finally:
        assert daemon.stop() == 0
