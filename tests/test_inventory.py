"""The driver inventory against fake GPU machines: what it finds must be what the machine has."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from nvcontainer.errors import NvcError
from nvcontainer.inventory.build import build
from tests.fixtures.fakegpu import FakeSpec, inventory_of



def test_two_gpus_match_the_machine(fake_machine):
    truth = fake_machine.description()
    inv = inventory_of(fake_machine)
    assert inv.driver_version == truth["driver_version"]
    assert inv.cuda_version == truth["cuda_version"]
    assert [(g.index, g.minor, g.model, g.brand, g.uuid, g.bus_id, g.arch, g.memory) for g in inv.gpus] == [
        (g["index"], g["minor"], g["name"], g["brand"], g["uuid"], g["bus_id"], g["arch"], g["memory"])
        for g in truth["gpus"]
    ]
    assert [g.memory for g in inv.gpus] == [81920 << 20, 15360 << 20]    # A100 80GB, T4: NVML's totals


@pytest.mark.parametrize("count", [1, 8])
def test_gpu_counts(fake_machine_factory, count):
    machine = fake_machine_factory(FakeSpec(gpus=count))
    inv = inventory_of(machine)
    assert len(inv.gpus) == count
    assert [g.uuid for g in inv.gpus] == [g["uuid"] for g in machine.description()["gpus"]]
    assert len({g.bus_id for g in inv.gpus}) == count


def test_libraries_are_the_driver_version_and_skip_decoys(fake_machine):
    truth = fake_machine.description()
    inv = inventory_of(fake_machine)
    assert {lib.path for lib in inv.libraries} == {lib["path"] for lib in truth["libraries"]}
    assert {lib.path for lib in inv.libraries32} == {lib["path"] for lib in truth["libraries32"]}
    decoys = {d["path"] for d in truth["decoys"]}
    assert decoys, "the fixture must carry decoys for this test to mean anything"
    chosen = {lib.path for lib in inv.libraries + inv.libraries32}
    assert not decoys & chosen
    for lib in inv.libraries + inv.libraries32:
        assert lib.path.endswith(truth["driver_version"])


def test_library_sonames_groups_and_host_links(fake_machine):
    truth = {lib["path"]: lib for lib in fake_machine.description()["libraries"]}
    inv = inventory_of(fake_machine)
    for lib in inv.libraries:
        expected = truth[lib.path]
        assert lib.soname == expected["soname"]
        assert lib.group == expected["group"]
        assert lib.name == expected["prefix"]
        assert {name for name, _ in lib.links} == {name for name, _ in expected["links"]}


def test_32bit_libraries_live_in_the_32bit_directory(fake_machine):
    inv = inventory_of(fake_machine)
    assert inv.libraries32, "gcc -m32 works here, so the fixture has 32-bit libraries"
    assert all("/i386-linux-gnu/" in lib.path for lib in inv.libraries32)
    assert all("/x86_64-linux-gnu/" in lib.path for lib in inv.libraries)


def test_wrong_tls_abi_is_refused(fake_machine_factory, tmp_path):
    """libnvidia-tls must carry the 2.3.99 ABI note: the fixture's real one does."""
    machine = fake_machine_factory()
    inv = inventory_of(machine)
    assert any(lib.name == "libnvidia-tls.so" for lib in inv.libraries)
    from nvcontainer.inventory.libraries import _check

    cuda = next(lib for lib in inv.libraries if lib.name == "libcuda.so")
    # libcuda has no ABI note, so presenting it as libnvidia-tls must fail the check
    assert _check(str(machine.root), cuda.path, "libnvidia-tls.so", "graphics", inv.driver_version) is None


def test_binaries_ipcs_firmware(fake_machine):
    truth = fake_machine.description()
    inv = inventory_of(fake_machine)
    assert [b.path for b in inv.binaries] == [b["path"] for b in truth["binaries"]]
    assert [i.path for i in inv.ipcs] == [i["path"] for i in truth["ipcs"]]
    assert [f.path for f in inv.firmwares] == [f["path"] for f in truth["firmwares"]]


