"""Summaries of timing samples and the printed table: pure functions over plain data."""

from __future__ import annotations

import math
import statistics


def summary(samples: list[float]) -> dict:
    """n, median, p95 (nearest rank), min, max and mean of ``samples`` (milliseconds)."""
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p95": ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)],
        "min": ordered[0],
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


def paired_median(a: list[float], b: list[float]) -> float | None:
    """Median of the per-iteration differences ``a[i] - b[i]`` of two interleaved series: less
    sensitive than a difference of medians to the machine getting slower or faster mid-run."""
    if not a or len(a) != len(b):
        return None
    return statistics.median(x - y for x, y in zip(a, b))


def _cell(value) -> str:
    return "-" if value is None else f"{value:8.1f}"


def _verdict(met) -> str:
    if isinstance(met, str):
        return met
    return "n/a" if met is None else "met" if met else "NOT MET"


def table(rows: list[tuple[str, dict]], checks: list[tuple[str, float | None, str, bool | str | None]],
          notes: list[str] = (), comparison: list[tuple[str, float | None, str, bool | str | None]] = ()) -> str:
    """Rows of (label, summary); free ``notes`` lines after them; checks of (label, measured,
    target text, met: a bool, None for n/a, or a verdict of its own); ``comparison``: checks
    shown under the targets, of what the targets are not judged on."""
    width = max([len(label) for label, _ in rows] + [len(label) for label, *_ in (*checks, *comparison)] + [20])
    out = [f"{'':{width}}     n   median      p95      min      max   (ms)"]
    for label, s in rows:
        if label.startswith("#"):
            out.append(label[1:].strip())
            continue
        if not s.get("n"):
            out.append(f"{label:{width}}     0")
            continue
        out.append(f"{label:{width}} {s['n']:5d} {_cell(s['median'])} {_cell(s['p95'])} {_cell(s['min'])} {_cell(s['max'])}")
    if notes:
        out.append("")
        out += notes
    for heading, group in (("absolute targets (issues 6 and 26)", checks), ("for comparison: the in-process hook", comparison)):
        if group:
            out.append("")
            out.append(heading)
            for label, value, target, met in group:
                out.append(f"{label:{width}}       {_cell(value)}   {target:<28} {_verdict(met)}")
    return "\n".join(out) + "\n"


def nearest_rank(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered``, by nearest rank."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def latency_summary(latencies: list[float]) -> dict:
    """p50, p90, p99, max and mean of many RPC latencies (the device plugin's and DRA driver's)."""
    ordered = sorted(latencies)
    if not ordered:
        return {"n": 0}
    return {"n": len(ordered), "p50": nearest_rank(ordered, 0.50), "p90": nearest_rank(ordered, 0.90),
            "p99": nearest_rank(ordered, 0.99), "max": ordered[-1], "mean": sum(ordered) / len(ordered)}


def importtime_top(text: str, limit: int) -> list[str]:
    """The ``limit`` slowest top-level imports (cumulative µs) of ``-X importtime`` output."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("import time:") or "|" not in line or "cumulative" in line:
            continue
        _, self_us, cumulative, name = (part.strip() for part in line.replace("import time:", "|").split("|"))
        rows.append((int(cumulative), int(self_us), name))
    rows.sort(reverse=True)
    return [f"{c / 1000:7.1f} ms  (self {s / 1000:5.1f})  {n}" for c, s, n in rows[:limit]]
