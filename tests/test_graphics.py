"""Graphics and display (issue 15.13): what the inventory finds, what a plan gives, what ``list``
shows. Expectations come from the fake machine's own description of what it laid out and from
where NVIDIA's CDI generator puts these files (REFERENCE §2.5, §2.7), never from nvcontainer.
Runtime proofs are in test_e2e_runtimes.py, test_runtime_shim.py and test_cdi_podman.py."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from nvcontainer import log
from nvcontainer.config.model import Config
from nvcontainer.inventory.build import build
from nvcontainer.plan.build import PlanOptions, build_plan
from nvcontainer.plan.container import ContainerFacts
from nvcontainer.plan.gather import host_proc
from nvcontainer.request.decide import request_from_env
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu import build as build_machine
from tests.fixtures.fakegpu.plugin import _skip_reason
from tests.fixtures.fakegpu.runner import run_in_fake_proc

DEBIAN = ContainerFacts(libs_dir="/usr/lib/x86_64-linux-gnu", libs32_dir="/usr/lib/i386-linux-gnu", debian=True)
LIB = ("ro", "nosuid", "nodev")


@pytest.fixture(scope="module")
def mig(fake_machine_factory):
    m = fake_machine_factory(FakeSpec(gpus=2, mig=True))
    return m, build(str(m.root), proc=str(m.proc))


def plan_for(machine_inv, env, options=PlanOptions()):
    machine, inv = machine_inv
    request = request_from_env({"NVIDIA_VISIBLE_DEVICES": "all", **env}, Config(), privileged=False)
    return build_plan(request, inv, DEBIAN, host_proc(str(machine.proc)), options, rootfs="/rootfs", pid=42)


def dri(gpu: dict) -> list[tuple[str, int, int]]:
    return [(n["path"], n["major"], n["minor"]) for n in gpu["dri"]]


# --- inventory -----------------------------------------------------------------------------------


def test_inventory_finds_what_the_machine_has(mig):
    machine, inv = mig
    desc = machine.description()
    for gpu, want in zip(inv.gpus, desc["gpus"]):
        assert [(n.path, n.major, n.minor) for n in gpu.dri] == dri(want)
        assert [n.path.rsplit("/", 1)[1][:4] for n in gpu.dri] == ["card", "rend"]
    files = {(f.name, f.path, f.group, f.kind) for f in inv.graphics if f.kind != "library"}
    assert files == {(f["name"], f["path"], f["group"], f["kind"]) for f in desc["graphics"]["files"]}
    libs = [(f.path, f.soname, [list(link) for link in f.links]) for f in inv.graphics if f.kind == "library"]
    assert libs == [(lib["path"], lib["soname"], lib["links"]) for lib in desc["graphics"]["libraries"]]
    # the EGL vendor file is a symlink on the host: the real file, found where libglvnd looks
    vendor = next(f for f in inv.graphics if f.name == "/usr/share/glvnd/egl_vendor.d/10_nvidia.json")
    assert vendor.path == "/usr/share/nvidia/egl_vendor.json"
    glx = next(f for f in inv.graphics if "libglxserver" in f.name)
    assert glx.links == (("libglxserver_nvidia.so", f"libglxserver_nvidia.so.{desc['driver_version']}"),)
    # upstream's list does not change: none of this is among the driver's libraries
    assert not {f.path for f in inv.graphics} & {lib.path for lib in inv.libraries}


@pytest.mark.parametrize("piece", ["drm", "vulkan", "egl", "xorg"])
def test_missing_graphics_pieces_are_not_errors(fake_machine_factory, piece):
    machine = fake_machine_factory(FakeSpec(missing=frozenset({piece})))
    inv = build(str(machine.root), proc=str(machine.proc))
    names = {f.name for f in inv.graphics}
    assert all(g.dri == () for g in inv.gpus) == (piece == "drm")
    assert ("/etc/vulkan/icd.d/nvidia_icd.json" in names) == (piece != "vulkan")
    assert ("/usr/share/glvnd/egl_vendor.d/10_nvidia.json" in names) == (piece != "egl")
    assert ("libnvidia-egl-wayland.so" in names) == (piece != "egl")
    assert ("/usr/lib/xorg/modules/drivers/nvidia_drv.so" in names) == (piece != "xorg")


@pytest.fixture
def private(tmp_path):
    """A private machine whose driver root a test may damage."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path / "m"
    base.mkdir()
    return build_machine(base, FakeSpec(gpus=2))


