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

``--served`` profiles the served hook instead: the client registered as ``nvcontainer setup``
writes it, handing the run to a resident ``nvcontainer serve`` started in the same world (mount
namespace) as runc. Only the steps and the debug log then (the server's child writes it): the
imports happened once, in the server, and a forked child's profile is never written. The first
step is then the client's start-up, the hand-off and the fork.
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

from nvcontainer.native import build
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import fake_proc_command

from . import stats, workspace

HOOK_MAIN = "import sys; from nvcontainer.hook.main import main; sys.exit(main())"


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


def print_steps(logs: list[Path], runs: list[dict]) -> None:
    per_step: dict[str, list[float]] = {}
    for log, run in zip(logs, runs):
        for label, ms in steps(log.read_text(), run["ms"]):
            per_step.setdefault(label, []).append(ms)
    print(f"\n== steps, median of {len(runs)} runs (ms) ==")
    for label, values in per_step.items():
        print(f"{statistics.median(values):8.1f}  {label}")
    print(f"{statistics.median(r['ms'] for r in runs):8.1f}  total (wall)")
    print("\n== debug log of the last run ==")
    print(logs[-1].read_text())


def served(ws: workspace.Workspace, machine, base: Path, runs: int, server_args: tuple = ()) -> int:
    """The served hook's steps: every container run in one world, beside its server."""
    from .machine import run_world, server_job

    socket = ws.socket("profile")
    out = base / "probe.jsonl"
    client = ws.client_argv(machine, socket)
    logs = [base / f"debug-{i}.log" for i in range(runs)]
    entries = [ws.probe_entry(out, client)] * 2 + [ws.probe_entry(out, [*client[:-1], "--debug", str(log), "prestart"])
                                                   for log in logs]
    server = server_job(ws, machine, "profile", socket)
    server["argv"] += list(server_args)
    job = {"server": server,
           "steps": [{"kind": "served_check", "name": "check", "arms": {"served": [str(ws.bundle([entries[0]]))]}},
                     {"kind": "interleaved", "name": "runs",
                      "arms": {"served": [str(ws.bundle([entry])) for entry in entries]}}]}
    results = run_world(machine, job, base)
    failures = results["runs"]["served"]["failures"]
    if failures or not all(r["served"] for r in results["check"]["served"]):
        sys.stderr.write(f"not served or failed: {results['check']} {failures}\n")
        return 1
    record = results["servers"]["profile"]
    print(f"server: start-up to listening {record['ready_ms'][0]:.0f} ms; {record['status'][0]}; "
          f"resident {record['memory']}")
    done = [json.loads(line) for line in out.read_text().splitlines()][1:]   # the check's run first
    print("client per run (the server's child's CPU is not the client's): wall ms / CPU ms / minor page faults:")
    print("  no debug log:", ", ".join(f"{r['ms']:.0f}/{r['cpu_ms']:.0f}/{r['minflt']}" for r in done[:2]))
    print("  --debug:", ", ".join(f"{r['ms']:.0f}/{r['cpu_ms']:.0f}/{r['minflt']}" for r in done[2:]))
    print_steps(logs, done[2:])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hookprofile", description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--runs", type=int, default=10, help="logged runs for the step medians")
    parser.add_argument("--served", action="store_true",
                        help="the served hook (client + resident nvcontainer serve): steps and debug log only")
    parser.add_argument("--no-spare", action="store_true", help="with --served: the server forks per request")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="nvc-hookprof-"))
    try:
        ws = workspace.create(base)
        machine = ws.machine("fast", FakeSpec(gpus=2))
        if args.served:
            return served(ws, machine, base, args.runs, ("--no-spare",) if args.no_spare else ())
        out, err, prof = (base / n for n in ("probe.jsonl", "stderr.txt", "hook.prof"))
        hook = [str(ws.hook), "--root", str(machine.root), "prestart"]
        warm = ws.probe_entry(out, hook)
        logs = [base / f"debug-{i}.log" for i in range(args.runs)]
        logged = [ws.probe_entry(out, [str(ws.hook), "--debug", str(log), *hook[1:]]) for log in logs]
        # the installed hook is the static front: the interpreter runs the hook's module itself
        # here, started as the front starts it (-I -S and the boot's lines: native/boot.py)
        module = [str(ws.python), "-I", "-S", "-X", "importtime", "-c", build.boot_line() + HOOK_MAIN, *hook[1:]]
        imports = ws.probe_entry(out, module, stderr=err)
        profiled = ws.probe_entry(out, [str(ws.python), "-I", "-m", "cProfile", "-o", str(prof), "-m",
                                        "nvcontainer.hook", *hook[1:]])
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
        print_steps(logs, logged_runs)
        print("== imports, slowest first (cumulative) ==")
        print("\n".join(stats.importtime_top(err.read_text(), args.top)))
        print("\n== cProfile, cumulative ==")
        pstats.Stats(str(prof), stream=sys.stdout).sort_stats("cumulative").print_stats(args.top)
    finally:
        from .machine import cleanup_cache

        cleanup_cache(base)
        workspace.remove(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
