"""The product's main job, end to end: real runtimes start busybox containers with our hook.

Pass signals (no driver behind the fake nodes): opening an injected ``/dev/nvidia0`` gives
ENXIO when the devices cgroup allows it and EPERM when it does not.
"""

from __future__ import annotations

import concurrent.futures
import shutil

import pytest

from tests.fixtures import runtime
from tests.fixtures.fakegpu import FakeSpec

ENXIO, EPERM = runtime.ENXIO, runtime.EPERM

CHECKS = r"""
echo "OPEN0:$(cat /dev/nvidia0 2>&1 | head -1)"
echo "NODES:$(ls /dev | grep nvidia | sort | tr '\n' ' ')"
rm -f /tmp/n1; mknod /tmp/n1 c 195 1 && echo "OPEN1:$(cat /tmp/n1 2>&1 | head -1)"
echo "LDCONFIG:$(ldconfig -p | grep -oE 'lib(cuda|nvidia-ml)\.so\.1 ' | sort | tr -d ' ' | tr '\n' ' ')"
echo "GPUS:$(ls /proc/driver/nvidia/gpus 2>&1 | tr '\n' ' ')"
echo "PARAMS:$(grep ModifyDeviceFiles /proc/driver/nvidia/params)"
grep -E ' /usr/lib/x86_64-linux-gnu/libcuda\.so\.550\.54\.14 ' /proc/self/mountinfo | sed 's/^/MOUNT:/'
echo "CUDALINK:$(readlink /usr/lib/x86_64-linux-gnu/libcuda.so.1)"
echo "DONE:ok"
"""


parse = runtime.parse_facts


host_mounts = runtime.host_mounts


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


def need(tool):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")


def assert_gpu0_container(res, machine):
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["DONE"] == ["ok"], res.stdout
    assert got["OPEN0"] == [f"cat: can't open '/dev/nvidia0': {ENXIO}"]
    nodes = got["NODES"][0].split()
    assert "nvidia0" in nodes and "nvidiactl" in nodes and "nvidia1" not in nodes
    assert got["OPEN1"] == [f"cat: can't open '/tmp/n1': {EPERM}"]
    assert got["LDCONFIG"] == ["libcuda.so.1 libnvidia-ml.so.1"]
    bus0 = machine.description()["gpus"][0]["proc_bus_id"]
    assert got["GPUS"] == [bus0]
    assert got["PARAMS"] == ["ModifyDeviceFiles: 0"]
    (mount,) = got["MOUNT"]
    options = mount.split()[5].split(",")
    assert {"ro", "nosuid", "nodev"} <= set(options)
    assert got["CUDALINK"] == ["libcuda.so.550.54.14"]


@pytest.mark.parametrize("runtime_name", ["runc", "crun"])
def test_gpu0_cgroup_v1(machine, tmp_path, runtime_name):
    need(runtime_name)
    before = host_mounts()
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=0"], CHECKS)
    res = runtime.run_container(machine, bundle, runtime=runtime_name)
    assert_gpu0_container(res, machine)
    assert host_mounts() == before


def test_gpu0_runc_cgroup_v2(machine, tmp_path):
    need("runc")
    before = host_mounts()
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=0"], CHECKS)
    res = runtime.run_container(machine, bundle, cgroup2=True)
    assert_gpu0_container(res, machine)
    assert host_mounts() == before


@pytest.mark.parametrize("env", [[], ["NVIDIA_VISIBLE_DEVICES=void"], ["NVIDIA_VISIBLE_DEVICES="]])
def test_not_a_gpu_container_is_untouched(machine, tmp_path, env):
    need("runc")
    bundle = runtime.make_bundle(tmp_path, machine, env, CHECKS)
    res = runtime.run_container(machine, bundle)
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["NODES"] == [""]
    assert got["LDCONFIG"] == [""]
    assert "MOUNT" not in got
    assert not (bundle / "rootfs/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14").exists()


@pytest.mark.parametrize("env,expected", [
    (["NVIDIA_VISIBLE_DEVICES=7"], "nvcontainer-hook: device error: 7: unknown device"),
    (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,warp-drive"],
     "nvcontainer-hook: input error: unsupported capabilities found in"),
    (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=13.0"],
     "nvcontainer-hook: requirement error: unsatisfied condition: cuda>=13.0"),
])
def test_bad_requests_refuse_to_start(machine, tmp_path, env, expected):
    need("runc")
    bundle = runtime.make_bundle(tmp_path, machine, env, "echo STARTED")
    res = runtime.run_container(machine, bundle)
    assert res.returncode != 0
    assert "STARTED" not in res.stdout
    assert expected in res.stderr
    assert not (bundle / "rootfs/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14").exists()