def test_dri_nodes_are_checked_against_sysfs_and_st_rdev(private, tmp_path):
    """A node with other numbers than sysfs gives, a sysfs ``dev`` that says nonsense, or a
    regular file in a node's place: that node is left out with a warning, the rest stays, and
    nothing fails (graphics is never worth failing a container for)."""
    root = private.root
    card1 = root / "dev/dri/card1"
    card1.unlink()
    os.mknod(card1, 0o666 | 0o020000, os.makedev(226, 7))                 # wrong minor
    render = next((root / "sys/devices/pci0000:00").glob("*/drm/renderD129/dev"))
    render.write_text("226:oops\n")                                       # nonsense in sysfs
    (root / "dev/dri/card2").unlink()
    (root / "dev/dri/card2").write_text("not a node")                     # not a character device
    log_file = tmp_path / "debug.log"
    log.open_debug(str(log_file))
    try:
        inv = build(str(root), proc=str(private.proc))
    finally:
        log.close()
    assert [n.path for g in inv.gpus for n in g.dri] == ["/dev/dri/renderD130"]
    text = log_file.read_text()
    assert "skipping /dev/dri/card1: invalid device node: /dev/dri/card1: expected 226:1, found 226:7" in text
    assert "skipping /dev/dri/renderD129: sysfs does not give it 226:129" in text
    assert "skipping /dev/dri/card2" in text


def test_sysfs_is_read_inside_the_driver_root(private):
    """An absolute link in the driver root's sysfs stays in the root: it never reaches the
    host's /sys (here: a directory of the root that looks like a GPU with other nodes)."""
    root = private.root
    bus = private.description()["gpus"][0]["proc_bus_id"]
    link = root / "sys/bus/pci/devices" / bus
    link.unlink()
    os.symlink(f"/sys/devices/pci0000:00/{bus}", link)   # absolute: means <root>/sys/... here
    inv = build(str(root), proc=str(private.proc))
    assert [n.path for n in inv.gpus[0].dri] == ["/dev/dri/card1", "/dev/dri/renderD129"]
    shutil.rmtree(root / "sys/devices/pci0000:00" / bus)
    assert build(str(root), proc=str(private.proc)).gpus[0].dri == ()


def test_a_huge_sysfs_directory_is_read_bounded(private):
    drm = next((private.root / "sys/devices/pci0000:00").glob("*/drm"))
    for i in range(200):
        (drm / f"junk{i}").mkdir()
    inv = build(str(private.root), proc=str(private.proc))   # bounded listing: no error, maybe fewer nodes
    assert len(inv.gpus[0].dri) <= 2


# --- plan ------------------------------------------------------------------------------------------


def test_compute_gets_no_graphics(mig):
    plan = plan_for(mig, {})
    assert not [d for d in plan.devices if d.major == 226]
    assert not [m for m in plan.mounts if "vulkan" in m.target or "egl" in m.target or "xorg" in m.target]
    assert not [s for s in plan.symlinks if s.link.startswith("/dev/dri")]


def test_graphics_plan(mig):
    machine, inv = mig
    desc = machine.description()
    root = str(machine.root)
    plan = plan_for(mig, {"NVIDIA_DRIVER_CAPABILITIES": "graphics"})
    nodes = [(d.path, d.major, d.minor) for d in plan.devices if d.major == 226]
    assert nodes == dri(desc["gpus"][0]) + dri(desc["gpus"][1])
    assert all(d.source == root + d.path for d in plan.devices)
    assert {f"c 226:{minor} rw" for _, _, minor in nodes} <= set(plan.cgroup_rules)
    mounts = {m.target: m for m in plan.mounts}
    for f in desc["graphics"]["files"]:
        if f["group"] == "graphics":     # config files land where the loaders look, read-only
            assert (mounts[f["name"]].source, mounts[f["name"]].options) == (root + f["path"], LIB)
        else:                            # Xorg is display's
            assert f["name"] not in mounts
    for lib in desc["graphics"]["libraries"]:
        target = f"{DEBIAN.libs_dir}/{lib['path'].rsplit('/', 1)[1]}"
        assert (mounts[target].source, mounts[target].options) == (root + lib["path"], LIB)
    links = {s.link: s.target for s in plan.symlinks}
    assert links["/usr/lib/x86_64-linux-gnu/libnvidia-egl-wayland.so.1"] == "libnvidia-egl-wayland.so.1.1.13"
    for gpu in desc["gpus"]:
        card, render = (n["path"].rsplit("/", 1)[1] for n in gpu["dri"])
        assert links[f"/dev/dri/by-path/pci-{gpu['proc_bus_id']}-card"] == f"../{card}"
        assert links[f"/dev/dri/by-path/pci-{gpu['proc_bus_id']}-render"] == f"../{render}"
    assert not any("modeset" in d.path for d in plan.devices)


