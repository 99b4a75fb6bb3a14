"""The plan builder on fake machines: exactly what each request gives a container."""

from __future__ import annotations

import json

import pytest

from nvcontainer.config.model import Config
from nvcontainer.plan.gather import host_proc
from nvcontainer.errors import NvcError
from nvcontainer.inventory.build import build
from nvcontainer.plan.build import COMPAT_DROP_IN, PlanOptions, build_plan
from nvcontainer.plan.container import CompatLib, ContainerFacts
from nvcontainer.request.decide import request_from_env, request_from_options
from tests.fixtures.fakegpu import FakeSpec

DEBIAN = ContainerFacts(libs_dir="/usr/lib/x86_64-linux-gnu", libs32_dir="/usr/lib/i386-linux-gnu", debian=True)


@pytest.fixture(scope="module")
def two(fake_machine_factory):
    m = fake_machine_factory(FakeSpec(gpus=2))
    return m, build(str(m.root), proc=str(m.proc)), host_proc(str(m.proc))


@pytest.fixture(scope="module")
def mig(fake_machine_factory):
    m = fake_machine_factory(FakeSpec(gpus=2, mig=True))
    return m, build(str(m.root), proc=str(m.proc)), host_proc(str(m.proc))


def plan_of(env_or_request, machine_inv_proc, container=DEBIAN, options=PlanOptions(), privileged=False):
    machine, inv, hp = machine_inv_proc
    if isinstance(env_or_request, dict):
        request = request_from_env(env_or_request, Config(), privileged=privileged)
    else:
        request = env_or_request
    return build_plan(request, inv, container, hp, options, rootfs="/rootfs", pid=42)


def test_not_a_gpu_container(two):
    for env in ({}, {"NVIDIA_VISIBLE_DEVICES": ""}, {"NVIDIA_VISIBLE_DEVICES": "void"}):
        plan = plan_of(env, two)
        assert plan.gpu is False
        assert plan.to_json() == {"gpu": False}


def test_one_gpu_compute_utility(two):
    machine, inv, _ = two
    truth = machine.description()
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "0"}, two)
    uvm = machine.uvm_major
    assert [(d.path, d.major, d.minor) for d in plan.devices] == [
        ("/dev/nvidiactl", 195, 255), ("/dev/nvidia-uvm", uvm, 0), ("/dev/nvidia-uvm-tools", uvm, 1),
        ("/dev/nvidia0", 195, 0)]
    assert all(d.source == f"{machine.root}{d.path}" for d in plan.devices)
    assert list(plan.cgroup_rules) == ["c 195:255 rw", f"c {uvm}:0 rw", f"c {uvm}:1 rw", "c 195:0 rw"]
    wanted = {lib["path"] for lib in truth["libraries"] if lib["group"] in ("compute", "utility")}
    lib_mounts = [m for m in plan.mounts if m.target.startswith("/usr/lib/x86_64-linux-gnu/")]
    assert {m.source[len(str(machine.root)):] for m in lib_mounts} == wanted
    assert all(m.options == ("ro", "nosuid", "nodev") for m in lib_mounts)
    assert all(m.target.rsplit("/", 1)[1] == m.source.rsplit("/", 1)[1] for m in lib_mounts)
    bins = {m.target for m in plan.mounts if m.target.startswith("/usr/bin/")}
    assert bins == {"/usr/bin/" + b["path"].rsplit("/", 1)[1] for b in truth["binaries"]}
    ipcs = {m.target: m.options for m in plan.mounts if m.kind in ("socket", "dir") and not m.target.startswith("/proc")}
    assert ipcs == {i["path"]: ("nosuid", "nodev", "noexec") for i in truth["ipcs"]}
    assert plan.ldconfig.directories == ("/usr/lib/x86_64-linux-gnu",)
    assert plan.ldconfig.ldconfig == "@/sbin/ldconfig"


