"""Issue 27's targets table (benchmarks/targets.py) over plain figures, and the fake machine's
report (benchmarks/report.py) that ends with it: the ratios against NVIDIA's arm, the limits (a
real node's, the fake machine's, or "needs a real GPU"), and a missing NVIDIA arm or burst
shown as such. No timing is run here."""

from __future__ import annotations

import pytest

from benchmarks import report as run, targets


def figures(**over) -> dict:
    fig = {"overhead": {"served": 10.0, "hook": 30.0, "nvidia": 20.0, "served-nogpu": 0.5, "hook-nogpu": 1.0,
                        "nvidia-nogpu": 3.0, "empty": 0.2},
           "cpu": {"served": 8.0, "hook": 40.0, "nvidia": 20.0},
           "burst": {"served": 60.0, "hook": 150.0, "nvidia": 200.0},
           "burst_failed": {"none": 0, "served": 0, "hook": 0, "nvidia": 0},
           "at_once": 32, "list_ms": 60.0, "growth": 1.1}
    for key, value in over.items():
        fig[key] = dict(fig[key], **value) if isinstance(value, dict) else value
    return fig


def row(rows, start: str) -> tuple:
    (found,) = [r for r in rows if r[1].startswith(start)]
    return found


def test_the_fake_machine_judges_served_at_1x_and_leaves_cpu_and_in_process_to_a_real_node():
    rows = targets.judge(figures(), real_node=False)
    target, _, value, unit, limit, verdict = row(rows, "served + native client")
    assert (target, value, unit, limit, verdict) == ("1", 0.5, "x", "<= 1x (fake machine)", True)
    assert row(rows, "served: CPU per start")[2:] == (0.4, "x", "<= 0.5x on a real node", targets.NEEDS_GPU)
    assert row(rows, "in-process: overhead")[2:] == (1.5, "x", "<= 1.2x on a real node", targets.NEEDS_GPU)
    slower = targets.judge(figures(overhead={"served": 21.0}), real_node=False)
    assert row(slower, "served + native client")[5] is False


def test_a_real_node_judges_every_ratio_with_its_own_limits():
    rows = targets.judge(figures(overhead={"served": 5.0}), real_node=True)
    assert row(rows, "served + native client")[2:] == (0.25, "x", "<= 0.25x", True)
    assert row(rows, "served: CPU per start")[2:] == (0.4, "x", "<= 0.5x", True)
    assert row(rows, "in-process: overhead")[2:] == (1.5, "x", "<= 1.2x", False)
    worse = targets.judge(figures(overhead={"served": 5.2}, cpu={"served": 10.2}), real_node=True)
    assert row(worse, "served + native client")[5] is False and row(worse, "served: CPU per start")[5] is False
    assert not [r for r in rows if r[5] == targets.NEEDS_GPU]


@pytest.mark.parametrize("real_node", [False, True])
def test_bursts_are_the_added_p95_over_nvidia_s(real_node):
    rows = targets.judge(figures(burst={"served": 60.0, "hook": 200.0}), real_node)
    assert row(rows, "32 at once, served")[2:] == (0.3, "x", "<= 0.3x", True)
    assert row(rows, "32 at once, in-process")[2:] == (1.0, "x", "<= 1x", True)
    worse = targets.judge(figures(burst={"served": 61.0, "hook": 201.0}), real_node)
    assert row(worse, "32 at once, served")[5] is False and row(worse, "32 at once, in-process")[5] is False


def test_a_burst_of_another_size_is_shown_and_not_judged():
    rows = targets.judge(figures(at_once=8), real_node=False)
    assert row(rows, "8 at once, served")[2] == 0.3
    assert row(rows, "8 at once, served")[5] == "n/a: 8 at once, the limit is for 32"