def test_display_adds_xorg(mig):
    machine, _ = mig
    desc = machine.description()
    plan = plan_for(mig, {"NVIDIA_DRIVER_CAPABILITIES": "display", "NVIDIA_VISIBLE_DEVICES": "1"})
    mounts = {m.target: m.source for m in plan.mounts}
    for f in desc["graphics"]["files"]:
        assert mounts[f["name"]] == str(machine.root) + f["path"]
    glx = f"libglxserver_nvidia.so.{desc['driver_version']}"
    assert ("/usr/lib/xorg/modules/extensions/libglxserver_nvidia.so", glx) in {(s.link, s.target) for s in plan.symlinks}
    # only GPU 1's DRI nodes: the other GPU's are not the container's
    assert [(d.path, d.major, d.minor) for d in plan.devices if d.major == 226] == dri(desc["gpus"][1])
    assert any(d.path == "/dev/nvidia-modeset" for d in plan.devices)


def test_a_mig_device_brings_no_dri_nodes(mig):
    """As upstream's generator: a MIG device has no graphics engine of its own to render on;
    its parent GPU's nodes come only when the GPU itself is asked for."""
    machine, _ = mig
    desc = machine.description()
    mig1 = desc["gpus"][0]["migs"][1]["uuid"]
    plan = plan_for(mig, {"NVIDIA_DRIVER_CAPABILITIES": "graphics", "NVIDIA_VISIBLE_DEVICES": mig1})
    assert not [d for d in plan.devices if d.major == 226]
    plan = plan_for(mig, {"NVIDIA_DRIVER_CAPABILITIES": "graphics", "NVIDIA_VISIBLE_DEVICES": f"{mig1},0"})
    assert [(d.path, d.major, d.minor) for d in plan.devices if d.major == 226] == dri(desc["gpus"][0])


# --- list --------------------------------------------------------------------------------------------

NVCONTAINER = [sys.executable, "-m", "nvcontainer"]


def listed(machine, *args) -> str:
    res = run_in_fake_proc(machine, [*NVCONTAINER, "--root", str(machine.root), "list", *args],
                           capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    return res.stdout


def test_list_graphics_and_display(mig):
    machine, _ = mig
    desc = machine.description()
    plain = listed(machine, "-d", "1").splitlines()
    files = [f["name"] for f in desc["graphics"]["files"] if f["group"] == "graphics"]
    libs = [lib["path"] for lib in desc["graphics"]["libraries"]]
    xorg = [f["name"] for f in desc["graphics"]["files"] if f["group"] == "display"]
    nodes = [n["path"] for n in desc["gpus"][1]["dri"]]
    out = listed(machine, "-d", "1", "--graphics").splitlines()
    assert out[:len(plain)] == plain                             # upstream's lines first, untouched
    assert sorted(out[len(plain):]) == sorted(nodes + files + libs)
    assert out[len(plain):len(plain) + 2] == nodes
    display = listed(machine, "-d", "1", "-D").splitlines()
    assert sorted(display[len(plain):]) == sorted(nodes + files + libs + xorg)
    assert listed(machine, "-g").splitlines() == [line for line in out[len(plain):] if line not in nodes]
    sections = json.loads(listed(machine, "-d", "1", "-g", "--json"))
    assert sections["graphics"] == out[len(plain):]
    # upstream's own cases stay as they were: nothing of this without the option
    everything = listed(machine)
    assert "/dev/dri/" not in everything and "vulkan" not in everything and json.loads(listed(machine, "--json"))["graphics"] == []
