"""The fake GPU machine is real where it claims to be: checked with the system's own tools
(ldconfig, the kernel's stat, pyelftools, pynvml), never with nvcontainer."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.procfs import char_majors
from tests.fixtures.fakegpu.toolchain import Toolchain

pytest_plugins = ["tests.fixtures.fakegpu.plugin"]

REPO = Path(__file__).resolve().parent.parent
HAS_M32 = Toolchain().has_m32     # gcc -m32 works (gcc-multilib); i386 copies are built then
MIG = FakeSpec(gpus=3, mig=True, mig_devices=3, minors=(2, 0, 1))   # minors != indices
NO_DRIVER = FakeSpec(missing=frozenset({"driver"}), init_delay_ms=300)
STRIPPED = FakeSpec(gpus=1, decoys=False, missing=frozenset({
    "nvml", "persistenced", "fabricmanager", "mps", "firmware", "uvm", "compat32",
    "libnvidia-ngx.so", "nvidia-smi",
}))

# Runs in a fresh interpreter per machine (pynvml keeps global state): preload the mock by
# its full path, then let pynvml open "libnvidia-ml.so.1" exactly as it does on a real host.
NVML_PROBE = r"""
import ctypes, json, sys, time
ctypes.CDLL(sys.argv[1])
import pynvml as n
out = {}
start = time.monotonic()
try:
    n.nvmlInit()
except n.NVMLError as err:
    out["init_error"] = type(err).__name__
out["init_seconds"] = time.monotonic() - start
if "init_error" not in out:
    out["driver"] = n.nvmlSystemGetDriverVersion()
    out["cuda"] = n.nvmlSystemGetCudaDriverVersion_v2()
    gpus = out["gpus"] = []
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        pci = n.nvmlDeviceGetPciInfo(h)
        gpu = {"name": n.nvmlDeviceGetName(h), "uuid": n.nvmlDeviceGetUUID(h),
               "brand": n.nvmlDeviceGetBrand(h), "minor": n.nvmlDeviceGetMinorNumber(h),
               "bus_id": pci.busId if isinstance(pci.busId, str) else pci.busId.decode(), "cc": list(n.nvmlDeviceGetCudaComputeCapability(h)),
               "by_bus": n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByPciBusId(pci.busId)),
               "migs": []}
        try:
            gpu["mig_mode"] = n.nvmlDeviceGetMigMode(h)[0]
        except n.NVMLError_NotSupported:
            gpu["mig_mode"] = None
        if gpu["mig_mode"]:
            for j in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
                try:
                    m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                except n.NVMLError_NotFound:
                    continue
                parent = n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
                gpu["migs"].append({
                    "uuid": n.nvmlDeviceGetUUID(m), "gi": n.nvmlDeviceGetGpuInstanceId(m),
                    "ci": n.nvmlDeviceGetComputeInstanceId(m),
                    "is_mig": n.nvmlDeviceIsMigDeviceHandle(m).value,
                    "parent": n.nvmlDeviceGetUUID(parent)})
        gpus.append(gpu)
    try:
        n.nvmlDeviceGetFanSpeed(n.nvmlDeviceGetHandleByIndex(0))
    except n.NVMLError_FunctionNotFound:
        out["unknown_entry_point"] = "FunctionNotFound"
    n.nvmlShutdown()
