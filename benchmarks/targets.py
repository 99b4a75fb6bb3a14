"""Issue 27's targets ("fast everywhere a container starts"), judged from plain figures: one
table for both runners, the fake machine's (``python -m benchmarks``) and a real node's
(``benchmarks/realgpu.sh``).

Why one module of pure functions: the two runners time the same arms in different ways (worlds
in the fake machine's ``/proc`` view; ``runc`` on a bare GPU node), but the targets are the same
ratios against NVIDIA's hook 1.17.9 + cli 1.17.0 timed in the same run, and the limits differ
only where the fake machine cannot stand for a real one: its NVML is free, which makes NVIDIA's
cli cheaper than on any real driver, so the served start's 0.25x and its CPU's 0.5x, and the
in-process start's 1.2x, are for a real node (the fake machine's served limit is 1.0x). Each
runner reduces its samples to a dict of figures (:func:`from_summaries`, :func:`from_realgpu`);
:func:`judge` turns them into rows and :func:`render` prints them. A target whose figures are
missing (no NVIDIA arm, a burst not run) stays in the table with a verdict that says why, never
a silent gap.

The figures, milliseconds unless said (None where the run has no such arm):

* ``overhead``: arm -> median start time minus the no-hook arm's (``served``, ``hook`` (in
  process), ``nvidia``, and ``served-nogpu``, ``hook-nogpu``, ``nvidia-nogpu``, ``empty``);
* ``cpu``: arm -> median CPU of a start minus the no-hook arm's (``served``, ``hook``, ``nvidia``);
* ``burst``: arm -> p95 of ``at_once`` starts spawned together minus the no-hook burst's p95;
  ``burst_failed``: arm (``none`` too) -> starts of its burst that failed (a p95 over the rest
  would flatter it: such a burst is not judged);
* ``at_once``; ``list_ms`` (``nvcontainer list`` warm, median); ``growth`` (8 GPUs served: the
  overhead of all over that of one; issue 17).
"""

from __future__ import annotations

ARMS = ("served", "hook", "nvidia")
SINGLE = (*ARMS, "served-nogpu", "hook-nogpu", "nvidia-nogpu", "empty")
BURST_SIZE = 32                      # target 3 is for 32 starts at once

# (real node, fake machine); None: the limit is for a real node only
SERVED = (0.25, 1.0)
SERVED_CPU = (0.5, None)
INPROCESS = (1.2, None)
BURST_SERVED = (0.3, 0.3)
BURST_INPROCESS = (1.0, 1.0)
NOGPU_SERVED_MS, NOGPU_INPROCESS_MS, GROWTH = 2.0, 20.0, 1.3   # issue 17's, kept as the regression line

NEEDS_GPU = "needs a real GPU"
NO_NVIDIA = "no NVIDIA arm"


def _minus(a, b):
    return None if a is None or b is None else a - b


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else a / b


def from_summaries(s: dict, at_once: int, failures: dict | None = None) -> dict:
    """The figures of a ``python -m benchmarks`` run: ``s`` maps a series (``v1/served``,
    ``v1/served/cpu``, ``concurrent-served``, ``commands/list``, ...) to its summary
    (``median``, ``p95``); ``failures`` a series to its count of failed runs."""
    def med(name):
        return s.get(name, {}).get("median")

    def p95(name):
        return s.get(name, {}).get("p95")

    return {"overhead": {arm: _minus(med(f"v1/{arm}"), med("v1/none")) for arm in SINGLE},
            "cpu": {arm: _minus(med(f"v1/{arm}/cpu"), med("v1/none/cpu")) for arm in ARMS},
            "burst": {arm: _minus(p95(f"concurrent-{arm}"), p95("concurrent-none")) for arm in ARMS},
            "burst_failed": {arm: (failures or {}).get(f"concurrent-{arm}", 0) for arm in ("none", *ARMS)},
            "at_once": at_once, "list_ms": med("commands/list"),
            "growth": _ratio(_minus(med("growth/all"), med("growth/none")),
                             _minus(med("growth/one"), med("growth/none")))}


def from_realgpu(report: dict) -> dict:
    """The figures of a real-GPU check's record (``benchmarks/realgpu/``): its ``timing`` step (``over_none``,
    ``cpu_over_none`` per arm) and its ``concurrent`` step (``p95_added`` per arm)."""
    single = report.get("timing", {}).get("summary", {})
    burst = report.get("concurrent", {})
    return {"overhead": {arm: single.get(arm, {}).get("over_none") for arm in SINGLE},
            "cpu": {arm: single.get(arm, {}).get("cpu_over_none") for arm in ARMS},
            "burst": {arm: burst.get("summary", {}).get(arm, {}).get("p95_added") for arm in ARMS},
            "burst_failed": {arm: len(burst.get("samples", {}).get(arm, {}).get("failed", []))
                             for arm in ("none", *ARMS)},
            "at_once": burst.get("at_once"), "list_ms": None, "growth": None}


def _against_nvidia(ours, theirs, limits: tuple, real_node: bool):
    """(ratio, limit text, verdict) of ``ours`` over NVIDIA's figure."""
    limit = limits[0] if real_node else limits[1]
    text = (f"<= {limit:g}x" if limit is not None else f"<= {limits[0]:g}x on a real node") + \
        ("" if real_node or limit is None or limits[0] == limits[1] else " (fake machine)")
    value = _ratio(ours, theirs)
    if ours is None:
        return None, text, "not measured"
    if theirs is None:
        return None, text, NO_NVIDIA
    if value is None:
        return None, text, f"NVIDIA's figure {theirs:+.1f} ms: no ratio"
    return value, text, (NEEDS_GPU if limit is None else value <= limit)


