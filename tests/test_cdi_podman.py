"""CDI end to end: podman 4.3 reads a spec from ``nvcontainer cdi generate`` and our CDI hooks
finish the job, on the fake GPU machine.

podman 4.3 has no option for the spec directories: it reads ``/etc/cdi`` and ``/var/run/cdi``.
The test runs podman in a private mount namespace (the fake machine's, see
``fakegpu.runner``) where ``/run`` is a fresh tmpfs holding only ``cdi/``: the host's
directories are neither read nor written. Pass signals as in test_e2e_runtimes: with no driver
behind the fake nodes, opening an injected node gives ENXIO, one the device cgroup denies EPERM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.fixtures import runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.runtime import ENXIO, EPERM, host_mounts, parse_facts as parse
from tests.test_e2e_runtimes import GRAPHICS, assert_graphics_container

LIBDIR = "/usr/lib/x86_64-linux-gnu"
CHECKS = rf"""
for n in /dev/nvidia0 /dev/nvidia1; do echo "OPEN:$n:$(cat $n 2>&1 | head -1)"; done
echo "NODES:$(ls /dev | grep nvidia | sort | tr '\n' ' ')"
rm -f /tmp/n1; mknod /tmp/n1 c 195 1 && echo "MKNOD1:$(cat /tmp/n1 2>&1 | head -1)"
echo "LDCONFIG:$(ldconfig -p | grep -oE 'lib(cuda|nvidia-ml)\.so\.1 .*x86-64' | cut -d' ' -f1 | sort | tr '\n' ' ')"
echo "CUDALINK:$(readlink {LIBDIR}/libcuda.so.1)"
test -f {LIBDIR}/libcuda.so.1 && echo "RESOLVES:yes"
echo "WRITE:$( (echo x > {LIBDIR}/libcuda.so.550.54.14) 2>&1)"
echo "PARAMS:$(grep ModifyDeviceFiles /proc/driver/nvidia/params)"
echo "ENV:$NVIDIA_VISIBLE_DEVICES"
grep -E ' {LIBDIR}/libcuda\.so\.550\.54\.14 ' /proc/self/mountinfo | sed 's/^/MOUNT:/'
echo "DONE:ok"
"""

# In the private namespace: a fresh /run with the spec directory; then the rest of the argv.
WITH_CDI_DIR = 'set -e; mount -t tmpfs -o mode=755 nvc-run /run; mkdir /run/cdi; cp "$1"/* /run/cdi/; shift; exec "$@"'


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    if shutil.which("podman") is None or shutil.which("crun") is None:
        pytest.skip("podman and crun are needed")
    return fake_machine_factory(FakeSpec(gpus=2))


@pytest.fixture(scope="module")
def spec_dir(machine, tmp_path_factory):
    return runtime.cdi_spec_dir(machine, tmp_path_factory.mktemp("cdi"))


def run_podman_cdi(machine, spec_dir: Path, base: Path, device: str, script: str, runtime_name: str = "crun",
                   image=None):
    """``podman run --device DEVICE --rootfs`` with the spec in /var/run/cdi. The only hook.d
    entry is the test's /proc/driver tmpfs (a real driver's procfs has the directory)."""
    work = base / f"podman-{uuid.uuid4().hex[:8]}"
    hooks = work / "hooks"
    hooks.mkdir(parents=True)
    for i, entry in enumerate(runtime.hook_entries(machine, our_hook=False)):
        (hooks / f"{i:02d}-hook.json").write_text(json.dumps(
            {"version": "1.0.0", "hook": entry, "when": {"always": True}, "stages": ["prestart"]}))
    (work / "containers.conf").write_text(runtime.PODMAN_CONF)
    rootfs = runtime.busybox_rootfs(work / "rootfs")
    if image is not None:
        image(rootfs)
    runroot = Path(tempfile.mkdtemp(prefix="nvc-pd-"))   # podman wants a runroot under 50 characters
    argv = ["podman", "--root", str(work / "storage"), "--runroot", str(runroot), "--storage-driver", "vfs",
            "--cgroup-manager", "cgroupfs", "--runtime", runtime_name, "--hooks-dir", str(hooks),
            "run", "--rm", "--network", "none", "--device", device, "--rootfs", str(rootfs), "/bin/sh", "-c", script]
    environ = dict(os.environ, CONTAINERS_CONF=str(work / "containers.conf"))
    command = ["sh", "-c", runtime.V1_ONLY_WORLD, "sh", "sh", "-c", WITH_CDI_DIR, "sh", str(spec_dir), *argv]
    try:
        return subprocess.run(runtime.fake_proc_command(machine, command), capture_output=True, text=True,
                              env=environ, timeout=180)
    finally:
        shutil.rmtree(runroot, ignore_errors=True)


@pytest.mark.parametrize("runtime_name", ["crun", "runc"])
def test_one_gpu(machine, spec_dir, tmp_path, runtime_name):
    if shutil.which(runtime_name) is None:
        pytest.skip(f"{runtime_name} is not installed")
    before = host_mounts()
    res = run_podman_cdi(machine, spec_dir, tmp_path, "nvidia.com/gpu=0", CHECKS, runtime_name)
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["DONE"] == ["ok"], res.stdout
    assert got["OPEN"] == [f"/dev/nvidia0:cat: can't open '/dev/nvidia0': {ENXIO}",
                           "/dev/nvidia1:cat: can't open '/dev/nvidia1': No such file or directory"]
    assert got["NODES"][0].split() == ["nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidiactl"]
    assert got["MKNOD1"] == [f"cat: can't open '/tmp/n1': {EPERM}"]       # GPU 1 stays outside the cgroup
    assert got["LDCONFIG"] == ["libcuda.so.1 libnvidia-ml.so.1"]
    assert got["CUDALINK"] == ["libcuda.so.550.54.14"] and got["RESOLVES"] == ["yes"]
    assert "Read-only file system" in got["WRITE"][0]
    (mount,) = got["MOUNT"]
    assert {"ro", "nosuid", "nodev"} <= set(mount.split()[5].split(","))
    assert got["PARAMS"] == ["ModifyDeviceFiles: 0"]
    assert got["ENV"] == ["void"]
    assert host_mounts() == before


@pytest.mark.parametrize("runtime_name", ["crun", "runc"])
def test_cuda_forward_compat(machine, spec_dir, tmp_path, runtime_name):
    """An image built for a newer CUDA (a compat libcuda 999.x under /usr/local/cuda/compat)
    loads that libcuda through the spec's update-ldcache hook, as NVIDIA's enable-cuda-compat
    hook gives it; the host's stays mounted where it was."""
    if shutil.which(runtime_name) is None:
        pytest.skip(f"{runtime_name} is not installed")

    def image(rootfs: Path) -> None:
        compat = rootfs / "usr/local/cuda/compat"
        compat.mkdir(parents=True)
        shutil.copy(machine.root / LIBDIR.lstrip("/") / "libcuda.so.550.54.14", compat / "libcuda.so.999.1.2")

    script = ("echo \"FIRST:$(ldconfig -p | grep -E 'libcuda\\.so\\.1 .*x86-64' | head -1 | sed 's/.*=> //')\"\n"
              "echo \"COMPATLINK:$(readlink /usr/local/cuda/compat/libcuda.so.1)\"\n"
              "echo \"DROPIN:$(head -1 /etc/ld.so.conf.d/00-nvcontainer-cdi.conf)\"\n")
    res = run_podman_cdi(machine, spec_dir, tmp_path, "nvidia.com/gpu=0", script, runtime_name, image=image)
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["FIRST"] == ["/usr/local/cuda/compat/libcuda.so.1"], res.stdout
    assert got["COMPATLINK"] == ["libcuda.so.999.1.2"] and got["DROPIN"] == ["/usr/local/cuda/compat"]


