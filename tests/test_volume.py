"""The consolidated driver volume: its contents, the atomic builder, the label and the plan."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from nvcontainer.records import replace

import pytest

from nvcontainer.apply import volume as volumes
from nvcontainer.plan import volume
from nvcontainer.config.model import Config
from nvcontainer.plan.gather import host_proc
from nvcontainer.errors import NvcError
from nvcontainer.inventory.build import build
from nvcontainer.plan.build import PlanOptions, build_plan
from nvcontainer.plan.container import ContainerFacts
from nvcontainer.request.decide import CAPABILITIES, request_from_env
from tests.fixtures.fakegpu import FakeSpec, run_in_fake_proc

DEBIAN = ContainerFacts(libs_dir="/usr/lib/x86_64-linux-gnu", libs32_dir="/usr/lib/i386-linux-gnu", debian=True)
ALL = frozenset(CAPABILITIES)
LABEL = {"com.nvidia.volumes.needed": "nvidia_driver"}


@pytest.fixture(scope="module")
def two(fake_machine_factory):
    m = fake_machine_factory(FakeSpec(gpus=2))
    return m, build(str(m.root), proc=str(m.proc))


def base_dir(tmp_path) -> str:
    d = tmp_path / "volumes"
    d.mkdir(mode=0o700)
    return str(d)


def tree(path: str) -> dict[str, str]:
    """relative path → "link:<target>" or "file" for everything under ``path``."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for n in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, path)
            out[rel] = f"link:{os.readlink(full)}" if os.path.islink(full) else "file"
    return out


def test_entries_follow_the_inventory(two):
    machine, inv = two
    truth = machine.description()
    got = {e.path: e for e in volume.entries(inv, ALL, compat32=True)}
    for lib in truth["libraries"]:
        name = os.path.basename(lib["path"])
        assert got[f"lib64/{name}"].source == f"{machine.root}{lib['path']}"
    for lib in truth["libraries32"]:
        assert f"lib/{os.path.basename(lib['path'])}" in got
    for b in truth["binaries"]:
        assert got[f"bin/{os.path.basename(b['path'])}"].source == f"{machine.root}{b['path']}"
    assert got["lib64/libcuda.so.1"].target.startswith("libcuda.so.")
    # the capability filter and compat32 narrow it
    narrow = {e.path for e in volume.entries(inv, frozenset({"utility"}), compat32=False)}
    assert "lib64/libcuda.so.1" not in narrow and any(p.startswith("lib64/libnvidia-ml.so") for p in narrow)
    assert not any(p.startswith("lib/") for p in narrow)


def test_create_links_the_driver_files_and_rerun_is_a_no_op(two, tmp_path):
    machine, inv = two
    base = base_dir(tmp_path)
    res = volumes.create(base, inv, ALL, compat32=True)
    assert res.created and res.copied == 0
    assert res.path == f"{base}/nvidia_{inv.driver_version}"
    want = {e.path: (f"link:{e.target}" if e.target else "file") for e in volume.entries(inv, ALL, True)}
    assert tree(res.path) == want
    cuda = next(e for e in volume.entries(inv, ALL, True) if e.path.startswith("lib64/libcuda.so.5"))
    assert os.stat(f"{res.path}/{cuda.path}").st_ino == os.stat(cuda.source).st_ino   # a hard link
    assert stat.S_IMODE(os.stat(res.path).st_mode) == 0o755
    inode = os.stat(res.path).st_ino
    again = volumes.create(base, inv, ALL, compat32=True)
    assert not again.created and os.stat(res.path).st_ino == inode
    assert sorted(os.listdir(base)) == [f"nvidia_{inv.driver_version}"]   # no temporary left


def test_other_contents_replace_the_volume_and_a_new_version_is_a_new_directory(two, tmp_path):
    machine, inv = two
    base = base_dir(tmp_path)
    first = volumes.create(base, inv, ALL, compat32=True).path
    os.unlink(f"{first}/lib64/libcuda.so.1")   # damaged
    fixed = volumes.create(base, inv, ALL, compat32=True)
    assert fixed.created and os.readlink(f"{first}/lib64/libcuda.so.1").startswith("libcuda.so.")
    newer = volumes.create(base, replace(inv, driver_version="999.1.2"), frozenset({"utility"}), compat32=False)
    assert newer.path == f"{base}/nvidia_999.1.2"
    assert [v.version for v in volumes.list_volumes(base)] == sorted([inv.driver_version, "999.1.2"])
    assert volumes.remove(base, "999.1.2") == newer.path
    assert [v.version for v in volumes.list_volumes(base)] == [inv.driver_version]
    with pytest.raises(NvcError, match="no volume"):
        volumes.remove(base, "999.1.2")
    with pytest.raises(NvcError, match="invalid driver version"):
        volumes.remove(base, "../etc")