def _driver_tree_layout(machine, inv) -> str:
    """Lay the machine out as a node whose driver has a tree of its own (seen on a real H100
    node: /usr/local/nvidia/{lib64,bin}): the real nvidia-smi moves to the ``bin`` beside the
    NVML library's directory, and /usr/bin/nvidia-smi becomes a wrapper script that executes it."""
    nvml = next(lib.path for lib in inv.libraries if lib.name == "libnvidia-ml.so")
    driver_bin = os.path.join(os.path.dirname(os.path.dirname(nvml)), "bin")
    (machine.root / driver_bin.lstrip("/")).mkdir(parents=True, exist_ok=True)
    wrapper = machine.root / "usr/bin/nvidia-smi"
    os.rename(wrapper, machine.root / driver_bin.lstrip("/") / "nvidia-smi")
    wrapper.write_text(f'#!/bin/sh\nexec {driver_bin}/nvidia-smi "$@"\n')
    wrapper.chmod(0o755)
    return driver_bin


def test_a_wrapper_script_is_passed_over_for_the_driver_s_own_binary(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(gpus=1))
    driver_bin = _driver_tree_layout(machine, inventory_of(machine))
    smi = [b.path for b in inventory_of(machine).binaries if b.name == "nvidia-smi"]
    assert smi == [f"{driver_bin}/nvidia-smi"]   # upstream would bind the script, which fails inside


def test_a_wrapper_script_alone_is_no_binary(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(gpus=1))
    driver_bin = _driver_tree_layout(machine, inventory_of(machine))
    os.unlink(machine.root / driver_bin.lstrip("/") / "nvidia-smi")
    assert "nvidia-smi" not in [b.name for b in inventory_of(machine).binaries]


def test_device_nodes_come_from_proc_devices(fake_machine):
    inv = inventory_of(fake_machine)
    nodes = {n.path: (n.major, n.minor) for n in inv.ctl_devices}
    assert nodes["/dev/nvidiactl"] == (195, 255)
    assert nodes["/dev/nvidia-uvm"] == (fake_machine.uvm_major, 0)
    assert nodes["/dev/nvidia-uvm-tools"] == (fake_machine.uvm_major, 1)
    assert nodes["/dev/nvidia-modeset"] == (195, 254)


def test_mig_devices_and_their_caps(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(gpus=2, mig=True))
    truth = machine.description()
    inv = inventory_of(machine)
    gpu0 = inv.gpus[0]
    assert gpu0.mig_enabled
    expected = truth["gpus"][0]["migs"]
    assert [(m.uuid, m.gi, m.ci) for m in gpu0.migs] == [(m["uuid"], m["gi"], m["ci"]) for m in expected]
    for mig, want in zip(gpu0.migs, expected):
        assert mig.gi_access == want["gi_access"]
        assert mig.ci_access == want["ci_access"]
        assert (mig.gi_cap.major, mig.gi_cap.minor) == (want["gi_cap"]["major"], want["gi_cap"]["minor"])
        assert (mig.ci_cap.major, mig.ci_cap.minor) == (want["ci_cap"]["major"], want["ci_cap"]["minor"])
    assert inv.mig.config_cap is not None and inv.mig.monitor_cap is not None
    assert not inv.gpus[1].migs


@pytest.mark.parametrize("piece", ["persistenced", "fabricmanager", "mps", "firmware", "uvm", "compat32"])
def test_missing_optional_pieces_are_not_errors(fake_machine_factory, piece):
    machine = fake_machine_factory(FakeSpec(missing=frozenset({piece})))
    inv = inventory_of(machine)
    ipc_names = {i.name for i in inv.ipcs}
    if piece in ("persistenced", "fabricmanager", "mps"):
        assert piece not in ipc_names
    elif piece == "firmware":
        assert inv.firmwares == ()
    elif piece == "uvm":
        assert not any("uvm" in n.path for n in inv.ctl_devices)
    elif piece == "compat32":
        assert inv.libraries32 == ()
    assert inv.libraries


def test_missing_library_prefix_is_left_out(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(missing=frozenset({"libnvidia-ngx.so"})))
    inv = inventory_of(machine)
    assert "libnvidia-ngx.so" not in {lib.name for lib in inv.libraries}
    assert "libcuda.so" in {lib.name for lib in inv.libraries}