def need_overlay():
    with open("/proc/filesystems") as f:
        if "\toverlay\n" not in f.read():
            pytest.skip("no overlay filesystem here")


@pytest.mark.parametrize("served", [False, True], ids=["in-process", "served"])
def test_ubuntu_ldconfig_script_runs_the_binary_beside_it(machine, tmp_path, served, native_client):
    """Ubuntu's /sbin/ldconfig is a shell script that execs /sbin/ldconfig.real. The default
    ``@/sbin/ldconfig`` means the binary there, as nvidia-container-toolkit normalises it: a
    script cannot run in the sandbox, and every GPU container on Ubuntu was refused with
    "/sbin/ldconfig: not an ELF file". Served too: the server prepares its sealed copy of
    the same program."""
    need("runc")
    need_overlay()
    (tmp_path / "sbin").mkdir()
    wrap = runtime.ubuntu_sbin(tmp_path / "sbin")
    sock, trace = tmp_path / "srv" / "hook.sock", tmp_path / "hook.log"

    def served_hook(spec):
        entry = spec["hooks"]["prestart"][1]
        entry["path"] = native_client
        entry["args"] = [native_client, "--socket", str(sock), "--root", str(machine.root), "--debug", str(trace),
                         "prestart"]

    if served:
        sock.parent.mkdir(mode=0o700)
        wrap += runtime.server_beside(machine, sock)
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=0"], CHECKS,
                                 extra_spec=served_hook if served else None)
    res = runtime.run_container(machine, bundle, wrap=wrap)
    assert_gpu0_container(res, machine)   # LDCONFIG: the container's cache lists the driver
    if served:
        assert "(served by nvcontainer serve, pid " in trace.read_text()
        assert "ldconfig not prepared" not in (sock.parent / "serve.log").read_text()


def test_ubuntu_ldconfig_script_without_the_binary_is_refused(machine, tmp_path):
    need("runc")
    need_overlay()
    (tmp_path / "sbin").mkdir()
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=0"], "echo STARTED")
    res = runtime.run_container(machine, bundle, wrap=runtime.ubuntu_sbin(tmp_path / "sbin", real=False))
    assert res.returncode != 0 and "STARTED" not in res.stdout
    assert "nvcontainer-hook: ldcache error: /sbin/ldconfig: not an ELF file" in res.stderr, res.stderr


def test_repeated_starts_of_one_bundle(machine, tmp_path):
    need("runc")
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=0"], CHECKS)
    for i in range(3):
        res = runtime.run_container(machine, bundle, name=f"{bundle.name}-{i}")
        assert_gpu0_container(res, machine)


def test_twenty_containers_at_once_get_their_own_gpu(fake_machine_factory, tmp_path):
    need("runc")
    machine = fake_machine_factory(FakeSpec(gpus=8))
    script = 'for n in /dev/nvidia[0-9]*; do echo "NODE:$n:$(cat $n 2>&1 | head -1)"; done'
    bundles = [runtime.make_bundle(tmp_path, machine, [f"NVIDIA_VISIBLE_DEVICES={i % 8}"], script)
               for i in range(20)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(lambda b: runtime.run_container(machine, b, timeout=300), bundles))
    for i, res in enumerate(results):
        assert res.returncode == 0, res.stderr
        assert parse(res.stdout)["NODE"] == [f"/dev/nvidia{i % 8}:cat: can't open '/dev/nvidia{i % 8}': {ENXIO}"]