def test_proc_driver_is_private_with_only_the_selected_gpu(two):
    machine, _, _ = two
    truth = machine.description()
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "1"}, two)
    (proc,) = plan.tmpfs
    assert proc.target == "/proc/driver/nvidia"
    params = next(f for f in proc.files if f.path.endswith("/params"))
    assert "ModifyDeviceFiles: 0" in params.content and "ModifyDeviceFiles: 1" not in params.content
    host_params = (machine.proc / "driver/nvidia/params").read_text()
    assert params.content == host_params.replace("ModifyDeviceFiles: 1", "ModifyDeviceFiles: 0")
    bus = truth["gpus"][1]["proc_bus_id"]
    assert proc.dirs == ("gpus", f"gpus/{bus}")
    binds = [m for m in plan.mounts if m.target.startswith("/proc/")]
    assert [(m.source, m.target, m.options) for m in binds] == [
        (f"/proc/driver/nvidia/gpus/{bus}", f"/proc/driver/nvidia/gpus/{bus}", ("ro", "nosuid", "nodev", "noexec"))]
    assert [d.path for d in plan.devices if d.major == 195] == ["/dev/nvidiactl", "/dev/nvidia1"]


def test_all_and_none(two):
    all_plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "all"}, two)
    assert [d.path for d in all_plan.devices if d.path.startswith("/dev/nvidia") and d.path[-1].isdigit()] == [
        "/dev/nvidia0", "/dev/nvidia1"]
    none_plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "none"}, two)
    assert none_plan.gpu
    assert not any(d.path[-1].isdigit() for d in none_plan.devices)
    assert any(m.target.endswith("libcuda.so.550.54.14") for m in none_plan.mounts)


def test_utility_only_has_no_uvm_and_no_compute_libraries(two):
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "utility"}, two)
    assert [d.path for d in plan.devices] == ["/dev/nvidiactl", "/dev/nvidia0"]
    assert not any("libcuda" in m.target for m in plan.mounts)
    assert any("libnvidia-ml.so" in m.target for m in plan.mounts)
    assert not any(m.target == "/tmp/nvidia-mps" for m in plan.mounts)


def test_video_brings_compute_libraries_and_uvm_but_not_compute_binaries(two):
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "video"}, two)
    targets = {m.target.rsplit("/", 1)[1] for m in plan.mounts}
    assert "libcuda.so.550.54.14" in targets and "libnvcuvid.so.550.54.14" in targets
    assert "nvidia-cuda-mps-control" not in targets
    assert any(d.path == "/dev/nvidia-uvm" for d in plan.devices)
    assert any(s.link.endswith("/libnvidia-opticalflow.so") and s.target == "libnvidia-opticalflow.so.1"
               for s in plan.symlinks)


def test_graphics_and_display(two):
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": "graphics,display"}, two)
    assert any(d.path == "/dev/nvidia-modeset" and (d.major, d.minor) == (195, 254) for d in plan.devices)
    assert not any("uvm" in d.path for d in plan.devices)
    targets = {m.target.rsplit("/", 1)[1] for m in plan.mounts}
    assert {"libGLX_nvidia.so.550.54.14", "libEGL_nvidia.so.550.54.14", "libnvidia-glcore.so.550.54.14"} <= targets
    assert "libcuda.so.550.54.14" not in targets
    profile = next(t for t in plan.tmpfs if t.target == "/etc/nvidia/nvidia-application-profiles-rc.d")
    (conf,) = profile.files
    assert '"EGLVisibleDGPUDevices", 0x2]' in conf.content  # minor 1 → bit 1
    assert any(s.link == "/usr/lib/x86_64-linux-gnu/libGLX_indirect.so.0" and s.target == "libGLX_nvidia.so.550.54.14"
               for s in plan.symlinks)


def test_host_soname_and_dev_links_become_container_links(two):
    machine, _, _ = two
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "0"}, two)
    links = {s.link: s.target for s in plan.symlinks}
    assert links["/usr/lib/x86_64-linux-gnu/libcuda.so.1"] == "libcuda.so.550.54.14"
    assert links["/usr/lib/x86_64-linux-gnu/libcuda.so"] == "libcuda.so.1"
    assert links["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so"] == "libnvidia-ml.so.1"
    truth = machine.description()
    expected = {f"/usr/lib/x86_64-linux-gnu/{name}" for lib in truth["libraries"]
                if lib["group"] in ("compute", "utility") for name, _ in lib["links"]}
    assert expected <= set(links)