def test_no_nvml_is_a_load_library_error(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(missing=frozenset({"nvml"})))
    with pytest.raises(NvcError) as err:
        inventory_of(machine)
    assert err.value.category == "initialization"
    assert err.value.detail.startswith("load library failed: libnvidia-ml.so.1")


def test_driver_not_loaded(fake_machine_factory):
    machine = fake_machine_factory(FakeSpec(missing=frozenset({"driver"})))
    with pytest.raises(NvcError) as err:
        inventory_of(machine)
    assert err.value.category == "initialization"
    assert "driver not loaded" in err.value.detail


def test_kernel_and_library_version_mismatch(fake_machine, tmp_path):
    proc = tmp_path / "proc"
    (proc / "driver/nvidia").mkdir(parents=True)
    (proc / "driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  555.42.02  Tue May 14 2024\n")
    (proc / "devices").write_text((fake_machine.proc / "devices").read_text())
    with pytest.raises(NvcError) as err:
        build(str(fake_machine.root), proc=str(proc))
    assert "version mismatch" in err.value.detail
    assert "555.42.02" in err.value.detail and "550.54.14" in err.value.detail


def test_corrupt_ldcache_is_a_clean_error(fake_machine, tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    real = (fake_machine.root / "etc/ld.so.cache").read_bytes()
    (root / "etc/ld.so.cache").write_bytes(real[: len(real) // 2])
    with pytest.raises(NvcError) as err:
        build(str(root), proc=str(fake_machine.proc))
    assert err.value.category == "ldcache"
    assert err.value.detail.startswith(f"{root}/etc/ld.so.cache: ")


def test_compat_format_cache_gives_the_same_libraries(fake_machine):
    new = inventory_of(fake_machine)
    compat = inventory_of(fake_machine, ldcache_path="/etc/ld.so.cache.compat")
    assert [lib.path for lib in compat.libraries] == [lib.path for lib in new.libraries]
    assert [lib.path for lib in compat.libraries32] == [lib.path for lib in new.libraries32]


def test_wrong_device_node_numbers_are_refused(fake_machine, tmp_path):
    """A /dev/nvidiactl with other numbers must not be trusted (it would be bind-mounted)."""
    from nvcontainer.inventory import devices
    from nvcontainer.inventory.model import DeviceNode

    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    os.mknod(root / "dev/nvidiactl", 0o666 | 0o020000, os.makedev(1, 3))
    with pytest.raises(NvcError) as err:
        devices.check_node(str(root), DeviceNode("/dev/nvidiactl", 195, 255))
    assert err.value.detail == "invalid device node: /dev/nvidiactl: expected 195:255, found 1:3"


def test_inventory_round_trips_through_json(fake_machine_factory):
    import json

    from nvcontainer.inventory.model import Inventory

    inv = inventory_of(fake_machine_factory(FakeSpec(mig=True)))
    again = Inventory.from_dict(json.loads(json.dumps(inv.to_dict())))
    assert again == inv


def test_nvml_as_pid_1(fake_machine):
    """A container's entrypoint is pid 1 (the device plugin in its DaemonSet): its NVML helper's
    parent is pid 1 and alive, not gone."""
    script = ("import sys; from nvcontainer.inventory.build import build; "
              "print(len(build(sys.argv[1], proc=sys.argv[2]).gpus))")
    res = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script,
                          str(fake_machine.root), str(fake_machine.proc)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(len(fake_machine.description()["gpus"]))


@pytest.mark.root
def test_nvml_helper_reaped_without_cap_kill():
    """A plugin container with only the capabilities it needs has no CAP_KILL: reaping the NVML
    helper (another user by then) must not raise, and must still collect it once it exits."""
    import prctl

    from nvcontainer.inventory import nvml as nvml_module

    pid = os.fork()
    if pid == 0:   # the test's own process: drop CAP_KILL, then reap a helper of another user
        code = 1
        try:
            prctl.cap_effective.kill = False
            prctl.cap_permitted.kill = False
            helper = os.fork()
            if helper == 0:
                os.setresuid(65534, 65534, 65534)
                time.sleep(0.3)
                os._exit(0)
            time.sleep(0.05)
            nvml_module._reap(helper)
            try:
                os.waitpid(helper, os.WNOHANG)
            except ChildProcessError:
                code = 0   # reaped
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