def test_podman_with_hooks_dir(machine, tmp_path):
    need("podman")
    need("crun")
    before = host_mounts()
    res = runtime.run_podman(machine, tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"], CHECKS)
    assert_gpu0_container(res, machine)
    assert host_mounts() == before


MIG_CONTROL = r"""
for n in 1 2; do echo "CAP$n:$(cat /dev/nvidia-caps/nvidia-cap$n 2>&1 | head -1)"; done
awk '$5 ~ "^/dev/nvidia-caps" {print "MOUNTED:" $5}' /proc/self/mountinfo
echo "CONFIG:$(head -1 /proc/driver/nvidia/capabilities/mig/config)"
"""


def test_mig_config_and_monitor_with_the_caps_directory_alone(fake_machine_factory, tmp_path):
    """Issue 15.7, as upstream: only /dev/nvidia-caps is bound (no node bound again on top of
    it) and the config and monitor nodes, reached through the directory, are allowed (ENXIO)."""
    need("runc")
    machine = fake_machine_factory(FakeSpec(gpus=2, mig=True))
    env = ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_MIG_CONFIG_DEVICES=all", "NVIDIA_MIG_MONITOR_DEVICES=all"]
    caps = ("CAP_CHOWN", "CAP_MKNOD", "CAP_KILL", "CAP_SYS_ADMIN")   # privileged: MIG control is refused otherwise
    bundle = runtime.make_bundle(tmp_path, machine, env, MIG_CONTROL, caps=caps)
    res = runtime.run_container(machine, bundle)
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["CAP1"] == [f"cat: can't open '/dev/nvidia-caps/nvidia-cap1': {ENXIO}"]
    assert got["CAP2"] == [f"cat: can't open '/dev/nvidia-caps/nvidia-cap2': {ENXIO}"]
    assert got["MOUNTED"] == ["/dev/nvidia-caps"]
    assert got["CONFIG"] == ["DeviceFileMinor: 1"]


# Issue 15.13: what a graphics container sees. {other} is a DRI minor of a GPU it did not ask for.
GRAPHICS = r"""
for f in /etc/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/implicit_layer.d/nvidia_layers.json \
         /usr/share/glvnd/egl_vendor.d/10_nvidia.json /usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json; do
    echo "JSON:$f:$(grep -o '"library_path": "[^"]*"' $f 2>&1)"
done
echo "DRI:$(ls /dev/dri | sort | tr '\n' ' ')"
for n in /dev/dri/card* /dev/dri/renderD*; do echo "OPEN:$n:$(cat $n 2>&1 | head -1)"; done
for l in /dev/dri/by-path/*; do echo "BYPATH:${l##*/}:$(readlink $l)"; done
rm -f /tmp/other; mknod /tmp/other c 226 {other} && echo "OTHER:$(cat /tmp/other 2>&1 | head -1)"
echo "XORG:$(ls /usr/lib/xorg/modules/drivers 2>&1):$(readlink /usr/lib/xorg/modules/extensions/libglxserver_nvidia.so 2>&1)"
echo "EGLLIB:$(readlink /usr/lib/x86_64-linux-gnu/libnvidia-egl-wayland.so.1)"
echo "LDCONFIG:$(ldconfig -p | grep -c 'libnvidia-egl-wayland.so.1 ')"
echo "DONE:ok"
"""


def assert_graphics_container(res, machine, gpu: int, *, display: bool = True):
    """What GPU ``gpu``'s graphics container must see: the loaders' files at their paths, its
    own card and render nodes (allowed: ENXIO), their by-path links, not the other GPU's nodes
    (absent, and denied when made: EPERM), the Xorg modules with display."""
    from tests.fixtures.fakegpu.graphics import drm_major_free

    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["DONE"] == ["ok"], res.stdout
    desc = machine.description()
    assert got["JSON"] == [
        '/etc/vulkan/icd.d/nvidia_icd.json:"library_path": "libGLX_nvidia.so.0"',
        '/usr/share/vulkan/implicit_layer.d/nvidia_layers.json:"library_path": "libGLX_nvidia.so.0"',
        '/usr/share/glvnd/egl_vendor.d/10_nvidia.json:"library_path": "libEGL_nvidia.so.0"',
        '/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json:"library_path": "libnvidia-egl-wayland.so.1"']
    card, render = (n["path"].rsplit("/", 1)[1] for n in desc["gpus"][gpu]["dri"])
    assert got["DRI"] == [f"by-path {card} {render}"]
    if drm_major_free():   # no DRM driver here: an allowed node has nothing behind it
        assert got["OPEN"] == [f"/dev/dri/{card}:cat: can't open '/dev/dri/{card}': {ENXIO}",
                               f"/dev/dri/{render}:cat: can't open '/dev/dri/{render}': {ENXIO}"]
        assert got["OTHER"] == [f"cat: can't open '/tmp/other': {EPERM}"]
    bus = desc["gpus"][gpu]["proc_bus_id"]
    assert got["BYPATH"] == [f"pci-{bus}-card:../{card}", f"pci-{bus}-render:../{render}"]
    glx = f"libglxserver_nvidia.so.{desc['driver_version']}"
    assert got["XORG"] == ([f"nvidia_drv.so:{glx}"] if display else
                           ["ls: /usr/lib/xorg/modules/drivers: No such file or directory:"])
    assert got["EGLLIB"] == ["libnvidia-egl-wayland.so.1.1.13"]
    assert got["LDCONFIG"] == ["1"]


@pytest.mark.parametrize("caps", ["graphics,display", "graphics"])
def test_graphics_and_display_under_runc(machine, tmp_path, caps):
    need("runc")
    other = machine.description()["gpus"][0]["dri"][1]["minor"]
    env = ["NVIDIA_VISIBLE_DEVICES=1", f"NVIDIA_DRIVER_CAPABILITIES={caps}"]
    bundle = runtime.make_bundle(tmp_path, machine, env, GRAPHICS.replace("{other}", str(other)))
    assert_graphics_container(runtime.run_container(machine, bundle), machine, 1, display="display" in caps)