def test_all_gpus(machine, spec_dir, tmp_path):
    res = run_podman_cdi(machine, spec_dir, tmp_path, "nvidia.com/gpu=all", CHECKS)
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["OPEN"] == [f"/dev/nvidia{i}:cat: can't open '/dev/nvidia{i}': {ENXIO}" for i in (0, 1)]
    assert {"nvidia0", "nvidia1", "nvidiactl"} <= set(got["NODES"][0].split())
    assert got["MKNOD1"] == [f"cat: can't open '/tmp/n1': {ENXIO}"]


def test_by_uuid(machine, spec_dir, tmp_path):
    uuid1 = machine.description()["gpus"][1]["uuid"]
    res = run_podman_cdi(machine, spec_dir, tmp_path, f"nvidia.com/gpu={uuid1}", CHECKS)
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["OPEN"] == ["/dev/nvidia0:cat: can't open '/dev/nvidia0': No such file or directory",
                           f"/dev/nvidia1:cat: can't open '/dev/nvidia1': {ENXIO}"]


def test_unknown_device_is_refused(machine, spec_dir, tmp_path):
    res = run_podman_cdi(machine, spec_dir, tmp_path, "nvidia.com/gpu=7", "echo STARTED")
    assert res.returncode != 0
    assert "STARTED" not in res.stdout
    assert "nvidia.com/gpu=7" in res.stderr


@pytest.mark.parametrize("runtime_name", ["crun", "runc"])
def test_graphics(machine, spec_dir, tmp_path, runtime_name):
    """Issue 15.13 through CDI, as NVIDIA's generator has it: GPU 1's device brings its DRI
    nodes (podman creates and allows them) and our create-symlinks hook their by-path links; the
    common edits bring the Vulkan, EGL and Xorg files where the loaders look (CDI has no
    capabilities: every driver file, display's too)."""
    if shutil.which(runtime_name) is None:
        pytest.skip(f"{runtime_name} is not installed")
    other = machine.description()["gpus"][0]["dri"][1]["minor"]
    res = run_podman_cdi(machine, spec_dir, tmp_path, "nvidia.com/gpu=1", GRAPHICS.replace("{other}", str(other)),
                         runtime_name)
    assert_graphics_container(res, machine, 1)
