"""The image as a cluster runs it: ``nvcontainer device-plugin`` from the OCI archive that
``scripts/image`` builds (``.ci/run`` builds it before the tests), under podman, on the 2-GPU fake
machine, against the fake kubelet.

The plugin's container gets its driver as NVIDIA's does on a node: it asks for
``NVIDIA_VISIBLE_DEVICES=all`` with ``NVIDIA_DRIVER_CAPABILITIES=utility``, and the node's hook
(ours, registered in podman's hooks.d) injects NVML, the device nodes and the driver's procfs
files. The image holds no driver and no test code. What the container is given beyond that is
the hardware's part only: the kubelet's socket directory (as the DaemonSet mounts it), and the
file the mock NVML answers from (fixed at its path when it was compiled, as a real NVML's answers
come from the GPU through ``/dev/nvidiactl``) with its events directory, at the same paths.

Without the archive the module builds it (``scripts/image``), except under CI=true, where
``.ci/run`` should have: there it fails, so a missing build step is never a silent skip."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import tomllib
import uuid
from pathlib import Path

import pytest

from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb
from tests.fixtures import runtime
from tests.fixtures.kubelet import FakeKubelet, Watch
from tests.test_cdi_podman import machine  # noqa: F401  (the 2-GPU machine; skips without podman and crun)

REPO = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
TAG = f"localhost/nvcontainer:{VERSION}"
ARCHIVE = REPO / "dist" / f"nvcontainer_{VERSION}_image.oci.tar"
SOCKET_DIR = "/var/lib/kubelet/device-plugins"
# what the plugin's container needs and no more: root, to own its socket in the kubelet's
# root-only directory; CAP_SETUID and CAP_SETGID, to load NVML as the unprivileged identity, and
# CAP_KILL, to stop those children (another user's processes). Not privileged: the node's hook
# gives it the device nodes and their cgroup rules.
MINIMUM = ("--cap-drop=all", "--cap-add=SETUID,SETGID,KILL", "--security-opt=no-new-privileges")


def archive() -> Path:
    """The image's archive; built here when it is missing (or, outside CI, older than the code)."""
    if os.environ.get("CI") == "true":
        if not ARCHIVE.exists():
            pytest.fail(f"{ARCHIVE} is missing: .ci/run builds it with scripts/image before the tests")
        return ARCHIVE
    built = ARCHIVE.stat().st_mtime if ARCHIVE.exists() else 0
    if any(p.stat().st_mtime > built for p in (REPO / "nvcontainer").rglob("*.py")):
        res = subprocess.run([str(REPO / "scripts/image")], capture_output=True, text=True, timeout=1200)
        assert res.returncode == 0, res.stderr
    return ARCHIVE


class Podman:
    """podman with a private store (vfs) and runroot, the test's containers.conf, and a hooks.d
    directory holding the test's /proc/driver stand-in and our hook, as a node registers it."""

    def __init__(self, base: Path, machine):
        self.base = base
        self.machine = machine
        self.hooks = base / "hooks"
        self.hooks.mkdir(parents=True)
        for i, entry in enumerate(runtime.hook_entries(machine)):
            (self.hooks / f"{i:02d}-hook.json").write_text(json.dumps(
                {"version": "1.0.0", "hook": entry, "when": {"always": True}, "stages": ["prestart"]}))
        (base / "containers.conf").write_text(runtime.PODMAN_CONF)
        self.runroot = Path(tempfile.mkdtemp(prefix="nvc-pd-"))   # podman wants a runroot under 50 characters
        self.env = dict(os.environ, CONTAINERS_CONF=str(base / "containers.conf"))

    def argv(self, *args: str) -> list[str]:
        podman = ["podman", "--root", str(self.base / "storage"), "--runroot", str(self.runroot),
                  "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs", "--hooks-dir", str(self.hooks), *args]
        return runtime.fake_proc_command(self.machine, ["sh", "-c", runtime.V1_ONLY_WORLD, "sh", *podman])

    def run(self, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), capture_output=True, text=True, env=self.env, timeout=timeout)

    def close(self) -> None:
        shutil.rmtree(self.runroot, ignore_errors=True)


