"""The per-boot inventory cache: served only when it is provably current, never trusted blindly.

Each test gets a private fake machine (its NVML config, procfs and driver root are edited here)
and its own cache directory. "NVML was not asked" is proven the hardware way: the mock NVML is
made to fail (``init_error``), so any code path that initialises NVML raises.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from nvcontainer.records import replace
from pathlib import Path

import pytest

from nvcontainer import log
from nvcontainer.config.model import Config
from nvcontainer.errors import NvcError
from nvcontainer.inventory import cache, cachefile
from nvcontainer.inventory.build import build
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu import build as build_machine
from tests.fixtures.fakegpu.plugin import _skip_reason
from tests.fixtures.fakegpu.runner import run_in_fake_proc

BOOT_ID = "0b6f5b1e-0000-4000-8000-000000000001"
NOBODY = 65534


@pytest.fixture(scope="module")
def machine_base():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="nvc-cache-test-"))
    base.chmod(0o755)   # the NVML helper runs as nobody and must read the driver root
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def machine(machine_base, request):
    """A private machine (MIG on GPU 0, so MIG state is part of what is checked) with a boot id."""
    dest = machine_base / request.node.name.replace("[", "-").replace("]", "")
    dest.mkdir(mode=0o755)
    m = build_machine(dest, FakeSpec(gpus=2, mig=True))
    boot = m.proc / "sys/kernel/random"
    boot.mkdir(parents=True)
    (boot / "boot_id").write_text(BOOT_ID + "\n")
    return m


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


def config_for(machine, cache_dir, **changes) -> Config:
    return replace(Config(root=str(machine.root), cache_dir=str(cache_dir)), **changes)


def inventory(machine, cfg, **kw):
    return cache.cached_inventory(cfg, proc=str(machine.proc), **kw)


def break_nvml(machine) -> None:
    """From now on every NVML initialisation fails (NVML_ERROR_DRIVER_NOT_LOADED)."""
    text = machine.nvml_config.read_text().replace("init_error=0", "init_error=9")
    machine.nvml_config.write_text(text)


def entries(cache_dir) -> list[Path]:
    return sorted(cache_dir.glob("inventory-*.json"))


def the_entry(cache_dir) -> Path:
    (entry,) = entries(cache_dir)
    return entry


# --- hits and misses -----------------------------------------------------------------------------


def test_second_start_reads_the_cache_without_nvml(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    first = inventory(machine, cfg)
    assert first == build(str(machine.root), proc=str(machine.proc))   # the cache changes nothing
    break_nvml(machine)
    assert inventory(machine, cfg) == first
    with pytest.raises(NvcError, match="driver not loaded"):
        build(str(machine.root), proc=str(machine.proc))   # NVML really is broken now


def test_a_hit_says_what_the_build_warned_about(machine, cache_dir, tmp_path):
    trace = tmp_path / "debug.log"
    cfg = config_for(machine, cache_dir)
    log.open_debug(str(trace))
    try:
        inventory(machine, cfg)
        inventory(machine, cfg)
    finally:
        log.close()
    lines = trace.read_text().splitlines()
    missing = [line.split("] ", 1)[1] for line in lines if "] missing " in line]
    assert missing and len(missing) % 2 == 0
    assert missing[: len(missing) // 2] == missing[len(missing) // 2:]   # the same warnings, again
    assert any("inventory from cache" in line for line in lines)


def test_refresh_asks_nvml_again(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    break_nvml(machine)
    with pytest.raises(NvcError, match="driver not loaded"):
        inventory(machine, cfg, refresh=True)


def test_entries_are_keyed_by_root_ldcache_and_user(machine, cache_dir):
    base = config_for(machine, cache_dir)
    variants = [base, replace(base, ldcache="/etc/ld.so.cache.compat"), replace(base, user="0:0")]
    for cfg in variants:
        inventory(machine, cfg)
    assert len(entries(cache_dir)) == 3
    inputs = [json.loads(p.read_text())["inputs"] for p in entries(cache_dir)]
    assert sorted((i["ldcache"], str(i["user"])) for i in inputs) == sorted(
        [("/etc/ld.so.cache", "None"), ("/etc/ld.so.cache.compat", "None"), ("/etc/ld.so.cache", "0:0")])


def test_another_root_never_gets_this_roots_entry(machine, cache_dir, machine_base):
    other = build_machine(machine_base / "other", FakeSpec(gpus=1))
    mine = inventory(machine, config_for(machine, cache_dir))
    theirs = cache.cached_inventory(config_for(other, cache_dir), proc=str(other.proc))
    assert len(mine.gpus) == 2 and len(theirs.gpus) == 1
    assert theirs.root == str(other.root)


def test_new_boot_initialises_nvml(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    (machine.proc / "sys/kernel/random/boot_id").write_text("0b6f5b1e-0000-4000-8000-000000000002\n")
    break_nvml(machine)
    with pytest.raises(NvcError, match="driver not loaded"):
        inventory(machine, cfg)


def test_reloaded_driver_initialises_nvml(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    version = machine.proc / "driver/nvidia/version"
    version.write_text(version.read_text().replace("Thu Feb 22", "Fri Feb 23"))   # same version, rebuilt module
    break_nvml(machine)
    with pytest.raises(NvcError, match="driver not loaded"):
        inventory(machine, cfg)


def test_mig_instance_created_initialises_nvml(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    gi = machine.proc / "driver/nvidia/capabilities/gpu0/mig/gi9"
    gi.mkdir()
    (gi / "access").write_text("DeviceFileMinor: 84\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    break_nvml(machine)
    with pytest.raises(NvcError, match="driver not loaded"):
        inventory(machine, cfg)


def test_new_ld_cache_rescans_files_but_keeps_nvml_answers(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    before = inventory(machine, cfg)
    ldcache = machine.root / "etc/ld.so.cache"
    data = ldcache.read_bytes()
    ldcache.unlink()
    ldcache.write_bytes(data)   # what ldconfig does: a new file in its place
    break_nvml(machine)
    assert inventory(machine, cfg) == before
    entry = json.loads(the_entry(cache_dir).read_text())
    assert [p for p, _ in entry["watch"] if p == str(ldcache)]
    assert entry["watch"][0][1][1] == os.stat(ldcache).st_ino   # re-recorded: the new file


def test_device_node_change_is_seen(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    before = inventory(machine, cfg)
    assert "/dev/nvidia-modeset" in [n.path for n in before.ctl_devices]
    (machine.root / "dev/nvidia-modeset").unlink()
    break_nvml(machine)
    after = inventory(machine, cfg)
    assert "/dev/nvidia-modeset" not in [n.path for n in after.ctl_devices]


def test_replaced_library_is_seen(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    before = inventory(machine, cfg)
    lib = next(f for f in before.libraries if f.name == "libcuda.so")
    host = machine.root / lib.path.lstrip("/")
    host.unlink()
    host.write_bytes(b"not an ELF object")   # a cached answer would mount this as libcuda
    after = inventory(machine, cfg)
    assert "libcuda.so" not in [f.name for f in after.libraries]


def test_a_binary_appearing_in_the_driver_s_own_bin_is_seen(machine, cache_dir):
    """The bin beside the NVML library's directory is searched after the PATH (where
    /usr/bin/nvidia-smi is only a wrapper script): a binary put there later must be noticed."""
    cfg = config_for(machine, cache_dir)
    before = inventory(machine, cfg)
    nvml = next(f.path for f in before.libraries if f.name == "libnvidia-ml.so")
    driver_bin = machine.root / os.path.dirname(os.path.dirname(nvml)).lstrip("/") / "bin"
    assert not driver_bin.exists()
    smi = machine.root / "usr/bin/nvidia-smi"
    elf = smi.read_bytes()
    smi.unlink()
    smi.write_text("#!/bin/sh\nexec /opt/driver/nvidia-smi \"$@\"\n")   # what a driver tree's wrapper does
    smi.chmod(0o755)
    break_nvml(machine)
    assert "nvidia-smi" not in [f.name for f in inventory(machine, cfg).binaries]
    driver_bin.mkdir()
    (driver_bin / "nvidia-smi").write_bytes(elf)
    (driver_bin / "nvidia-smi").chmod(0o755)
    after = inventory(machine, cfg)
    assert [f.path for f in after.binaries if f.name == "nvidia-smi"] == [f"{nvml.rsplit('/', 2)[0]}/bin/nvidia-smi"]


def test_new_persistenced_socket_is_seen(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    before = inventory(machine, cfg)
    sock = next(f for f in before.ipcs if f.name == "persistenced")
    (machine.root / sock.path.lstrip("/")).unlink()
    assert "persistenced" not in [f.name for f in inventory(machine, cfg).ipcs]


def test_a_busy_tmp_is_not_a_miss_but_the_mps_directory_is_seen(machine, cache_dir):
    """The MPS pipe directory's parent, /tmp, is written by anything on a node (ctr makes a FIFO
    directory there for every container it runs): only the pipe directory itself is watched, so
    the entry stays a hit; the directory appearing is still a miss that finds it."""
    tmp = machine.root / "tmp"
    shutil.rmtree(tmp / "nvidia-mps")   # the fake machine has one: start without
    cfg = config_for(machine, cache_dir)
    before = inventory(machine, cfg)
    assert "mps" not in [f.name for f in before.ipcs]
    written = the_entry(cache_dir).stat().st_ino
    (tmp / "ctr-12345").mkdir()
    (tmp / "ctr-12345").rmdir()
    (tmp / "unrelated").write_text("x")
    assert inventory(machine, cfg) == before
    assert the_entry(cache_dir).stat().st_ino == written   # a hit: not rebuilt, not rewritten
    (tmp / "nvidia-mps").mkdir()
    assert "mps" in [f.name for f in inventory(machine, cfg).ipcs]
    assert the_entry(cache_dir).stat().st_ino != written


def test_graphics_changes_are_seen(machine, cache_dir):
    """What graphics.py finds is kept in the entry and re-validated: a Vulkan ICD installed
    under another search directory, a DRI node gone, a GPU's DRM device gone from sysfs (the
    nvidia-drm module unloaded), without asking NVML again."""
    cfg = config_for(machine, cache_dir)
    before = inventory(machine, cfg)
    assert before.gpus[0].dri and before.gpus[1].dri
    assert "/usr/share/vulkan/icd.d/nvidia_icd.json" not in [f.name for f in before.graphics]
    break_nvml(machine)
    assert inventory(machine, cfg) == before   # a hit, NVML untouched
    icd = machine.root / "usr/share/vulkan/icd.d/nvidia_icd.json"
    icd.parent.mkdir(parents=True)
    icd.write_text("{}")
    assert "/usr/share/vulkan/icd.d/nvidia_icd.json" in [f.name for f in inventory(machine, cfg).graphics]
    wayland2 = machine.root / "usr/share/egl/egl_external_platform.d/09_nvidia_wayland2.json"   # an existing directory
    wayland2.write_text("{}")
    assert "/usr/share/egl/egl_external_platform.d/09_nvidia_wayland2.json" in [
        f.name for f in inventory(machine, cfg).graphics]
    (machine.root / before.gpus[1].dri[1].path.lstrip("/")).unlink()
    assert [n.path for n in inventory(machine, cfg).gpus[1].dri] == [before.gpus[1].dri[0].path]
    bus = before.gpus[0].bus_id[4:]
    shutil.rmtree(machine.root / f"sys/devices/pci0000:00/{bus}/drm")
    assert inventory(machine, cfg).gpus[0].dri == ()


def test_a_change_of_path_is_another_entry(machine, cache_dir, monkeypatch):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    monkeypatch.setenv("PATH", "/usr/bin")
    inventory(machine, cfg)
    assert len(entries(cache_dir)) == 2


def test_a_resident_process_rechecks_the_world_but_does_not_reparse(machine, cache_dir, monkeypatch):
    """nvcontainer serve's children inherit the parsed entry; they must still see every change."""
    cfg = config_for(machine, cache_dir)
    first = inventory(machine, cfg)
    reads = []
    real = cache.read_entry
    monkeypatch.setattr(cache, "read_entry", lambda dfd, name: reads.append(name) or real(dfd, name))
    assert inventory(machine, cfg) == first and reads == []        # recalled, not read
    os.utime(the_entry(cache_dir))                                  # the file was touched: read it
    assert inventory(machine, cfg) == first and len(reads) == 1
    assert inventory(machine, cfg) == first and len(reads) == 1    # and remembered again
    (machine.root / "dev/nvidia-modeset").unlink()                  # the world changed: rebuilt
    changed = inventory(machine, cfg)
    assert "/dev/nvidia-modeset" not in [n.path for n in changed.ctl_devices] and len(reads) >= 2
    (machine.proc / "sys/kernel/random/boot_id").write_text("another boot\n")
    break_nvml(machine)
    with pytest.raises(NvcError, match="driver not loaded"):       # a reboot is never recalled
        inventory(machine, cfg)


