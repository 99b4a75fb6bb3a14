"""MPS sharing's pure decisions on inventories made by hand: which GPUs get a daemon, the limits
(and the rounding when replicas do not divide the memory), the refusals (MIG, too many clients),
what the daemon is told, what Allocate gives a container, and when a daemon counts as ready."""

from __future__ import annotations

import os

import pytest

from nvcontainer.deviceplugin import devices, mps
from nvcontainer.deviceplugin.allocate import Refused, allocate
from nvcontainer.deviceplugin.settings import Settings
from nvcontainer.errors import NvcError
from nvcontainer.records import replace
from tests.test_deviceplugin_core import MIXED, gpu, inventory

A100, T4 = 81920, 15360
TWO = inventory(replace(gpu(0), memory=A100 << 20), replace(gpu(1), memory=T4 << 20, arch="7.5"))


def shares_of(inv=TWO, **kw):
    settings = Settings(sharing="mps", **kw)
    return mps.shares(devices.advertise(inv, settings), settings), settings


def test_one_share_per_gpu_with_limits_and_paths():
    (a, t), _ = shares_of(replicas=4)
    assert (a.uuid, a.threads, a.memory_mib, a.replicas) == (gpu(0).uuid, 25, A100 // 4, 4)
    assert (t.threads, t.memory_mib) == (25, T4 // 4)
    assert a.directory == f"/run/nvidia/mps/nvidia.com/gpu/{gpu(0).uuid}"
    assert (a.pipe, a.log, a.ready, a.control) == (a.directory + "/pipe", a.directory + "/log",
                                                   a.directory + "/.ready", a.directory + "/pipe/control")
    assert mps.rounding(a) == "" and mps.rounding(t) == ""


def test_renamed_resource_and_root_are_in_the_paths():
    (a, _), _ = shares_of(replicas=2, rename_shared=True, mps_root="/srv/mps")
    assert a.resource == "nvidia.com/gpu.shared"
    assert a.directory == f"/srv/mps/nvidia.com/gpu.shared/{gpu(0).uuid}"


def test_no_daemon_without_mps_or_with_one_replica():
    assert shares_of(replicas=1)[0] == ()
    settings = Settings(replicas=4)                 # time-slicing
    assert mps.shares(devices.advertise(TWO, settings), settings) == ()


def test_replicas_that_do_not_divide_the_memory_round_down_with_one_line():
    (a, t), _ = shares_of(replicas=7)
    assert (a.memory_mib, t.memory_mib, a.threads) == (81920 // 7, 15360 // 7, 14)
    assert mps.rounding(a) == (f"GPU 0 ({gpu(0).uuid}): 81920 MiB do not divide into 7 replicas; each client "
                               "may pin 11702 MiB (rounded down, 6 MiB unused)")
    assert "2194 MiB (rounded down, 2 MiB unused)" in mps.rounding(t)


def test_unknown_memory_means_no_memory_limit():
    (a,), _ = shares_of(inventory(gpu(0)), replicas=2)
    assert a.memory_mib == 0 and "no pinned memory limit" in mps.rounding(a)
    assert mps.commands(a) == ("set_default_active_thread_percentage 50",)
    assert mps.MEMORY_ENV not in mps.client_env(a)


@pytest.mark.parametrize("strategy", ["none", "mixed"])
def test_mig_and_mps_are_refused_in_one_line(strategy):
    with pytest.raises(NvcError) as err:
        shares_of(MIXED, replicas=2, mig_strategy=strategy)
    text = str(err.value)
    assert "cannot be shared with MPS" in text and "\n" not in text and err.value.category == "config"


def test_more_replicas_than_an_mps_server_takes():
    old = inventory(replace(gpu(0), arch="6.1"))
    with pytest.raises(NvcError, match="takes at most 16 clients"):
        shares_of(old, replicas=17)
    assert shares_of(old, replicas=16)[0][0].threads == 6
    with pytest.raises(NvcError, match="takes at most 48 clients"):
        shares_of(replicas=49)


def test_what_the_daemon_is_told_and_its_environment():
    (a, _), _ = shares_of(replicas=4)
    assert mps.commands(a) == ("set_default_device_pinned_mem_limit 0 20480M",
                               "set_default_active_thread_percentage 25")
    assert mps.daemon_env(a) == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CUDA_MPS_PIPE_DIRECTORY": a.pipe,
                                 "CUDA_MPS_LOG_DIRECTORY": a.log, "CUDA_VISIBLE_DEVICES": a.uuid}


def test_allocate_hands_out_pipe_shm_and_limits():
    shares, settings = shares_of(replicas=4, device_list_strategy=("envvar",))
    resource = devices.advertise(TWO, settings)[0]
    by_uuid = {s.uuid: s for s in shares}
    got = allocate([f"{gpu(1).uuid}::3"], resource, frozenset(), settings, "r", by_uuid)
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": gpu(1).uuid,
                              "CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe",
                              "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3840M"}
    assert [(m.container_path, m.host_path, m.read_only) for m in got.mounts] == [
        ("/mps/nvidia.com/gpu/pipe", f"/run/nvidia/mps/nvidia.com/gpu/{gpu(1).uuid}/pipe", False),
        ("/dev/shm", f"/run/nvidia/mps/nvidia.com/gpu/{gpu(1).uuid}/shm", False)]     # its GPU's daemon's own
    with pytest.raises(Refused, match="at most 1"):
        allocate([f"{gpu(1).uuid}::3", f"{gpu(1).uuid}::2"], resource, frozenset(), settings, "r", by_uuid)
    plain = allocate([f"{gpu(1).uuid}::3"], resource, frozenset(), settings, "r")     # time-slicing
    assert dict(plain.envs) == {"NVIDIA_VISIBLE_DEVICES": gpu(1).uuid} and not plain.mounts


def test_ready_only_with_marker_pipe_and_the_same_limits():
    (a, _), _ = shares_of(replicas=4)
    assert mps.not_ready(a, mps.marker(a), True) == ""
    assert "no marker" in mps.not_ready(a, None, True)
    assert "control pipe" in mps.not_ready(a, mps.marker(a), False)
    assert "not JSON" in mps.not_ready(a, "{", True)
    (other, _), _ = shares_of(replicas=2)
    assert "other limits" in mps.not_ready(a, mps.marker(other), True)


# --- documentation ------------------------------------------------------------------------------

def test_mps_daemon_page_documents_every_option_and_renders():
    import shutil
    import subprocess
    from pathlib import Path

    import re
    import sys

    from tests.test_docs import assert_documented, section

    root = Path(__file__).resolve().parent.parent
    page = root / "man" / "nvcontainer-mps-daemon.1"
    out = subprocess.run([sys.executable, "-m", "nvcontainer", "mps-daemon", "--help"], capture_output=True,
                         text=True, check=True, cwd=root, timeout=60).stdout
    options = [(None, o) for o in re.findall(r"^ {2}(--[a-z0-9][a-z0-9-]*)", out, re.M) if o != "--help"]
    assert [o for _, o in options] == ["--interval", "--mount-shm"]
    assert_documented(options, section(page.read_text(), ".SH OPTIONS"), "man/nvcontainer-mps-daemon.1 (OPTIONS)")
    if shutil.which("man") is None:
        pytest.skip("man is not installed")
    result = subprocess.run(["man", "--warnings", "-l", str(page)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, MANWIDTH="80"), timeout=60)
    assert result.returncode == 0 and result.stderr == ""


# --- the control program ------------------------------------------------------------------------

def _with_binary(tmp_path, mode: int | None):
    from nvcontainer.inventory.model import DriverFile

    path = tmp_path / "usr/bin/nvidia-cuda-mps-control"
    if mode is not None:
        path.parent.mkdir(parents=True)
        path.write_text("#!/bin/sh\n")
        os.chmod(path, mode)
    binaries = (DriverFile(path="/usr/bin/nvidia-cuda-mps-control", group="compute", name="nvidia-cuda-mps-control"),)
    return replace(TWO, root=str(tmp_path), binaries=binaries if mode is not None else ())


def test_the_control_program_is_the_inventory_s_and_only_root_can_change_it(tmp_path):
    from nvcontainer.deviceplugin.mpsdaemon import control_binary

    if os.geteuid() != 0:
        pytest.skip("the program must belong to root")
    assert control_binary(_with_binary(tmp_path, 0o755)) == f"{tmp_path}/usr/bin/nvidia-cuda-mps-control"
    with pytest.raises(NvcError, match="only root can change; refusing"):
        control_binary(_with_binary(tmp_path / "x", 0o757))
    with pytest.raises(NvcError, match="no nvidia-cuda-mps-control in the driver's files"):
        control_binary(_with_binary(tmp_path / "y", None))