def test_compat32_goes_to_the_32bit_directory(two):
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility,compat32"}, two)
    lib32 = [m for m in plan.mounts if m.target.startswith("/usr/lib/i386-linux-gnu/")]
    assert lib32 and all("/i386-linux-gnu/" in m.source for m in lib32)
    assert plan.ldconfig.directories == ("/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu")


def test_non_debian_image_uses_lib64(two):
    other = ContainerFacts(libs_dir="/usr/lib64", libs32_dir="/usr/lib32")
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "0"}, two, container=other)
    assert any(m.target == "/usr/lib64/libcuda.so.550.54.14" for m in plan.mounts)
    assert plan.ldconfig.directories == ("/usr/lib64",)


def test_mig_device(mig):
    machine, _, _ = mig
    truth = machine.description()
    m1 = truth["gpus"][0]["migs"][1]
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": m1["uuid"]}, mig)
    caps = [d for d in plan.devices if d.path.startswith("/dev/nvidia-caps/")]
    assert [(d.major, d.minor) for d in caps] == [
        (m1["gi_cap"]["major"], m1["gi_cap"]["minor"]), (m1["ci_cap"]["major"], m1["ci_cap"]["minor"])]
    assert "/dev/nvidia0" in [d.path for d in plan.devices]
    proc_binds = [m.target for m in plan.mounts if m.target.startswith("/proc/driver/nvidia/capabilities")]
    assert proc_binds == [m1["gi_access"], m1["ci_access"]]
    (proc,) = plan.tmpfs
    assert {f.path for f in proc.files} >= {m1["gi_access"], m1["ci_access"]}
    assert f"c {m1['ci_cap']['major']}:{m1['ci_cap']['minor']} rw" in plan.cgroup_rules


def test_mig_config_needs_privilege_and_refuses_specific_mig_devices(mig):
    with pytest.raises(NvcError, match="non privileged"):
        plan_of({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all"}, mig)
    request = request_from_options(devices=["0:0"], capabilities=["utility"], mig_config="all")
    with pytest.raises(NvcError) as err:
        plan_of(request, mig)
    assert err.value.line() == "nvcontainer: mig-config error: cannot enable mig-config with specific MIG devices selected"


def test_mig_config_all_exposes_every_mig_minor(mig):
    machine, inv, _ = mig
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all"}, mig, privileged=True)
    caps_rules = {r for r in plan.cgroup_rules if r.startswith(f"c {machine.caps_major}:")}
    expected = {f"c {machine.caps_major}:{minor} rw" for name, minor in inv.mig_minors
                if any(name.startswith(f"gpu{g.minor}/") for g in inv.gpus if g.mig_capable)}
    expected.add(f"c {machine.caps_major}:{inv.mig.config_cap.minor} rw")
    assert caps_rules == expected
    assert any(m.target == "/proc/driver/nvidia/capabilities" for m in plan.mounts)


def test_mig_config_and_monitor_bind_the_caps_directory_only(mig):
    """Upstream (issue 15.7): /dev/nvidia-caps is bound whole and its config and monitor nodes
    are allowed in the cgroup; they are not bound a second time on top of the directory."""
    machine, inv, _ = mig
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all",
                    "NVIDIA_MIG_MONITOR_DEVICES": "all"}, mig, privileged=True)
    caps = [m for m in plan.mounts if m.target.startswith("/dev/nvidia-caps")]
    assert [(m.source, m.target, m.kind) for m in caps] == [
        (f"{machine.root}/dev/nvidia-caps", "/dev/nvidia-caps", "dir")]
    assert not [d for d in plan.devices if d.path.startswith("/dev/nvidia-caps")]
    assert {f"c {machine.caps_major}:1 rw", f"c {machine.caps_major}:2 rw"} <= set(plan.cgroup_rules)
    assert (inv.mig.config_cap.minor, inv.mig.monitor_cap.minor) == (1, 2)