# --- never trusted ----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", [
    "garbage", "truncated", "wrong type", "missing field", "extra field", "bad minors", "not an object",
])
def test_damaged_entry_is_ignored_and_rebuilt(machine, cache_dir, damage):
    cfg = config_for(machine, cache_dir)
    good = inventory(machine, cfg)
    path = the_entry(cache_dir)
    text = path.read_text()
    entry = json.loads(text)
    if damage == "garbage":
        text = "\x00\xffnot json"
    elif damage == "truncated":
        text = text[: len(text) // 2]
    elif damage == "not an object":
        text = "[1, 2, 3]"
    else:
        if damage == "wrong type":
            entry["inventory"]["gpus"][0]["minor"] = "0"
        elif damage == "missing field":
            del entry["inventory"]["gpus"][1]["uuid"]
        elif damage == "extra field":
            entry["inventory"]["libraries"][0]["evil"] = "/etc/shadow"
        elif damage == "bad minors":
            entry["mig_minors"][1][0] = "1"
        text = json.dumps(entry)
    path.write_text(text)
    assert inventory(machine, cfg) == good
    assert json.loads(the_entry(cache_dir).read_text())["inventory"] == json.loads(
        json.dumps(cache.inventory_to_json(good)[0]))   # replaced by a good one


def test_entry_of_another_owner_is_ignored_and_replaced(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    path = the_entry(cache_dir)
    entry = json.loads(path.read_text())
    entry["inventory"]["gpus"][0]["model"] = "Planted GPU"
    path.write_text(json.dumps(entry))
    os.chown(path, NOBODY, NOBODY)
    got = inventory(machine, cfg)
    assert got.gpus[0].model != "Planted GPU"
    st = os.stat(path)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600


@pytest.mark.parametrize("how", ["mode 0644", "hard link"])
def test_entry_not_private_is_ignored(machine, cache_dir, how, tmp_path):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    path = the_entry(cache_dir)
    entry = json.loads(path.read_text())
    entry["inventory"]["gpus"][0]["model"] = "Planted GPU"
    path.write_text(json.dumps(entry))
    if how == "mode 0644":
        path.chmod(0o644)
    else:
        os.link(path, tmp_path / "second-name")
    assert inventory(machine, cfg).gpus[0].model != "Planted GPU"


def test_symlinked_entry_is_not_followed(machine, cache_dir, tmp_path):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    path = the_entry(cache_dir)
    entry = json.loads(path.read_text())
    entry["inventory"]["gpus"][0]["model"] = "Planted GPU"
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps(entry))
    planted.chmod(0o600)
    path.unlink()
    path.symlink_to(planted)
    assert inventory(machine, cfg).gpus[0].model != "Planted GPU"
    assert not path.is_symlink()   # replaced by a file of ours
    assert json.loads(planted.read_text())["inventory"]["gpus"][0]["model"] == "Planted GPU"   # untouched


def test_symlinked_cache_dir_is_not_used(machine, cache_dir, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    cache_dir.symlink_to(real)
    cfg = config_for(machine, cache_dir)
    assert len(inventory(machine, cfg).gpus) == 2
    assert list(real.iterdir()) == []


def test_cache_dir_of_another_owner_is_not_used(machine, cache_dir):
    cache_dir.mkdir(mode=0o700)
    os.chown(cache_dir, NOBODY, NOBODY)
    cfg = config_for(machine, cache_dir)
    assert len(inventory(machine, cfg).gpus) == 2
    assert list(cache_dir.iterdir()) == []


def test_cache_dir_is_created_root_only_and_tightened(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    st = os.stat(cache_dir)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    cache_dir.chmod(0o755)
    inventory(machine, cfg)
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
    entry = os.stat(the_entry(cache_dir))
    assert entry.st_uid == os.geteuid() and stat.S_IMODE(entry.st_mode) == 0o600


# --- writing ----------------------------------------------------------------------------------


def test_rewrite_is_an_atomic_replace(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    inventory(machine, cfg)
    path = the_entry(cache_dir)
    held = open(path, "rb")   # a reader that opened the old entry keeps reading the old entry
    old = held.read()
    inventory(machine, cfg, refresh=True)
    assert os.fstat(held.fileno()).st_ino != os.stat(path).st_ino
    held.seek(0)
    assert held.read() == old
    held.close()
    assert sorted(p.name for p in cache_dir.iterdir()) == [path.name, cache.LOCK]   # no temporaries


def test_directory_stays_bounded(machine, cache_dir):
    cache_dir.mkdir(mode=0o700)
    for i in range(cachefile.MAX_ENTRIES + 5):
        (cache_dir / f"{cache.PREFIX}{i:08x}.json").write_text("{}")
    stale_tmp = cache_dir / ".inventory-x.json.1.tmp"
    stale_tmp.write_text("")
    os.utime(stale_tmp, (0, 0))
    inventory(machine, config_for(machine, cache_dir))
    assert len(entries(cache_dir)) == cachefile.MAX_ENTRIES
    assert not stale_tmp.exists()
    assert cache.entry_name(cache._inputs(config_for(machine, cache_dir))) in [p.name for p in entries(cache_dir)]


def test_a_miss_waits_for_the_builder_and_a_hit_does_not(machine, cache_dir):
    cfg = config_for(machine, cache_dir, deadline=0.3)
    inventory(machine, cfg)   # a valid entry
    fd = os.open(cache_dir / cache.LOCK, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)   # another process is building
    try:
        assert len(inventory(machine, cfg).gpus) == 2   # hits never take the lock
        with pytest.raises(NvcError) as err:
            inventory(machine, cfg, refresh=True)
        assert err.value.category == "timeout"
    finally:
        os.close(fd)


def test_a_failed_build_stores_nothing(machine, cache_dir):
    break_nvml(machine)
    with pytest.raises(NvcError):
        inventory(machine, config_for(machine, cache_dir))
    assert entries(cache_dir) == []


# --- the commands -----------------------------------------------------------------------------


def test_info_uses_the_cache_and_refresh_rebuilds_it(machine, cache_dir, tmp_path):
    conf = tmp_path / "config.toml"
    conf.write_text(f'cache-dir = "{cache_dir}"\n')
    cli = [sys.executable, "-m", "nvcontainer", "--config", str(conf), "--root", str(machine.root), "info"]

    def info(*extra):
        return run_in_fake_proc(machine, [*cli, *extra], capture_output=True, text=True, timeout=60)

    first = info()
    assert first.returncode == 0, first.stderr
    break_nvml(machine)
    again = info()
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    refreshed = info("--refresh")
    assert refreshed.returncode == 1
    assert "driver not loaded" in refreshed.stderr


def test_hook_dry_run_is_served_from_the_cache(machine, cache_dir, tmp_path):
    conf = tmp_path / "config.toml"
    conf.write_text(f'cache-dir = "{cache_dir}"\n')
    bundle = tmp_path / "bundle"
    (bundle / "rootfs/etc").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["sh"], "env": ["NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=utility"],
                    "capabilities": {"bounding": ["CAP_CHOWN"]}}}))
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": sleeper.pid,
                            "bundle": str(bundle)})
        argv = [sys.executable, "-m", "nvcontainer.hook", "--config", str(conf), "--root", str(machine.root),
                "--dry-run", "prestart"]
        runs = []
        for _ in range(2):
            runs.append(run_in_fake_proc(machine, argv, input=state, capture_output=True, text=True, timeout=60))
            break_nvml(machine)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    assert runs[0].stdout == runs[1].stdout
    assert [d["path"] for d in json.loads(runs[1].stdout)["devices"]] == ["/dev/nvidiactl", "/dev/nvidia1"]