def _burst_verdict(verdict, at_once, failed: dict):
    if not isinstance(verdict, bool):
        return verdict
    if any(failed.values()):
        return "not judged: failed starts " + ", ".join(f"{arm} {n}" for arm, n in failed.items() if n)
    if at_once != BURST_SIZE:
        return f"n/a: {at_once} at once, the limit is for {BURST_SIZE}"
    return verdict


def judge(fig: dict, real_node: bool) -> list[tuple]:
    """Rows of (target, label, value, unit, limit, verdict): verdict True (met), False (not met),
    a string saying why it is not judged, or None for a figure shown for reading."""
    over, cpu, burst, at_once = fig["overhead"], fig["cpu"], fig["burst"], fig.get("at_once")
    rows = []

    def against(target, label, ours, theirs, limits, arm=None):
        value, text, verdict = _against_nvidia(ours, theirs, limits, real_node)
        if target == "3":
            failed = fig.get("burst_failed", {})
            verdict = _burst_verdict(verdict, at_once, {a: failed.get(a, 0) for a in ("none", arm, "nvidia")})
        rows.append((target, label, value, "x", text, verdict))

    def figure(label, value, unit="ms"):
        rows.append(("", f"  {label}", value, unit, "", None))

    against("1", "served + native client: overhead / NVIDIA's", over["served"], over["nvidia"], SERVED)
    figure("served: overhead", over["served"])
    figure("NVIDIA's hook + cli: overhead", over["nvidia"])
    against("1", "served: CPU per start (added) / NVIDIA's", cpu["served"], cpu["nvidia"], SERVED_CPU)
    figure("served: added CPU per start (server's tree included)", cpu["served"])
    figure("NVIDIA's: added CPU per start", cpu["nvidia"])
    against("2", "in-process: overhead / NVIDIA's", over["hook"], over["nvidia"], INPROCESS)
    figure("in-process: overhead", over["hook"])
    figure("in-process: added CPU per start", cpu["hook"])
    n = at_once if at_once is not None else BURST_SIZE
    against("3", f"{n} at once, served: p95 added / NVIDIA's", burst["served"], burst["nvidia"], BURST_SERVED,
            "served")
    against("3", f"{n} at once, in-process: p95 added / NVIDIA's", burst["hook"], burst["nvidia"],
            BURST_INPROCESS, "hook")
    for arm, label in (("served", "served"), ("hook", "in-process"), ("nvidia", "NVIDIA's")):
        figure(f"{label}: p95 added over the no-hook burst's", burst[arm])

    def within(label, value, limit, unit="ms"):
        verdict = "not measured" if value is None else value <= limit
        rows.append(("5", label, value, unit, f"<= {limit:g}{' ms' if unit == 'ms' else unit} (issue 17's)", verdict))

    within("no GPU asked, served registration: overhead", over["served-nogpu"], NOGPU_SERVED_MS)
    within("no GPU asked, in-process registration: overhead", over["hook-nogpu"], NOGPU_INPROCESS_MS)
    figure("no GPU asked, NVIDIA's hook: overhead", over["nvidia-nogpu"])
    figure("a hook that does nothing: overhead (the floor)", over["empty"])
    if not real_node:
        rows.append(("5", "nvcontainer list, warm cache (median)", fig.get("list_ms"), "ms absolute",
                     "no regression: against the record",
                     "not measured" if fig.get("list_ms") is None else "not judged (absolute)"))
        if fig.get("growth") is not None:
            within("8 GPUs, served: overhead of all / of one", fig["growth"], GROWTH, unit="x")
    return rows


def invalidate(rows: list[tuple], why: str) -> list[tuple]:
    """Every judged verdict replaced by ``why`` (a served registration was not served: its
    figures are an in-process run's)."""
    return [(*row[:5], why) if isinstance(row[5], bool) else row for row in rows]


def _value(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:.1f} ms" if unit == "ms absolute" else f"{value:+.1f} ms"


def _verdict(verdict) -> str:
    if verdict is None:
        return ""
    if isinstance(verdict, bool):
        return "met" if verdict else "NOT MET"
    return verdict


def render(rows: list[tuple], heading: str, footer: list[str] = ()) -> str:
    """The rows as a table: target number, measure, this run's value, limit, verdict."""
    width = max([len(row[1]) for row in rows] + [40])
    out = [heading, f"   {'measure':{width}} {'this run':>10}   {'limit':<36} verdict"]
    for target, label, value, unit, limit, verdict in rows:
        out.append(f"{target:>2} {label:{width}} {_value(value, unit):>10}   {limit:<36} {_verdict(verdict)}".rstrip())
    out += footer
    return "\n".join(out) + "\n"


def record(rows: list[tuple]) -> list[dict]:
    """The rows for a JSON record."""
    return [{"target": target, "label": label.strip(), "value": value, "unit": unit, "limit": limit,
             "met": verdict} for target, label, value, unit, limit, verdict in rows]


FOOTER_FAKE = [
    " 1, 2: NVIDIA's cli pays NVML on every start on a real driver, never on this fake machine: the",
    "       real-node limits (0.25x, CPU 0.5x, in-process 1.2x) are judged by benchmarks/realgpu.sh",
    " 4: Docker --runtime=nvidia: .venv/bin/python -m benchmarks.docker --runs 30 (reports its own targets)",
    " 5: device-plugin Allocate p99: .venv/bin/python -m benchmarks.deviceplugin (1,000 calls, 8 clients;",
    "    not part of this run); the shim's non-GPU lifecycle: .venv/bin/python -m benchmarks.shim",
]
FOOTER_REAL = [
    " 4: Docker --runtime=nvidia is timed on the fake machine: python -m benchmarks.docker",
    " 5: nvcontainer list warm and device-plugin Allocate p99: python -m benchmarks and",
    "    python -m benchmarks.deviceplugin on the fake machine",
]
