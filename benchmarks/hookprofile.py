"""Where one hook run spends its time: ``python -m benchmarks.hookprofile [--runs N]``.

Starts busybox containers on a fake GPU machine with the hook (a production-like install, as in
the benchmarks) wrapped by ``benchmarks/probe.py``, with the inventory cache warm, and prints:

* the time of each step, median over ``--runs`` runs, from the microsecond timestamps of the
  hook's debug log (and, for the first step, the probe's wall time: interpreter start-up and
  the imports before the first line);
* one run's debug log;
* ``python -X importtime``: the modules the hook imports, by cumulative time (the hook process
  and the workers it forks write to the same stderr, so a worker's imports appear too);
* ``cProfile``: the functions by cumulative time.
"""

from __future__ import annotations

import argparse
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import fake_proc_command

from . import workspace


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


def _stamp(line: str) -> float:
    hms = line[6:21]   # "IMMDD HH:MM:SS.micro"
    return int(hms[:2]) * 3600 + int(hms[3:5]) * 60 + float(hms[6:])


def steps(log_text: str, wall_ms: float) -> list[tuple[str, float]]:
    """(step, ms) of one run: from each info line to the next; the first step is what the
    probe saw before the first line. Warnings replayed from the cache are not steps."""
    lines = [line for line in log_text.splitlines() if line[:1] == "I"]
    out = [("start-up and imports before the first line", wall_ms - (_stamp(lines[-1]) - _stamp(lines[0])) * 1000)]
    for before, line in zip(lines, lines[1:]):
        label = line.split("] ", 1)[1]
        label = label.split(" /", 1)[0].split(":", 1)[0]
        out.append((label, (_stamp(line) - _stamp(before)) * 1000))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hookprofile", description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--runs", type=int, default=10, help="logged runs for the step medians")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="nvc-hookprof-"))
    try:
        ws = workspace.create(base)
        machine = ws.machine("fast", FakeSpec(gpus=2))
        out, err, prof = (base / n for n in ("probe.jsonl", "stderr.txt", "hook.prof"))
        hook = [str(ws.hook), "--root", str(machine.root), "prestart"]
        warm = ws.probe_entry(out, hook)
        logs = [base / f"debug-{i}.log" for i in range(args.runs)]
        logged = [ws.probe_entry(out, [str(ws.hook), "--debug", str(log), *hook[1:]]) for log in logs]
        imports = ws.probe_entry(out, [str(ws.python), "-X", "importtime", *hook], stderr=err)
        profiled = ws.probe_entry(out, [str(ws.python), "-m", "cProfile", "-o", str(prof), *hook])
        state = str(base / "runc-state")
        for entry in (warm, warm, *logged, imports, profiled):
            bundle = ws.bundle([entry])
            argv = ["runc", "--root", state, "run", "--bundle", str(bundle), bundle.name]
            res = subprocess.run(fake_proc_command(machine, argv), capture_output=True, text=True)
            subprocess.run(fake_proc_command(machine, ["runc", "--root", state, "delete", "-f", bundle.name]),
                           capture_output=True)
            if res.returncode != 0:
                sys.stderr.write(res.stderr)
                return 1
        runs = [json.loads(line) for line in out.read_text().splitlines()]
        logged_runs = runs[2:2 + args.runs]
        print("hook per run: wall ms / CPU ms / minor page faults:")
        print("  warm:", ", ".join(f"{r['ms']:.0f}/{r['cpu_ms']:.0f}/{r['minflt']}" for r in runs[:2]))
        print("  --debug:", ", ".join(f"{r['ms']:.0f}/{r['cpu_ms']:.0f}/{r['minflt']}" for r in logged_runs))
        print("  -X importtime, cProfile:", ", ".join(f"{r['ms']:.0f}/{r['cpu_ms']:.0f}" for r in runs[-2:]))
        per_step: dict[str, list[float]] = {}
        for log, run in zip(logs, logged_runs):
            for label, ms in steps(log.read_text(), run["ms"]):
                per_step.setdefault(label, []).append(ms)
        print(f"\n== steps, median of {args.runs} runs (ms) ==")
        for label, values in per_step.items():
            print(f"{statistics.median(values):8.1f}  {label}")
        print(f"{statistics.median(r['ms'] for r in logged_runs):8.1f}  total (wall)")
        print("\n== debug log of the last run ==")
        print(logs[-1].read_text())
        print("== imports, slowest first (cumulative) ==")
        print("\n".join(importtime_top(err.read_text(), args.top)))
        print("\n== cProfile, cumulative ==")
        pstats.Stats(str(prof), stream=sys.stdout).sort_stats("cumulative").print_stats(args.top)
    finally:
        from .run import cleanup_cache

        cleanup_cache(base)
        workspace.remove(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