@pytest.mark.parametrize("changed", ["inventory/catalog.py", "fs/inroot.py"], ids=["inventory", "fs"])
def test_an_upgrade_of_nvcontainer_itself_is_a_miss(machine, cache_dir, tmp_path, changed):
    """Issue 15 item 12: two installs of the same version, the second with a changed inventory
    module (a fixed library order, say). The old program's entry serves the old program again,
    but never the new one, which builds its own (and meets the broken NVML)."""
    repo = Path(__file__).resolve().parent.parent
    trees = {}
    for which in ("old", "new"):
        trees[which] = tmp_path / which
        shutil.copytree(repo / "nvcontainer", trees[which] / "nvcontainer",
                        ignore=shutil.ignore_patterns("__pycache__"))
    with open(trees["new"] / "nvcontainer" / changed, "a") as f:
        f.write("# a change in the new release\n")
    conf = tmp_path / "config.toml"
    conf.write_text(f'[nvcontainer]\ncache-dir = "{cache_dir}"\n')

    def info(which):
        code = (f"import sys; sys.path.insert(0, {str(trees[which])!r}); import nvcontainer; "
                f"assert nvcontainer.__file__.startswith({str(trees[which])!r}), nvcontainer.__file__; "
                "from nvcontainer.cli.main import main; sys.exit(main())")
        argv = [sys.executable, "-I", "-c", code, "--config", str(conf), "--root", str(machine.root), "info"]
        return run_in_fake_proc(machine, argv, capture_output=True, text=True, timeout=60)

    first = info("old")
    assert first.returncode == 0, first.stderr
    break_nvml(machine)
    again = info("old")
    assert (again.returncode, again.stdout) == (0, first.stdout), again.stderr   # same program: a hit
    upgraded = info("new")
    assert upgraded.returncode == 1 and "driver not loaded" in upgraded.stderr, upgraded.stdout + upgraded.stderr


