"""benchmarks/dockernode.py's judging of a round-robin world's samples, which benchmarks.docker,
benchmarks.cri and the real-GPU engines step share (their worlds need engines; this needs none)."""

from __future__ import annotations

import pytest

from benchmarks import dockernode


def samples(ms: dict[str, list[float]], failed: dict[str, set[int]] | None = None) -> dict:
    """(round, ms, rc) per arm, round 0 the first start; ``failed`` names the rounds that exited 1."""
    return {arm: [(r, v, 1 if r in (failed or {}).get(arm, set()) else 0) for r, v in enumerate(series)]
            for arm, series in ms.items()}


def test_rounds_are_paired_and_a_failed_round_cuts_every_arm_to_the_same_count():
    j = dockernode.judged(samples({"runc": [900, 100, 101, 99, 100], "served": [950, 110, 112, 108, 500]},
                                  {"served": {4}}))
    assert j["first"] == {"runc": (900, 0), "served": (950, 0)}   # the first start apart, never timed
    assert j["failed"] == {"runc": 0, "served": 1} and j["n"] == 3
    assert j["timed"] == {"runc": [100, 101, 99], "served": [110, 112, 108]}
    assert j["over"] == {"served": pytest.approx(10.0)}


def test_the_ratio_needs_both_overheads_and_nvidias_above_zero():
    assert dockernode.ratio_to_nvidia({"served": 20.0, "nvidia": 60.0}) == pytest.approx(1 / 3)
    assert dockernode.ratio_to_nvidia({"inprocess": 90.0, "nvidia": 60.0}, "inprocess") == pytest.approx(1.5)
    assert dockernode.ratio_to_nvidia({"served": 20.0, "nvidia": -1.0}) is None
    assert dockernode.ratio_to_nvidia({"served": None, "nvidia": 60.0}) is None
    assert dockernode.ratio_to_nvidia({"served": 20.0}) is None


def test_verdicts_read_as_the_targets_do():
    assert dockernode.verdict("served overhead / NVIDIA's", 0.5, 0.5, "x") == \
        "served overhead / NVIDIA's: 0.50x (target <= 0.5x: met)"
    assert dockernode.verdict("no GPU", 2.04, 2.0, " ms") == "no GPU: +2.0 ms (target <= 2.0 ms: NOT MET)"


def test_the_table_shows_the_first_start_and_an_arm_that_always_failed():
    j = dockernode.judged(samples({"runc": [300, 100, 102], "served": [350, 120, 121], "nvidia": [5, 1, 1]},
                                  {"nvidia": {1, 2}}))
    lines = dockernode.table(j, ("median", "max"), first=True, failed=True)
    assert lines[0].split() == ["arm", "first", "median", "max", "over", "runc", "failed"]
    assert lines[1].split() == ["runc", "300.0", "101.0", "102.0", "0"]
    assert lines[2].split() == ["served", "350.0", "120.5", "121.0", "+19.5", "0"]
    assert lines[3].split() == ["nvidia", "all", "failed", "2"]
    assert len(lines[1]) == len(lines[2]) == len(lines[3])   # columns line up
