"""``benchmarks/dockertrace.py``'s reading of ``perf script``: one made-up served ``docker run``
whose every step is known, written the way perf prints the scheduler's tracepoints."""

from __future__ import annotations

import pytest

from benchmarks import dockertrace as dt


def _line(time: float, tid: int, event: str, trace: str, comm: str = "x", cpu: int = 0) -> str:
    return f"{comm:>16} {tid:5}/{tid:<5} [{cpu:03d}] {time:.6f}: sched:sched_{event}: {trace}"


def exec_(time, tid, filename):
    return _line(time, tid, "process_exec", f"filename={filename} pid={tid} old_pid={tid}")


def fork(time, parent, child):
    return _line(time, parent, "process_fork", f"comm=x pid={parent} child_comm=x child_pid={child}")


def exit_(time, tid):
    return _line(time, tid, "process_exit", f"comm=x pid={tid} prio=120")


def runs_on(start, end, tid, cpu=0):
    """``tid`` on ``cpu`` from ``start`` to ``end`` (switched in from idle, then out to it)."""
    return [_line(start, 0, "switch", f"prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> "
                                      f"next_comm=x next_pid={tid} next_prio=120", cpu=cpu),
            _line(end, tid, "switch", f"prev_comm=x prev_pid={tid} prev_prio=120 prev_state=S ==> "
                                      f"next_comm=swapper/0 next_pid=0 next_prio=120", cpu=cpu)]


ROOT = 100


def served_run() -> str:
    """The benchmark's tree: bash, the server (a spare that warms up for 10 ms, sleeps, then
    takes the hook's request), dockerd and containerd; a ``docker info`` poll, then one
    ``docker run`` from 2.000 to 2.200 s with every step at a known time; another session's
    process runs meanwhile."""
    lines = [
        exec_(1.000, ROOT, "/usr/bin/unshare"), fork(1.001, ROOT, 101), exec_(1.002, 101, "/usr/bin/bash"),
        fork(1.003, 101, 102), exec_(1.004, 102, "/ws/venv/bin/python"),
        fork(1.005, 101, 103), exec_(1.006, 103, "/usr/bin/dockerd"),
        fork(1.007, 103, 104), exec_(1.008, 104, "/usr/bin/containerd"),
        fork(1.009, 102, 110), *runs_on(1.010, 1.020, 110),                       # the spare's warm-up
        fork(1.500, 101, 115), exec_(1.500, 115, "/usr/local/bin/docker"), exit_(1.510, 115),   # docker info
        fork(2.000, 101, 120), exec_(2.000, 120, "/usr/local/bin/docker"),
        fork(2.010, 104, 130), exec_(2.010, 130, "/usr/bin/containerd-shim-runc-v2"),
        fork(2.020, 130, 131), exec_(2.020, 131, "/n/served/nvidia-container-runtime"),
        exec_(2.025, 131, "/usr/sbin/runc"),
        fork(2.030, 131, 132), exec_(2.030, 132, "/proc/self/exe"),
        *runs_on(2.050, 2.060, 999, cpu=1),                                       # not ours
        fork(2.100, 131, 140), exec_(2.100, 140, "/n/hook-served/nvidia-container-runtime-hook"),
        exec_(2.101, 140, "/ws/venv/bin/nvcontainer-hook-client"),
        *runs_on(2.102, 2.110, 110),                                              # the request
        fork(2.110, 110, 111), exec_(2.111, 111, "/dev/fd/3"), *runs_on(2.111, 2.113, 111), exit_(2.113, 111),
        exit_(2.115, 140), exit_(2.130, 131),
        fork(2.140, 130, 150), exec_(2.140, 150, "/usr/sbin/runc"), exit_(2.145, 150),
        exec_(2.150, 132, "/bin/true"), exit_(2.152, 132),
        fork(2.170, 130, 160), exec_(2.170, 160, "/usr/sbin/runc"), exit_(2.175, 160),
        exit_(2.200, 120),
    ]
    return "\n".join(lines) + "\nnot a perf line\n"


@pytest.fixture
def trace():
    return dt.follow(dt.parse(served_run()), ROOT)


def test_each_process_is_named_for_what_it_ran(trace):
    assert trace.category[102] == "nvcontainer serve"
    assert trace.category[110] == "serve: request child" and trace.category[111] == "ldconfig"
    assert trace.category[131] == "runc" and trace.category[140] == "our hook"
    assert trace.category[132] == "container" and trace.category[130] == "containerd shim"
    assert 999 not in trace.category   # another session's process is nobody's


def test_a_run_is_cut_at_the_steps_its_processes_mark(trace):
    (_, s0, e0), (_, start, end) = dt.runs(trace)
    assert (s0, e0) == (1.500, 1.510)
    woke = dt.warm_ups(trace)
    got = dt.cut(trace, start, end, woke)
    expected = {"to create": 20, "create": 110, "runtime before runc": 5, "runc to hook": 75, "hook": 15,
                "ldconfig": 2, "hook to runc's exit": 15, "create -> start": 10, "start": 5, "container": 7,
                "to delete": 18, "delete": 5, "after delete": 25, "wall": 200}
    assert {k: round(v, 3) for k, v in got["phases"].items()} == expected
    assert got["runtime calls"] == 3
    # the spare's request and its ldconfig are this run's; its warm-up (before the run) is not
    assert {k: round(v, 3) for k, v in got["cpu"].items()} == {"serve: request child": 8, "ldconfig": 2}


def test_a_spare_s_warm_up_is_told_apart_from_its_request(trace):
    woke = dt.warm_ups(trace)
    assert woke == {110: 2.102}
    assert [round(c, 3) for c in dt.spare_costs(trace, woke)] == [10.0]
    # a window over the warm-up counts it as such, not as a request's work
    assert {k: round(v, 3) for k, v in dt.cut(trace, 1.0, 1.5, woke)["cpu"].items()} == {"serve: spares' warm-up": 10}


def test_the_summary_is_the_median_per_arm_and_the_table_shows_every_arm(trace):
    (_, _, _), (_, start, end) = dt.runs(trace)
    one = dt.cut(trace, start, end, dt.warm_ups(trace))
    slower = {"phases": {**one["phases"], "wall": 300.0}, "cpu": {"serve: request child": 12.0}}
    summary = dt.summarize({"served": [one, slower, one], "runc": [{"phases": {"wall": 150.0}, "cpu": {}}]})
    assert summary["served"]["phases"]["wall"] == pytest.approx(200) and summary["served"]["n"] == 3
    assert summary["served"]["cpu"]["serve: request child"] == pytest.approx(8)
    text = dt.table(summary)
    assert text.splitlines()[0].split()[-2:] == ["served", "runc"]
    assert "runc to hook" in text and "wall" in text


def test_runs_are_matched_to_arms_in_the_benchmark_s_order():
    samples = {"a": [(0, 1.0, 0), (1, 1.0, 0)], "b": [(0, 1.0, 0), (1, 1.0, 0)], "c": [(0, 1.0, 0), (1, 1.0, 0)]}
    assert dt._in_run_order(samples) == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1)]