def test_a_burst_with_failed_starts_is_not_judged():
    rows = targets.judge(figures(burst_failed={"none": 0, "served": 0, "hook": 1, "nvidia": 2}), real_node=True)
    assert row(rows, "32 at once, served")[5] == "not judged: failed starts nvidia 2"
    assert row(rows, "32 at once, in-process")[5] == "not judged: failed starts hook 1, nvidia 2"
    ours = targets.judge(figures(burst_failed={"none": 0, "served": 0, "hook": 1, "nvidia": 0}), real_node=True)
    assert row(ours, "32 at once, served")[5] is True


def test_without_nvidia_s_arm_every_ratio_says_so():
    rows = targets.judge(figures(overhead={"nvidia": None}, cpu={"nvidia": None}, burst={"nvidia": None}),
                         real_node=True)
    ratios = [r for r in rows if r[3] == "x"]
    assert len(ratios) == 5 and all(r[2] is None and r[5] == targets.NO_NVIDIA for r in ratios)
    nothing = targets.judge(figures(burst={"served": None, "hook": None, "nvidia": None}), real_node=False)
    assert row(nothing, "32 at once, served")[5] == "not measured"
    free = targets.judge(figures(overhead={"nvidia": -0.5}), real_node=False)
    assert row(free, "served + native client")[2:4] == (None, "x")
    assert "no ratio" in row(free, "served + native client")[5]


def test_the_regression_rows():
    rows = targets.judge(figures(overhead={"hook-nogpu": 21.0}), real_node=False)
    assert row(rows, "no GPU asked, served")[2:] == (0.5, "ms", "<= 2 ms (issue 17's)", True)
    assert row(rows, "no GPU asked, in-process")[5] is False
    assert row(rows, "nvcontainer list")[2] == 60.0 and row(rows, "8 GPUs")[2:] == (1.1, "x", "<= 1.3x (issue 17's)", True)
    real = targets.judge(figures(), real_node=True)
    assert not [r for r in real if r[1].startswith(("nvcontainer list", "8 GPUs"))]


def test_figures_from_a_run_s_summaries():
    s = {"v1/none": {"median": 30.0, "p95": 40.0}, "v1/served": {"median": 42.0}, "v1/hook": {"median": 70.0},
         "v1/nvidia": {"median": 50.0}, "v1/none/cpu": {"median": 20.0}, "v1/served/cpu": {"median": 31.0},
         "v1/nvidia/cpu": {"median": 40.0}, "concurrent-none": {"p95": 300.0}, "concurrent-served": {"p95": 330.0},
         "concurrent-nvidia": {"p95": 400.0}, "commands/list": {"median": 61.0},
         "growth/none": {"median": 30.0}, "growth/one": {"median": 40.0}, "growth/all": {"median": 42.0}}
    fig = targets.from_summaries(s, 32)
    assert fig["overhead"]["served"] == 12.0 and fig["overhead"]["hook"] == 40.0 and fig["overhead"]["nvidia"] == 20.0
    assert fig["overhead"]["empty"] is None and fig["cpu"] == {"served": 11.0, "hook": None, "nvidia": 20.0}
    assert fig["burst"] == {"served": 30.0, "hook": None, "nvidia": 100.0}
    assert (fig["list_ms"], fig["growth"], fig["at_once"]) == (61.0, 1.2, 32)


def test_figures_from_a_real_node_s_record():
    record = {"timing": {"summary": {"served": {"over_none": 10.6, "cpu_over_none": 31.9},
                                     "nvidia": {"over_none": 38.1, "cpu_over_none": 40.9},
                                     "hook": {"over_none": 73.2, "cpu_over_none": 82.1}}},
              "concurrent": {"at_once": 32, "summary": {"none": {"p95": 127.0}, "served": {"p95_added": 215.0},
                                                        "nvidia": {"p95_added": 263.0}}}}
    fig = targets.from_realgpu(record)
    assert fig["overhead"]["served"] == 10.6 and fig["cpu"]["nvidia"] == 40.9
    assert fig["burst"] == {"served": 215.0, "hook": None, "nvidia": 263.0} and fig["at_once"] == 32
    rows = targets.judge(fig, real_node=True)
    assert row(rows, "served + native client")[2] == pytest.approx(10.6 / 38.1)
    assert row(rows, "32 at once, served")[2] == pytest.approx(215 / 263)