@pytest.fixture(scope="module")
def podman(machine, tmp_path_factory):
    path = archive()
    engine = Podman(tmp_path_factory.mktemp("image"), machine)
    try:
        res = engine.run("load", "--quiet", "--input", str(path))
        assert res.returncode == 0, res.stderr
        yield engine
    finally:
        engine.close()


def start_plugin(podman: Podman, machine, sockets: Path, log: Path) -> subprocess.Popen:
    """The plugin's container, as the DaemonSet runs it: the kubelet's directory mounted, the
    driver asked of the node's hook by environment."""
    hardware = [f"--volume={machine.nvml_config}:{machine.nvml_config}:ro",
                f"--volume={machine.nvml_events}:{machine.nvml_events}:ro"]
    argv = podman.argv("run", "--rm", "--network", "none", f"--name=plugin-{uuid.uuid4().hex[:8]}",
                       *MINIMUM, "--env=NVIDIA_VISIBLE_DEVICES=all", "--env=NVIDIA_DRIVER_CAPABILITIES=utility",
                       f"--volume={sockets}:{SOCKET_DIR}", *hardware, TAG, "--debug", "/dev/stderr", "device-plugin")
    with open(log, "wb") as err:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=podman.env)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)      # podman passes it on to the plugin
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def test_plugin_from_the_image(machine, podman, tmp_path):
    sockets = tmp_path / "device-plugins"
    sockets.mkdir(mode=0o700)
    kubelet = FakeKubelet(sockets).start()
    log = tmp_path / "plugin.stderr"
    proc = start_plugin(podman, machine, sockets, log)
    try:
        end = time.monotonic() + 120
        while not kubelet.requests:
            assert proc.poll() is None and time.monotonic() < end, f"no registration: {log.read_text()}"
            time.sleep(0.1)
        (reg,) = kubelet.wait_registered(1)
        assert reg.resource_name == "nvidia.com/gpu" and reg.version == "v1beta1"
        gpus = [g["uuid"] for g in machine.description()["gpus"]]
        watch = Watch(kubelet.plugin(reg.endpoint))
        try:
            devices = watch.until(lambda d: set(d) == set(gpus), timeout=60)
        finally:
            watch.cancel()
        assert {health for health, _ in devices.values()} == {"Healthy"}
        got = kubelet.plugin(reg.endpoint).Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[gpus[1]])]))
        (response,) = got.container_responses
        assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": gpus[1]}
    finally:
        code = stop(proc)
        kubelet.stop()
    err = log.read_text()
    assert code == 0, err
    assert "Traceback" not in err, err


def test_image_without_the_package(tmp_path):
    """scripts/image given a .deb that is not there: one line, non-zero, dist/ as it was."""
    dist = REPO / "dist"
    before = sorted(os.listdir(dist)) if dist.exists() else None
    missing = tmp_path / "nvcontainer_0.0.0_amd64.deb"
    res = subprocess.run([str(REPO / "scripts/image"), str(missing)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr.splitlines() == [f"scripts/image: no package at {missing} (make one with scripts/package)"]
    assert res.stdout == ""
    assert (sorted(os.listdir(dist)) if dist.exists() else None) == before


def test_containerfile_without_the_package(podman, tmp_path):
    """The Containerfile alone (a context without the .deb): its check stops the build with one
    line naming the file. The base it names is the loaded image, tagged so in the private store."""
    base = next(line.split()[1] for line in (REPO / "Containerfile").read_text().splitlines()
                if line.startswith("FROM "))
    assert podman.run("tag", TAG, base).returncode == 0
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy(REPO / "Containerfile", context)
    res = podman.run("build", "--pull=never", "--isolation=chroot", "--layers=false", f"--build-arg=VERSION={VERSION}",
                     "--tag=localhost/nvcontainer-no-deb:1", str(context))
    assert res.returncode != 0
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("Containerfile: ")]
    assert lines == [f"Containerfile: no dist/nvcontainer_{VERSION}_amd64.deb to install: make it with "
                     "scripts/package (or build with scripts/image); with several versions there, pass "
                     "--build-arg VERSION"], res.stdout + res.stderr
    assert podman.run("image", "exists", "localhost/nvcontainer-no-deb:1").returncode != 0