def test_copies_across_filesystems(two):
    machine, inv = two
    if os.stat("/dev/shm").st_dev == os.stat(machine.root).st_dev:
        pytest.skip("/dev/shm is on the same filesystem as the fake machine")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        base = os.path.join(shm, "v")
        res = volumes.create(base, inv, ALL, compat32=False)
        files = [e for e in volume.entries(inv, ALL, False) if not e.target]
        assert res.copied == len(files) > 0
        for e in files:
            with open(e.source, "rb") as a, open(f"{res.path}/{e.path}", "rb") as b:
                assert a.read() == b.read()
        assert not volumes.create(base, inv, ALL, compat32=False).created   # copies are recognised
        assert stat.S_IMODE(os.stat(base).st_mode) == 0o700


def test_hostile_base_directories_are_refused(two, tmp_path):
    machine, inv = two
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(NvcError, match="cannot open"):
        volumes.create(str(tmp_path / "link"), inv, ALL, False)
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(NvcError, match="writable by it only"):
        volumes.create(str(tmp_path / "open"), inv, ALL, False)
    # a planted symlink named like the temporary directory is removed, never followed
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    os.symlink(victim, real / f".nvidia_{inv.driver_version}.tmp-{os.getpid()}")
    volumes.create(str(real), inv, ALL, False)
    assert (victim / "keep").read_text() == "x" and os.listdir(victim) == ["keep"]


def test_label_requests_the_volume(two):
    privileged = request_from_env({}, Config(), privileged=True, annotations=LABEL)
    assert privileged.gpu and privileged.driver_volume and privileged.devices == ()
    with_devices = request_from_env({"NVIDIA_VISIBLE_DEVICES": "1"}, Config(), privileged=False, annotations=LABEL)
    assert with_devices.driver_volume and with_devices.devices == ("1",)
    other = request_from_env({}, Config(), privileged=True, annotations={"com.nvidia.volumes.needed": "other"})
    assert not other.gpu
    strict = Config(accept_envvar_unprivileged=False)
    refused = request_from_env({}, strict, privileged=False, annotations=LABEL)
    assert not refused.gpu and any("com.nvidia.volumes.needed" in w for w in refused.warnings)


def test_plan_binds_the_volume_instead_of_files(two):
    machine, inv = two
    hp = host_proc(str(machine.proc))
    request = request_from_env({"NVIDIA_VISIBLE_DEVICES": "1", "NVIDIA_DRIVER_CAPABILITIES": "all"}, Config(),
                               privileged=False, annotations=LABEL)
    plan = build_plan(request, inv, DEBIAN, hp, PlanOptions(driver_volume_dir="/srv/vol"), rootfs="/r", pid=1)
    (vol,) = [m for m in plan.mounts if m.target == "/usr/local/nvidia"]
    assert vol.source == f"/srv/vol/nvidia_{inv.driver_version}" and vol.kind == "dir"
    assert vol.options == ("ro", "nosuid", "nodev")
    assert not [m for m in plan.mounts if m.target.startswith(("/usr/lib/x86_64", "/usr/lib/i386", "/usr/bin"))]
    assert any(m.target.startswith("/usr/lib/firmware/") for m in plan.mounts)   # the rest as usual
    # the volume has the libraries' links and stands for the graphics files too; the devices are
    # as usual, GPU 1's DRI nodes and their by-path links included
    assert [s.link for s in plan.symlinks] == [f"/dev/dri/by-path/pci-0000:0f:00.0-{k}" for k in ("card", "render")]
    assert not [m for m in plan.mounts if m.target.startswith(("/etc/vulkan", "/usr/share", "/usr/lib/xorg"))]
    assert plan.ldconfig.directories == ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib")
    assert [d.path for d in plan.devices if d.path.startswith("/dev/nvidia") and d.path[11:].isdigit()] \
        == ["/dev/nvidia1"]


CLI = [sys.executable, "-m", "nvcontainer"]


def test_cli_create_list_remove(two, tmp_path):
    machine, inv = two
    base = base_dir(tmp_path)

    def cli(*args):
        return run_in_fake_proc(machine, [*CLI, "--root", str(machine.root), "volume", *args],
                                capture_output=True, text=True, timeout=120)

    res = cli("create", base, "--capabilities", "utility,compute")
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"created {base}/nvidia_{inv.driver_version}\n"
    assert cli("create", base, "--capabilities", "utility,compute").stdout.startswith("unchanged ")
    listed = cli("list", base)
    assert listed.stdout.split()[0] == inv.driver_version
    bad = cli("create", base, "--capabilities", "bogus")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "bogus" in bad.stderr
    assert cli("remove", base, inv.driver_version).returncode == 0
    assert cli("list", base).stdout == ""
    assert subprocess.run([*CLI, "volume", "remove", base, "1.2"], capture_output=True).returncode == 1