def test_rendered_and_invalidated():
    rows = targets.invalidate(targets.judge(figures(), real_node=False), "INVALID: not served")
    assert not [r for r in rows if isinstance(r[5], bool)] and row(rows, "served: CPU")[5] == targets.NEEDS_GPU
    text = targets.render(targets.judge(figures(), real_node=False), "heading", ["footer"])
    assert text.startswith("heading\n") and text.endswith("footer\n")
    line = next(x for x in text.splitlines() if "served + native client" in x)
    assert line.split()[0] == "1" and "0.50x" in line and line.endswith("met")
    assert "+10.0 ms" in text and "60.0 ms" in text and targets.NEEDS_GPU in text


FACTS = {"cpu": "cpu", "cpus": 2, "memory_mib": 1, "os": "os", "kernel": "k", "python": "p", "runc": "runc",
         "page_fault_us": 1.0, "loadavg_start": 0.1, "loadavg_end": 0.2}


def series(ms: float, cpu: float | None = None) -> dict:
    out = {"ms": [ms, ms + 1.0, ms - 1.0], "failures": []}
    if cpu is not None:
        out["cpu_ms"] = [cpu] * 3
    return out


def results(nvidia: bool = True) -> dict:
    v1 = {"none": series(30.0, 20.0), "served": series(40.0, 30.0), "hook": series(60.0, 60.0),
          "served-nogpu": series(30.5), "hook-nogpu": series(31.0), "empty": series(30.2)}
    out = {"v1": v1, "concurrent-none": series(300.0), "concurrent-served": series(330.0),
           "concurrent-hook": series(400.0)}
    if nvidia:
        v1.update(nvidia=series(50.0, 45.0), **{"nvidia-nogpu": series(33.0)})
        out["concurrent-nvidia"] = series(400.0)
    return out


def test_the_run_s_report_ends_with_issue_27_s_table():
    text, record = run.report(results(), dict(FACTS), runs=3, concurrency=32, nvml_delay=300)
    table = text[text.index("issue 27's targets"):]
    served = next(x for x in table.splitlines() if "served + native client" in x)
    assert "0.50x" in served and served.endswith("met")                  # (40 - 30) / (50 - 30)
    burst = next(x for x in table.splitlines() if "32 at once, served" in x)
    assert "0.30x" in burst and burst.endswith("met")                     # (330 - 300) / (400 - 300)
    assert next(x for x in table.splitlines() if "32 at once, in-process" in x).endswith("met")
    assert "NVIDIA's hook 1.17.9 + cli 1.17.0" in text[:text.index("issue 27's targets")]   # the burst's row
    assert targets.NEEDS_GPU in table and "benchmarks.deviceplugin" in table and "benchmarks.docker" in table
    issue27 = {r["label"]: r for r in record["derived"]["issue27"]}
    assert issue27["served: CPU per start (added) / NVIDIA's"]["value"] == pytest.approx(10 / 25)
    broken = results()
    broken["concurrent-nvidia"]["failures"] = ["runc: hook failed"]
    _, record = run.report(broken, dict(FACTS), runs=3, concurrency=32, nvml_delay=300)
    assert {r["label"]: r for r in record["derived"]["issue27"]}["32 at once, served: p95 added / NVIDIA's"]["met"] \
        == "not judged: failed starts nvidia 1"


def test_the_run_s_report_without_nvidia_s_arm_says_so():
    text, record = run.report(results(nvidia=False), dict(FACTS), runs=3, concurrency=32, nvml_delay=300)
    table = text[text.index("issue 27's targets"):]
    assert "NVIDIA's arm absent" in table.splitlines()[0]
    assert all(r["met"] == targets.NO_NVIDIA for r in record["derived"]["issue27"] if r["unit"] == "x"
               and r["target"] in ("1", "2", "3"))
