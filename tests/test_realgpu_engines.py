"""benchmarks/realgpu/engines.py's judging of the timed loops (the step itself needs a real GPU
and the carried engines: ``benchmarks/realgpu.sh TOOLS OUT --only engines``)."""

from __future__ import annotations

import pytest

from benchmarks.realgpu import engines

ARMS = {"runc": 0, "runc-named": 0, "shim-nogpu": 0, "served": 0, "nvidia": 0}


class Node:
    def __init__(self):
        self.lines: list[str] = []

    def say(self, line: str = "") -> None:
        self.lines.append(line)


def loop_output(ms: dict[str, list[float]], rc: dict[str, int] | None = None) -> str:
    """What the loops print: one "T <arm> <round> <us> <rc>" per run, round 0 the warm-up."""
    out = []
    for arm, series in ms.items():
        for r, value in enumerate(series):
            out.append(f"T {arm} {r} {int(value * 1000)} {(rc or {}).get(arm, 0)}")
    return "\n".join(out) + "\nE served something went wrong once\n"


def test_overheads_are_paired_over_runc_and_judged_against_nvidias():
    node = Node()
    ms = {"runc": [500, 100, 102, 98], "runc-named": [500, 101, 103, 99], "shim-nogpu": [500, 101, 104, 99],
          "served": [500, 120, 122, 118], "nvidia": [500, 160, 162, 158]}
    got = engines._summary(node, "t", loop_output(ms), ARMS, "runc-named")
    assert got["n"] == 3   # the first round is the warm-up
    assert got["over_runc_ms"]["served"] == pytest.approx(20.0) and got["over_runc_ms"]["nvidia"] == pytest.approx(60.0)
    assert got["ratio_to_nvidia"] == pytest.approx(1 / 3)
    assert got["nogpu_over_control_ms"] == pytest.approx(0.0)
    assert "-> served overhead / NVIDIA's: 0.33x (target <= 0.5x: met)" in node.lines
    assert got["errors"] == ["E served something went wrong once"]


def test_an_arm_that_always_failed_is_said_and_judges_nothing():
    node = Node()
    ms = {"runc": [5, 100, 100], "runc-named": [5, 100, 100], "shim-nogpu": [5, 103, 104],
          "served": [5, 1, 1], "nvidia": [5, 150, 150]}
    got = engines._summary(node, "t", loop_output(ms, {"served": 1}), ARMS, "runc-named")
    assert got["failed"]["served"] == 2 and got["arms"]["served"]["ms"] == []
    assert got["ratio_to_nvidia"] is None
    assert any(line.startswith("served") and "all failed" in line for line in node.lines)
    assert "-> no GPU through our runtime over runc-named: +3.5 ms (target <= 2.0 ms: NOT MET)" in node.lines