def test_the_program_stamp_is_part_of_the_inputs_and_of_the_name(machine, cache_dir):
    cfg = config_for(machine, cache_dir)
    inputs = cache._inputs(cfg)
    assert inputs["program"] == cache.PROGRAM
    mine, other = cache.entry_name(inputs), cache.entry_name({**inputs, "program": "another"})
    assert mine != other and cachefile.configuration_of(mine) == cachefile.configuration_of(other)
    assert cache.entry_name({**inputs, "version": "0.0"}) != mine
    assert cachefile.configuration_of(cache.entry_name({**inputs, "user": "65534"})) != cachefile.configuration_of(mine)


def test_two_installs_alternating_build_once_each(machine, cache_dir, tmp_path):
    """Issue 35: a package's server and a pip-installed hook (two copies of the same code, their
    program stamps differ) share the cache directory. Each builds its entry once; from then on
    they alternate without a rebuild (proven with NVML broken), and neither removes the other's."""
    repo = Path(__file__).resolve().parent.parent
    trees = {}
    for which in ("package", "pip"):
        trees[which] = tmp_path / which
        shutil.copytree(repo / "nvcontainer", trees[which] / "nvcontainer",
                        ignore=shutil.ignore_patterns("__pycache__"))
    os.utime(trees["pip"] / "nvcontainer" / "inventory" / "build.py", (1, 1))   # installed at another time
    conf = tmp_path / "config.toml"
    conf.write_text(f'[nvcontainer]\ncache-dir = "{cache_dir}"\n')

    def info(which):
        code = (f"import sys; sys.path.insert(0, {str(trees[which])!r}); import nvcontainer; "
                f"assert nvcontainer.__file__.startswith({str(trees[which])!r}), nvcontainer.__file__; "
                "from nvcontainer.cli.main import main; sys.exit(main())")
        argv = [sys.executable, "-I", "-c", code, "--config", str(conf), "--root", str(machine.root), "info"]
        res = run_in_fake_proc(machine, argv, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout

    first = {which: info(which) for which in trees}
    assert first["package"] == first["pip"]
    built = {p.name: p.stat().st_ino for p in entries(cache_dir)}
    assert len(built) == 2 and len({cachefile.configuration_of(n) for n in built}) == 1
    break_nvml(machine)
    for _ in range(3):
        for which in trees:
            assert info(which) == first[which]   # a hit: a rebuild would meet the broken NVML
    assert {p.name: p.stat().st_ino for p in entries(cache_dir)} == built   # neither rewritten


def test_a_configuration_keeps_only_its_newest_programs(machine, cache_dir):
    cache_dir.mkdir(mode=0o700)
    cfg = config_for(machine, cache_dir)
    inputs = cache._inputs(cfg)
    olds = [cache.entry_name({**inputs, "program": f"old-{i}"}) for i in range(cachefile.MAX_PROGRAMS + 2)]
    others = [f"{cache.PREFIX}{i:08x}-00000000.json" for i in range(3)]   # other configurations
    for age, name in enumerate([*olds, *others]):
        (cache_dir / name).write_text("{}")
        os.utime(cache_dir / name, (1000 + age, 1000 + age))
    inventory(machine, cfg)
    names = {p.name for p in entries(cache_dir)}
    assert cache.entry_name(inputs) in names and set(others) <= names
    assert [n for n in olds if n in names] == olds[-(cachefile.MAX_PROGRAMS - 1):]   # the newest kept
