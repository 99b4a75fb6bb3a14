"""``nvcontainer metrics`` on the fake GPU machine: what a scrape returns, and what the endpoint
does when the driver hangs, a GPU falls off the bus, a client holds its connection, or the
counters file is wrong."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from nvcontainer.metrics import sampling
from tests.fixtures.exporter import Exporter, series
from tests.fixtures.fakegpu.readings import BUSY, set_readings
from tests.fixtures.fakegpu.spec import FakeSpec


@pytest.fixture(scope="module")
def machine(private_machine):
    m = private_machine(FakeSpec(gpus=2, archs=("9.0", "8.0")))
    return set_readings(m, {0: BUSY, 1: {"temp": 45, "power_mw": 70000, "sm_clock": 1410, "fb_used": 1 << 30}},
                        processes=((0, os.getpid(), 300 << 20, "compute", 40), (1, os.getpid(), 64 << 20, "mps", 0)),
                        utilization=((50, 20), (7, 3)))


@pytest.fixture()
def clear_state(machine):
    yield machine.nvml_state
    machine.nvml_state.unlink(missing_ok=True)


def by_gpu(text: str, name: str) -> dict[str, float]:
    return {labels["gpu"]: value for labels, value in series(text, name)}


def test_a_scrape_has_dcgm_exporters_series_for_every_gpu(machine, tmp_path):
    exp = Exporter(machine, tmp_path)
    try:
        text = exp.wait()
        assert by_gpu(text, "DCGM_FI_DEV_GPU_TEMP") == {"0": 61.0, "1": 45.0}
        assert by_gpu(text, "DCGM_FI_DEV_POWER_USAGE") == {"0": 312.5, "1": 70.0}
        assert by_gpu(text, "DCGM_FI_DEV_SM_CLOCK") == {"0": 1980.0, "1": 1410.0}
        assert by_gpu(text, "DCGM_FI_DEV_FB_USED") == {"0": 20480.0, "1": 1024.0}
        assert by_gpu(text, "DCGM_FI_DEV_GPU_UTIL") == {"0": 50.0, "1": 7.0}
        assert by_gpu(text, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION") == {"0": 123456789.0}
        # GPM on the Hopper GPU only
        assert by_gpu(text, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE") == {"0": 0.55}
        assert by_gpu(text, "DCGM_FI_PROF_SM_ACTIVE") == {"0": 0.75}
        assert by_gpu(text, "DCGM_FI_PROF_DRAM_ACTIVE") == {"0": 0.3}
        desc = machine.description()["gpus"]
        (labels, _), _second = series(text, "DCGM_FI_DEV_GPU_TEMP")
        assert labels == {"gpu": "0", "UUID": desc[0]["uuid"], "pci_bus_id": labels["pci_bus_id"],
                          "device": "nvidia0", "modelName": desc[0]["name"], "Hostname": "fake-node",
                          "DCGM_FI_DRIVER_VERSION": machine.spec.driver_version}
        assert labels["pci_bus_id"].lower().startswith("0000") and len(labels["pci_bus_id"]) == 16
        assert by_gpu(text, "nvcontainer_gpu_up") == {"0": 1.0, "1": 1.0}
        # the host's own GPU process (this test), outside any container
        assert by_gpu(text, "nvcontainer_host_gpu_memory_bytes") == {"0": 300 << 20, "1": 64 << 20}
        assert by_gpu(text, "nvcontainer_host_gpu_processes") == {"0": 1, "1": 1}   # GPU 1's: an MPS client
        om = exp.scrape("application/openmetrics-text; version=1.0.0")
        assert om.endswith("# EOF\n") and "DCGM_FI_DEV_GPU_TEMP{" in om
        assert exp.stderr().count("\n") == 1 and "serving" in exp.stderr()
    finally:
        exp.stop()


def test_a_hung_gpu_costs_the_scrape_its_deadline_and_the_others_stay(machine, tmp_path, clear_state):
    exp = Exporter(machine, tmp_path, "--nvml-timeout", "1")
    try:
        exp.wait()
        clear_state.write_text("gpu1.hang=1\n")
        start = time.monotonic()
        text = exp.scrape()
        assert time.monotonic() - start < 4
        assert by_gpu(text, "nvcontainer_gpu_up") == {"0": 1.0, "1": 0.0}
        assert set(by_gpu(text, "DCGM_FI_DEV_GPU_TEMP")) == {"0"}
        start = time.monotonic()
        text = exp.scrape()               # the hung GPU is skipped now: no wait at all
        assert time.monotonic() - start < 1
        assert by_gpu(text, "nvcontainer_gpu_up") == {"0": 1.0, "1": 0.0}
        err = exp.stderr()
        assert "did not answer NVML" in err and "Traceback" not in err
        assert err.count("did not answer") == 1
    finally:
        exp.stop()


def test_a_gpu_off_the_bus(machine, tmp_path, clear_state):
    exp = Exporter(machine, tmp_path)
    try:
        exp.wait()
        clear_state.write_text("gpu0.lost=1\n")
        text = exp.scrape()
        assert by_gpu(text, "nvcontainer_gpu_up") == {"0": 0.0, "1": 1.0}
        assert set(by_gpu(text, "DCGM_FI_DEV_GPU_TEMP")) == {"1"}
        clear_state.unlink()
        assert by_gpu(exp.scrape(), "nvcontainer_gpu_up") == {"0": 1.0, "1": 1.0}
        assert "Traceback" not in exp.stderr()
    finally:
        exp.stop()


def test_a_slow_client_does_not_stop_the_endpoint(machine, tmp_path):
    exp = Exporter(machine, tmp_path)
    held = []
    try:
        exp.wait()
        for _ in range(4):   # connected, half a request, then silence
            s = socket.create_connection(("127.0.0.1", exp.port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        s = socket.create_connection(("127.0.0.1", exp.port))   # connected, reads nothing
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
        held.append(s)
        start = time.monotonic()
        assert "DCGM_FI_DEV_GPU_TEMP" in exp.scrape(timeout=10)
        assert time.monotonic() - start < 5
        assert exp.proc.poll() is None and "Traceback" not in exp.stderr()
    finally:
        for s in held:
            s.close()
        exp.stop()


def test_counters_file_unknown_fields_are_one_line_and_duplicates_refuse_to_start(machine, tmp_path):
    good = tmp_path / "counters.csv"
    good.write_text("# mine\nDCGM_FI_DEV_GPU_TEMP, gauge, temp\nDCGM_FI_DEV_NOT_A_FIELD, gauge, x\n"
                    "DCGM_FI_DEV_VGPU_LICENSE_STATUS, gauge, vGPU License status\n")
    exp = Exporter(machine, tmp_path, "-f", str(good))
    try:
        text = exp.wait()
        assert series(text, "DCGM_FI_DEV_GPU_TEMP") and not series(text, "DCGM_FI_DEV_POWER_USAGE")
        (line,) = [ln for ln in exp.stderr().splitlines() if "not exported" in ln]
        assert "DCGM_FI_DEV_NOT_A_FIELD, DCGM_FI_DEV_VGPU_LICENSE_STATUS" in line
    finally:
        exp.stop()
    bad = tmp_path / "dup.csv"
    bad.write_text("DCGM_FI_DEV_GPU_TEMP, gauge, a\nDCGM_FI_DEV_GPU_TEMP, gauge, b\n")
    exp = Exporter(machine, tmp_path, "-f", str(bad))
    assert exp.proc.wait(timeout=60) != 0
    err = exp.stderr()
    assert err.count("\n") == 1 and "line 2: DCGM_FI_DEV_GPU_TEMP repeats line 1" in err and "Traceback" not in err


def test_sampler_asks_a_hung_gpu_again_after_its_backoff(machine, clear_state):
    """The sampler alone (the program the exporter starts), with a short backoff."""
    library = str(machine.nvml_library)
    uuids = [g["uuid"] for g in machine.description()["gpus"]]
    lines = []
    sampler = sampling.Sampler(library, None, uuids, lines.append, deadline=1.0, hang_backoff=1.0)
    try:
        first = sampler.round()
        assert set(first) == set(uuids)
        assert [p["pid"] for p in first[uuids[1]]["mps"]] == [os.getpid()]     # NVML's MPS client list
        assert first[uuids[1]]["activity"]["processes"] == []                  # not a compute process
        clear_state.write_text("gpu0.hang=1\n")
        assert set(sampler.round()) == set()                      # GPU 0 first: nothing in time
        assert set(sampler.round()) == {uuids[1]}                 # skipped now; GPU 1 answers
        clear_state.unlink()
        time.sleep(1.1)
        assert set(sampler.round()) == set(uuids)
        assert len(lines) == 2 and "every GPU" in lines[-1]
    finally:
        sampler.stop()


def test_no_driver_is_one_line_and_the_endpoint_still_answers(tmp_path, private_machine):
    m = private_machine(FakeSpec(gpus=1))
    exp = Exporter(m, tmp_path)
    try:
        exp.wait()
        m.nvml_state.write_text("fail=9\n")     # NVML_ERROR_DRIVER_NOT_LOADED from now on
        subprocess.run([sys.executable, "-c", "pass"])
        text = exp.scrape()
        assert by_gpu(text, "nvcontainer_gpu_up") == {"0": 0.0}
        assert "Traceback" not in exp.stderr()
    finally:
        exp.stop()
