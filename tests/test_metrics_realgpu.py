"""benchmarks/realgpu/metrics.py's judging of a scrape, on bodies our own encoder writes (the
step itself needs a real GPU: ``benchmarks/realgpu.sh TOOLS OUT --only metrics``)."""

from __future__ import annotations

from benchmarks.realgpu import metrics as step
from nvcontainer.metrics import counters, families, server
from tests.test_metrics_core import U0, entry, inventory, view


def body(gpm: bool = True, name: str = "c" * 64) -> str:
    e = entry(U0, gpu_util=50)
    e["gpm"] = {"sm_active": 0.5, "tensor_active": 0.25, "dram_active": 0.125} if gpm else {}
    fams = families.build(inventory(), counters.default(), {U0: e}, view('we"ird\nname', cid=name), None, "n",
                          {"nvml": True})
    return server.encode(fams, "")[0].decode()


def test_a_good_scrape_attributes_the_container_and_has_gpm():
    got = step.judge(body(), "c" * 64, hopper=True)
    assert got["attributed"] and got["container_memory"] == 300 << 20
    assert got["gpm_present"] and got["dcgm_series"]
    assert got["gpu0"]["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"] == 0.25


def test_what_the_step_would_report_as_missing():
    assert step.judge(body(), "d" * 64, hopper=True)["attributed"] is False
    assert step.judge(body(gpm=False), "c" * 64, hopper=True)["gpm_present"] is False
    assert step.judge(body(gpm=False), "c" * 64, hopper=False)["gpm_present"] is None


def test_the_reader_unescapes_label_values():
    ((labels, value),) = step.samples(body(), "nvcontainer_container_gpu_memory_bytes")
    assert labels["container_name"] == 'we"ird\nname' and value == 300 << 20