print(json.dumps(out))
"""


def probe_nvml(machine) -> dict:
    lib = machine.nvml_library or machine.host_path(
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so." + machine.spec.driver_version)
    proc = subprocess.run([sys.executable, "-c", NVML_PROBE, str(lib)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def cache_entries(cache: Path) -> list[tuple[str, str, str]]:
    """(soname, flags, path) for each entry, as the real ldconfig -p reads the cache."""
    out = subprocess.run(["ldconfig", "-p", "-C", str(cache)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"^\s+(\S+) \(([^)]*)\) => (\S+)$", out, re.M)


def real_path(machine, path_in_root: str) -> str:
    """Resolve inside the root (the fixture only makes relative links, so realpath is exact)."""
    resolved = os.path.realpath(machine.host_path(path_in_root))
    return "/" + os.path.relpath(resolved, machine.root)


def soname_of(path: Path) -> tuple[str, int]:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        tags = elf.get_section_by_name(".dynamic").iter_tags()
        return next(t.soname for t in tags if t.entry.d_tag == "DT_SONAME"), elf.elfclass


# ------------------------------------------------------------------------------------------
# Libraries and the ld cache


@pytest.mark.parametrize("which", ["ld_cache", "ld_cache_compat"])
def test_cache_lists_libcuda_for_both_arches(fake_machine, which):
    desc = fake_machine.description()
    cache = fake_machine.host_path(desc[which])
    magic = cache.read_bytes()[:20]
    assert magic.startswith(b"ld.so-1.7.0" if which == "ld_cache_compat" else b"glibc-ld.so.cache1.1")

    libcuda = {(flags, real_path(fake_machine, path))
               for soname, flags, path in cache_entries(cache) if soname == "libcuda.so.1"}
    version = desc["driver_version"]
    assert ("libc6,x86-64", f"/usr/lib/x86_64-linux-gnu/libcuda.so.{version}") in libcuda
    if HAS_M32:
        assert ("libc6", f"/usr/lib/i386-linux-gnu/libcuda.so.{version}") in libcuda
    # The forward-compat decoy is registered too, under the same SONAME.
    assert ("libc6,x86-64", "/usr/local/cuda-12/compat/libcuda.so.535.104.05") in libcuda


def test_every_library_has_its_soname_and_is_cached(fake_machine):
    desc = fake_machine.description()
    cached = {(soname, flags.endswith("x86-64"), real_path(fake_machine, path))
              for soname, flags, path in cache_entries(fake_machine.host_path(desc["ld_cache"]))}
    libs = desc["libraries"] + desc["libraries32"]
    assert len(desc["libraries"]) == 34
    assert len(desc["libraries32"]) == (23 if HAS_M32 else 0)
    for lib in libs:
        assert lib["path"].endswith("." + desc["driver_version"])
        soname, elfclass = soname_of(fake_machine.host_path(lib["path"]))
        assert soname == lib["soname"]
        assert elfclass == (64 if lib["arch"] == "x86_64" else 32)
        assert (soname, lib["arch"] == "x86_64", lib["path"]) in cached
        for link, target in lib["links"]:
            directory = fake_machine.host_path(os.path.dirname(lib["path"]))
            assert os.readlink(directory / link) == target
    sonames = {lib["soname"] for lib in libs}
    assert {"libcuda.so.1", "libnvidia-ml.so.1", "libGLX_nvidia.so.0", "libGLESv2_nvidia.so.2",
            "libnvidia-nvvm.so.4", "libnvidia-glcore.so." + desc["driver_version"]} <= sonames


def test_tls_carries_the_new_abi_note_and_others_do_not(fake_machine):
    desc = fake_machine.description()
    for lib in desc["libraries"] + desc["libraries32"]:
        with open(fake_machine.host_path(lib["path"]), "rb") as f:
            section = ELFFile(f).get_section_by_name(".note.ABI-tag")
            if lib["prefix"] != "libnvidia-tls.so":
                assert section is None, lib["path"]
                continue
            assert section.header.sh_type == "SHT_NOTE"
            (note,) = list(section.iter_notes())
            assert note.n_name == "GNU" and note.n_type == "NT_GNU_ABI_TAG"
            desc_ = note.n_desc
            assert desc_.abi_os == "ELF_NOTE_OS_LINUX"
            assert (desc_.abi_major, desc_.abi_minor, desc_.abi_tiny) == (2, 3, 99)


def test_decoys_look_like_driver_files_but_are_not(fake_machine):
    desc = fake_machine.description()
    by_soname = {d["soname"]: d for d in desc["decoys"]}
    assert set(by_soname) >= {"libcuda.so.1", "libnvidia-ml.so.1", "libEGL.so.1"}
    for decoy in desc["decoys"]:
        assert not decoy["path"].endswith(desc["driver_version"])
        assert soname_of(fake_machine.host_path(decoy["path"]))[0] == decoy["soname"]
    with open(fake_machine.host_path(by_soname["libEGL.so.1"]["path"]), "rb") as f:
        needed = [t.needed for t in ELFFile(f).get_section_by_name(".dynamic").iter_tags()
                  if t.entry.d_tag == "DT_NEEDED"]
    assert needed == ["libc.so.6"]


# ------------------------------------------------------------------------------------------
# Device nodes, /proc, IPC, binaries, firmware


def test_device_nodes_have_the_described_rdev(fake_machine):
    desc = fake_machine.description()
    nodes = {n["path"]: n for n in desc["device_nodes"]}
    for node in nodes.values():
        st = os.lstat(fake_machine.host_path(node["path"]))
        assert stat.S_ISCHR(st.st_mode)
        assert st.st_rdev == os.makedev(node["major"], node["minor"])
        assert stat.S_IMODE(st.st_mode) == node["mode"]
    for gpu in desc["gpus"]:
        assert nodes[f"/dev/nvidia{gpu['minor']}"]["major"] == 195
    assert (nodes["/dev/nvidiactl"]["major"], nodes["/dev/nvidiactl"]["minor"]) == (195, 255)
    assert nodes["/dev/nvidia-uvm"]["major"] == fake_machine.uvm_major
    # No device node can reach real hardware: its major belongs to no host driver.
    host_majors = char_majors(Path("/proc/devices").read_text())
    for major in (fake_machine.uvm_major, fake_machine.caps_major, fake_machine.imex_major):
        assert major not in host_majors


def test_proc_describes_the_same_gpus(fake_machine_factory):
    machine = fake_machine_factory(MIG)
    desc = machine.description()
    devices = (machine.proc / "devices").read_text()
    for major, name in [(195, "nvidia-frontend"), (machine.uvm_major, "nvidia-uvm"),
                        (machine.caps_major, "nvidia-caps"),
                        (machine.imex_major, "nvidia-caps-imex-channels")]:
        assert f"\n{major:3d} {name}\n" in devices
    assert desc["driver_version"] in (machine.proc / "driver/nvidia/version").read_text()
    assert "ModifyDeviceFiles: 1\n" in (machine.proc / "driver/nvidia/params").read_text()
    for gpu in desc["gpus"]:
        info = (machine.proc / gpu["proc_dir"].removeprefix("/proc/") / "information").read_text()
        fields = dict(re.split(r":\s+", line, maxsplit=1) for line in info.splitlines())
        assert fields["GPU UUID"] == gpu["uuid"]
        assert fields["Device Minor"] == str(gpu["minor"])
        assert fields["Bus Location"] == gpu["proc_bus_id"]
    minors = dict(line.split() for line in
                  (machine.proc / "driver/nvidia-caps/mig-minors").read_text().splitlines())
    migs = desc["gpus"][0]["migs"]
    assert len(migs) == 3
    for mig in migs:
        for access, cap in (("gi_access", "gi_cap"), ("ci_access", "ci_cap")):
            text = (machine.proc / mig[access].removeprefix("/proc/")).read_text()
            assert text == f"DeviceFileMinor: {mig[cap]['minor']}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
            key = mig[access].removeprefix("/proc/driver/nvidia/capabilities/").replace("/mig/", "/")
            assert minors[key] == str(mig[cap]["minor"])
            st = os.stat(machine.host_path(mig[cap]["path"]))
            assert st.st_rdev == os.makedev(machine.caps_major, mig[cap]["minor"])
    assert minors["config"] == "1" and minors["monitor"] == "2"


def test_ipc_firmware_and_binaries(fake_machine):
    desc = fake_machine.description()
    kinds = {ipc["name"]: ipc for ipc in desc["ipcs"]}
    assert set(kinds) == {"persistenced", "fabricmanager", "mps"}
    for ipc in desc["ipcs"]:
        st = os.stat(fake_machine.host_path(ipc["lookup"]))   # through /var/run -> ../run
        assert stat.S_ISSOCK(st.st_mode) if ipc["kind"] == "socket" else stat.S_ISDIR(st.st_mode)
    assert {os.path.basename(f["path"]) for f in desc["firmwares"]} == {"gsp_ga10x.bin", "gsp_tu10x.bin"}
    for fw in desc["firmwares"]:
        assert real_path(fake_machine, fw["lookup"]) == fw["path"]   # /lib -> usr/lib
    assert len(desc["binaries"]) == 6
    for binary in desc["binaries"]:
        if binary["name"] == "nvidia-cuda-mps-control":      # a working stand-in (mps_control.c)
            res = subprocess.run([fake_machine.host_path(binary["path"])], input="get_server_list\n", text=True,
                                 capture_output=True, env={"CUDA_MPS_PIPE_DIRECTORY": str(fake_machine.base / "none")})
            assert res.returncode == 1 and res.stderr == "Cannot find MPS control daemon process\n"
            continue
        out = subprocess.run([fake_machine.host_path(binary["path"])], capture_output=True,
                             text=True, check=True).stdout
        assert out.startswith(binary["name"] + " ")


# ------------------------------------------------------------------------------------------
# NVML


def test_pynvml_loads_the_mock_and_sees_the_configured_gpus(fake_machine_factory):
    machine = fake_machine_factory(MIG)
    desc = machine.description()
    seen = probe_nvml(machine)
    assert seen["driver"] == desc["driver_version"]
    assert seen["cuda"] == desc["cuda_version_int"]
    assert seen["unknown_entry_point"] == "FunctionNotFound"
    assert len(seen["gpus"]) == 3
    for got, want in zip(seen["gpus"], desc["gpus"]):
        assert got["name"] == want["name"] and got["uuid"] == want["uuid"]
        assert got["brand"] == want["brand_value"] and got["minor"] == want["minor"]
        assert got["bus_id"] == want["nvml_bus_id"] and got["by_bus"] == want["uuid"]
        assert ".".join(map(str, got["cc"])) == want["arch"]
        assert got["mig_mode"] == (1 if want["mig_enabled"] else 0 if want["mig_capable"] else None)
        assert [(m["uuid"], m["gi"], m["ci"], m["is_mig"], m["parent"]) for m in got["migs"]] == [
            (m["uuid"], m["gi"], m["ci"], 1, want["uuid"]) for m in want["migs"]]
    assert desc["gpus"][1]["brand"] == "Tesla" and seen["gpus"][1]["brand"] == 2


def test_missing_driver_fails_init_after_the_configured_delay(fake_machine_factory):
    machine = fake_machine_factory(NO_DRIVER)
    desc = machine.description()
    seen = probe_nvml(machine)
    assert seen["init_error"] == "NVMLError_DriverNotLoaded"
    assert seen["init_seconds"] >= 0.3
    assert not (machine.proc / "driver").exists()
    assert desc["device_nodes"] == [] and not desc["driver_loaded"]
    assert "nvidia" not in (machine.proc / "devices").read_text()


def test_init_is_fast_without_a_delay(fake_machine):
    assert probe_nvml(fake_machine)["init_seconds"] < 0.3


def test_missing_pieces_are_absent(fake_machine_factory):
    machine = fake_machine_factory(STRIPPED)
    desc = machine.description()
    entries = cache_entries(machine.host_path(desc["ld_cache"]))
    sonames = {soname for soname, _, _ in entries}
    assert "libcuda.so.1" in sonames
    assert not sonames & {"libnvidia-ml.so.1", "libnvidia-ngx.so.1"}
    assert all(flags.endswith("x86-64") for _, flags, _ in entries)      # no compat32
    assert machine.nvml_library is None and machine.uvm_major is None
    assert desc["libraries32"] == [] and desc["decoys"] == [] and desc["firmwares"] == []
    assert desc["ipcs"] == []
    assert {b["name"] for b in desc["binaries"]} == {"nvidia-debugdump"}
    for path in ("/dev/nvidia-uvm", "/usr/bin/nvidia-smi", "/usr/bin/nvidia-persistenced",
                 "/run/nvidia-persistenced", "/tmp/nvidia-mps", "/usr/lib/firmware/nvidia",
                 "/usr/lib/i386-linux-gnu/libcuda.so.1"):
        assert not os.path.lexists(machine.host_path(path)), path
    assert "nvidia-uvm" not in (machine.proc / "devices").read_text()


def test_spec_rejects_pieces_it_does_not_know():
    with pytest.raises(ValueError):
        FakeSpec(missing=frozenset({"libnvidia-nonexistent.so"}))
    with pytest.raises(ValueError):
        FakeSpec(gpus=2, archs=("7.5",), mig=True)


# ------------------------------------------------------------------------------------------
# Namespace runner and command line


def test_run_in_fake_proc_shows_fake_proc_and_passes_argv_verbatim(fake_machine):
    from tests.fixtures.fakegpu import run_in_fake_proc

    before = sorted(os.listdir("/proc/driver"))
    desc = fake_machine.description()
    version = run_in_fake_proc(fake_machine, ["cat", "/proc/driver/nvidia/version"],
                               capture_output=True, text=True, check=True).stdout
    assert version == (fake_machine.proc / "driver/nvidia/version").read_text()
    devices = run_in_fake_proc(fake_machine, ["cat", "/proc/devices"], capture_output=True,
                               text=True, check=True).stdout
    assert f"{fake_machine.uvm_major} nvidia-uvm" in devices
    bus = desc["gpus"][1]["proc_bus_id"]
    info = run_in_fake_proc(fake_machine, ["cat", f"/proc/driver/nvidia/gpus/{bus}/information"],
                            capture_output=True, text=True, check=True).stdout
    assert desc["gpus"][1]["uuid"] in info
    tricky = "$(touch /tmp/fakegpu-pwned); `id` ' \" \n"
    echoed = run_in_fake_proc(fake_machine, ["printf", "%s", tricky], capture_output=True,
                              text=True, check=True).stdout
    assert echoed == tricky and not os.path.exists("/tmp/fakegpu-pwned")
    writes = run_in_fake_proc(fake_machine, ["touch", "/proc/driver/nvidia/params"],
                              capture_output=True)
    assert writes.returncode != 0
    assert sorted(os.listdir("/proc/driver")) == before


def test_command_line_builds_and_runs(fake_machine_factory, tmp_path):
    # fake_machine_factory only brings its skip conditions (root, gcc); the CLI builds its own.
    dest = tmp_path / "machine"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cli = [sys.executable, "-m", "tests.fixtures.fakegpu"]
    built = subprocess.run(cli + ["build", str(dest), "--gpus", "1", "--mig", "--no-decoys",
                                  "--missing", "uvm"],
                           capture_output=True, text=True, env=env, cwd=REPO)
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == str(dest / "root")
    desc = json.loads((dest / "machine.json").read_text())
    assert len(desc["gpus"]) == 1 and len(desc["gpus"][0]["migs"]) == 2
    assert desc["decoys"] == [] and desc["majors"]["uvm"] is None
    ran = subprocess.run(cli + ["run", str(dest), "--", "cat", desc["gpus"][0]["migs"][1]["ci_access"]],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(f"DeviceFileMinor: {desc['gpus'][0]['migs'][1]['ci_cap']['minor']}\n")
    again = subprocess.run(cli + ["build", str(dest)], capture_output=True, text=True, env=env, cwd=REPO)
    assert again.returncode == 2 and "not empty" in again.stderr