def test_requirements_are_checked_per_gpu(two):
    ok = plan_of({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.4"}, two)
    assert ok.gpu
    with pytest.raises(NvcError) as err:
        plan_of({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.5"}, two)
    line = err.value.line()
    assert line.startswith("nvcontainer: requirement error: unsatisfied condition: cuda>=12.5")
    assert "12.4" in line and "550.54.14" in line
    # arch 7.5 is GPU 1 (T4): fails there, passes on GPU 0 (8.0)
    plan_of({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_ARCH": "arch>=8.0"}, two)
    with pytest.raises(NvcError, match="GPU 1"):
        plan_of({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_ARCH": "arch>=8.0"}, two)
    assert plan_of({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_REQUIRE_ARCH": "arch>=8.0",
                    "NVIDIA_DISABLE_REQUIRE": "true"}, two).gpu


def test_unknown_device_and_capability(two):
    with pytest.raises(NvcError, match="device error: 5: unknown device"):
        plan_of({"NVIDIA_VISIBLE_DEVICES": "5"}, two)
    with pytest.raises(NvcError, match="unsupported capabilities"):
        plan_of({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,bogus"}, two)


@pytest.mark.parametrize("compat_major,expect_drop_in", [(560, True), (550, False), (535, False)])
def test_cuda_compat_only_when_newer(two, compat_major, expect_drop_in):
    facts = ContainerFacts(
        libs_dir=DEBIAN.libs_dir, libs32_dir=DEBIAN.libs32_dir, debian=True,
        compat=(CompatLib(f"/usr/local/cuda/compat/libcuda.so.{compat_major}.1.1", f"{compat_major}.1.1", compat_major),),
    )
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "0"}, two, container=facts)
    drop_ins = [f for f in plan.files if f.path == COMPAT_DROP_IN]
    assert bool(drop_ins) == expect_drop_in
    if expect_drop_in:
        assert drop_ins[0].content == "/usr/local/cuda/compat\n"
        assert plan.ldconfig.directories[0] == "/usr/local/cuda/compat"
    # never a mount of anything from the image
    assert not any(m.source.startswith("/usr/local/cuda") for m in plan.mounts)
    disabled = plan_of({"NVIDIA_VISIBLE_DEVICES": "0"}, two, container=facts,
                       options=PlanOptions(cuda_compat_mode="disabled"))
    assert not disabled.files


def test_options_drop_pieces(two):
    plan = plan_of({"NVIDIA_VISIBLE_DEVICES": "0"}, two,
                   options=PlanOptions(no_gsp_firmware=True, no_persistenced=True, no_cgroups=True, no_devbind=True))
    targets = [m.target for m in plan.mounts]
    assert not any("firmware" in t for t in targets)
    assert "/run/nvidia-persistenced/socket" not in targets
    assert "/run/nvidia-fabricmanager/socket" in targets
    assert plan.cgroups is False and plan.devbind is False
    assert plan.cgroup_rules  # still computed: --no-devbind keeps rules, --no-cgroups skips applying


def test_cgroup_rules_are_exactly_the_devices(two, mig):
    for fixture, env in ((two, {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"}),
                         (mig, {"NVIDIA_VISIBLE_DEVICES": "0:1"})):
        plan = plan_of(env, fixture)
        assert list(plan.cgroup_rules) == [f"c {d.major}:{d.minor} rw" for d in plan.devices]


def test_plan_json_schema(two):
    data = json.loads(plan_of({"NVIDIA_VISIBLE_DEVICES": "0"}, two).dumps())
    assert {"gpu", "mounts", "devices", "symlinks", "cgroup_rules", "ldconfig"} <= set(data)
    assert set(data["mounts"][0]) >= {"source", "target", "options"}
    assert set(data["devices"][0]) >= {"path", "major", "minor"}
    assert set(data["symlinks"][0]) == {"link", "target"}
    assert data["cgroup_rules"][0] == "c 195:255 rw"
    assert data["ldconfig"]["directories"] == ["/usr/lib/x86_64-linux-gnu"]
