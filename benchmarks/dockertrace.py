"""Where a ``docker run --runtime=nvidia`` spends its time, process by process (issue 27, target 4).

    .venv/bin/python -m benchmarks.dockertrace [--runs N]    # as root, from the repository root

Why: ``benchmarks.docker`` times whole ``docker run`` commands, and our own ``--debug`` traces
time only what our code does; between them were 12 to 16 ms of every GPU container that no
trace named. This runs the same arms in the same private dockerd under ``perf record`` of the
scheduler's tracepoints (every fork, exec, exit and context switch on the machine, with
CLOCK_MONOTONIC timestamps), keeps only the processes descended from the benchmark's own
``unshare`` (other sessions share this VM), and cuts each ``docker run`` into the steps its
processes mark:

* ``to create``: from the ``docker`` client's exec to the first runtime call under the
  containerd shim (the API round trips, dockerd preparing the rootfs, the shim's start);
* ``create``: the runtime's ``create`` (our front or NVIDIA's runtime, then runc, which runs
  the prestart hook), with the hook's own span (``hook``) and, inside it, ``ldconfig``'s;
* ``create -> start``, ``start``, ``container`` (runc's ``start`` exit to ``true``'s exit),
  ``to delete``, ``delete`` and ``after delete`` (to the client's exit);

and sums every process's time on a CPU within the run by what it is (dockerd, containerd,
the shim, runc, runc's init, the runtime front, NVIDIA's runtime, our server and its children,
the hook, ``ldconfig``, the container), against the same figures of the plain-runc arm. The
figures of a traced run are not the record's (tracing costs time); the differences between
arms are what it is for. The parsing and the cutting are pure functions over ``perf script``'s
text (tested in ``tests/test_benchmarks_dockertrace.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import dockernode, workspace

EVENTS = "sched:sched_process_exec,sched:sched_process_exit,sched:sched_process_fork,sched:sched_switch"
FIELDS = "comm,pid,tid,cpu,time,event,trace"
LINE = re.compile(r"^\s*(?P<comm>.*?)\s+(?P<pid>-?\d+)/(?P<tid>-?\d+)\s+\[(?P<cpu>\d+)\]\s+"
                  r"(?P<time>\d+\.\d+):\s+sched:(?P<event>\w+):\s*(?P<trace>.*)$")
FILENAME = re.compile(r"filename=(\S+)")
CHILD = re.compile(r"child_pid=(\d+)")
SWITCH = re.compile(r"prev_pid=(\d+).*==>.*next_pid=(\d+)")

PHASES = ("to create", "create", "runtime before runc", "runc to hook", "hook", "ldconfig", "hook to runc's exit",
          "create -> start", "start", "container", "to delete",
          "delete", "after delete", "wall")


@dataclass
class Event:
    time: float       # seconds, CLOCK_MONOTONIC
    tid: int
    cpu: int
    kind: str         # exec, exit, fork, switch
    a: int = 0        # fork: the child; switch: the task switched out
    b: int = 0        # switch: the task switched in
    filename: str = ""


def parse(text: str) -> list[Event]:
    """``perf script -F comm,pid,tid,cpu,time,event,trace`` of :data:`EVENTS` into events."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        kind = m["event"].removeprefix("sched_process_").removeprefix("sched_")
        ev = Event(float(m["time"]), int(m["tid"]), int(m["cpu"]), kind)
        trace = m["trace"]
        if kind == "exec":
            f = FILENAME.search(trace)
            ev.filename = f[1] if f else "?"
        elif kind == "fork":
            c = CHILD.search(trace)
            if not c:
                continue
            ev.a = int(c[1])
        elif kind == "switch":
            s = SWITCH.search(trace)
            if not s:
                continue
            ev.a, ev.b = int(s[1]), int(s[2])
        elif kind != "exit":
            continue
        out.append(ev)
    out.sort(key=lambda e: e.time)
    return out


def classify(filename: str, inherited: str) -> str:
    """What a process is after it executes ``filename``, having been ``inherited`` before."""
    name = filename.rsplit("/", 1)[-1]
    anchors = "nvidia-anchors" in filename
    if name == "docker":
        return "docker client"
    if name == "unshare":
        return "benchmark"
    if name in ("dockerd", "containerd"):
        return name
    if name.startswith("containerd-shim"):
        return "containerd shim"
    if name == "nvidia-container-runtime":
        return "NVIDIA runtime" if anchors else "our runtime front"
    if name == "nvidia-container-runtime-hook" and not anchors:
        return "hook chain"       # benchmarks.docker's mkdir-/proc/driver program
    if inherited == "hook chain" or name.startswith("nvcontainer-hook"):
        return "NVIDIA hook" if anchors else "our hook"
    if name == "nvidia-container-cli":
        return "NVIDIA cli" if anchors else "our cli"
    if "ldconfig" in name or (filename == "/dev/fd/3" and (inherited.startswith("serve")
                                                            or inherited in ("our hook", "NVIDIA cli"))):
        return "ldconfig"
    if name == "runc":
        return "runc"
    if inherited in ("runc", "runc init") and name in ("exe", "6") or filename == "/dev/fd/6":
        return "runc init"
    if inherited == "runc init":
        return "container"
    if inherited == "benchmark" and name.startswith("python"):
        return "nvcontainer serve"
    if inherited.startswith("serve:") and name.startswith("python"):
        return inherited
    if inherited == "dockerd" and name == "exe":
        return "dockerd"          # dockerd's re-executions of itself (layer and archive helpers)
    return inherited


@dataclass
class Trace:
    """Every process of the benchmark's tree: what it was over time and when it ran."""
    category: dict[int, str] = field(default_factory=dict)
    execs: list[tuple[float, int, str, str]] = field(default_factory=list)     # time, tid, category, filename
    exits: dict[int, float] = field(default_factory=dict)
    parent: dict[int, int] = field(default_factory=dict)
    running: list[tuple[float, float, str, int]] = field(default_factory=list)  # start, end, category, tid


def follow(events: list[Event], root: int) -> Trace:
    """The processes descended from ``root`` (the benchmark's ``unshare``), their categories, and
    their time on a CPU; everything else on the machine is ``other``."""
    t = Trace(category={root: "benchmark"})
    on_cpu: dict[int, tuple[int, float]] = {}
    for ev in events:
        if ev.kind == "fork":
            if ev.tid in t.category:
                t.category[ev.a] = _below(t.category[ev.tid])
                t.parent[ev.a] = ev.tid
        elif ev.kind == "exec":
            if ev.tid in t.category:
                cat = classify(ev.filename, t.category[ev.tid])
                t.category[ev.tid] = cat
                t.execs.append((ev.time, ev.tid, cat, ev.filename))
        elif ev.kind == "exit":
            if ev.tid in t.category:
                t.exits[ev.tid] = ev.time
        elif ev.kind == "switch":
            prev = on_cpu.get(ev.cpu)
            if prev is not None and prev[0] == ev.a and ev.a in t.category:
                t.running.append((prev[1], ev.time, t.category[ev.a], ev.a))
            on_cpu[ev.cpu] = (ev.b, ev.time)
    return t


def _below(category: str) -> str:
    """A forked child's category: its parent's, except below the server, where the depth is
    kept apart (the spares and request children, then their mount workers and sandboxes)."""
    return {"nvcontainer serve": "serve: request child", "serve: request child": "serve: worker"}.get(
        category, "serve: worker's child" if category.startswith("serve: worker") else category)


WAKE_GAP = 0.020   # s: a spare asleep this long between two turns on a CPU was waiting for its client


def warm_ups(trace: Trace) -> dict[int, float]:
    """For each process below the server that slept at least :data:`WAKE_GAP` (a spare and its
    standby worker, waiting for a client), the time it woke: what it ran before was its warm-up,
    paid whether or not a request comes, and not the work of the run it falls in."""
    turns: dict[int, list[tuple[float, float]]] = {}
    for a, b, cat, tid in trace.running:
        if cat.startswith("serve:") or cat == "ldconfig" and \
                trace.category.get(trace.parent.get(tid, -1), "").startswith("serve:"):
            turns.setdefault(tid, []).append((a, b))
    out = {}
    for tid, spans in turns.items():
        gaps = [(spans[i + 1][0] - spans[i][1], spans[i + 1][0]) for i in range(len(spans) - 1)]
        if gaps and max(gaps)[0] >= WAKE_GAP:
            out[tid] = max(gaps)[1]
    return out


def spare_costs(trace: Trace, woke: dict[int, float]) -> list[float]:
    """The CPU (ms) each spare took before its client came, its standby worker's included."""
    per: dict[int, float] = {}
    for a, b, cat, tid in trace.running:
        if tid in woke and a < woke[tid]:
            owner = tid if cat == "serve: request child" else trace.parent.get(tid, tid)
            per[owner] = per.get(owner, 0.0) + (b - a) * 1e3
    return sorted(per.values())


def runs(trace: Trace) -> list[tuple[int, float, float]]:
    """Every ``docker`` client of the tree, in order: (tid, exec, exit)."""
    return [(tid, time, trace.exits[tid]) for time, tid, cat, _ in trace.execs
            if cat == "docker client" and tid in trace.exits]


def cut(trace: Trace, start: float, end: float, woke: dict[int, float] | None = None) -> dict:
    """One ``docker run`` (its client's exec to its exit) cut into :data:`PHASES` (ms; a phase
    whose marks are missing is left out) and its CPU by category (ms)."""
    inside = [(time, tid, cat, name) for time, tid, cat, name in trace.execs if start <= time <= end]
    calls = []
    for time, tid, cat, _ in inside:
        if cat in ("our runtime front", "NVIDIA runtime", "runc") and trace.category.get(trace.parent.get(tid, -1), "") \
                == "containerd shim" and not any(c[0] == tid for c in calls):
            calls.append((tid, time, trace.exits.get(tid, end)))
    first = {}
    for time, tid, cat, _ in inside:
        first.setdefault(cat, (tid, time))

    def ms(a: float, b: float) -> float:
        return (b - a) * 1e3

    def span(cat):
        if cat not in first:
            return None
        tid, time = first[cat]
        return time, trace.exits.get(tid, time)
    phases = {"wall": ms(start, end)}
    hook, box, ld = span("hook chain"), span("container"), span("ldconfig")
    if len(calls) >= 3:
        (_, c0, c1), (_, s0, s1), (_, d0, d1) = calls[0], calls[1], calls[-1]
        phases.update({"to create": ms(start, c0), "create": ms(c0, c1), "create -> start": ms(c1, s0),
                       "start": ms(s0, s1), "delete": ms(d0, d1), "after delete": ms(d1, end)})
        runc_exec = next((time for time, tid, cat, _ in inside if tid == calls[0][0] and cat == "runc"), None)
        if runc_exec is not None:
            phases["runtime before runc"] = ms(c0, runc_exec)
            if hook:
                phases.update({"runc to hook": ms(runc_exec, hook[0]), "hook to runc's exit": ms(hook[1], c1)})
        if box:
            phases.update({"container": ms(s1, box[1]), "to delete": ms(box[1], d0)})
    if hook:
        phases["hook"] = ms(*hook)
    if ld:
        phases["ldconfig"] = ms(*ld)
    cpu: dict[str, float] = {}
    for a, b, cat, tid in trace.running:
        if woke and tid in woke and a < woke[tid]:
            cat = "serve: spares' warm-up"
        overlap = min(b, end) - max(a, start)
        if overlap > 0:
            cpu[cat] = cpu.get(cat, 0.0) + overlap * 1e3
    return {"phases": phases, "cpu": cpu, "runtime calls": len(calls)}


def summarize(cuts: dict[str, list[dict]]) -> dict[str, dict]:
    """Per arm: the median of each phase and of each category's CPU over its runs."""
    out = {}
    for arm, items in cuts.items():
        phases = {p: statistics.median(c["phases"][p] for c in items if p in c["phases"])
                  for p in PHASES if any(p in c["phases"] for c in items)}
        cats = sorted({k for c in items for k in c["cpu"]})
        cpu = {k: statistics.median(c["cpu"].get(k, 0.0) for c in items) for k in cats}
        cpu["all"] = statistics.median(sum(c["cpu"].values()) for c in items)
        out[arm] = {"phases": phases, "cpu": cpu, "n": len(items)}
    return out


def table(summary: dict[str, dict]) -> str:
    """The medians, one column per arm."""
    arms = list(summary)
    lines = ["phase (median ms)".ljust(22) + "".join(f"{a:>14}" for a in arms)]
    for p in PHASES:
        if any(p in summary[a]["phases"] for a in arms):
            lines.append(p.ljust(22) + "".join(f"{summary[a]['phases'][p]:14.1f}" if p in summary[a]["phases"]
                                               else f"{'-':>14}" for a in arms))
    lines.append("")
    lines.append("CPU in the run (median ms)".ljust(22) + "".join(f"{a:>14}" for a in arms))
    cats = sorted({k for a in arms for k in summary[a]["cpu"]}, key=lambda k: (k == "all", k))
    for k in cats:
        lines.append(k.ljust(22) + "".join(f"{summary[a]['cpu'].get(k, 0.0):14.1f}" for a in arms))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tests.fixtures import dockerd
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dockertrace", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="traced runs per arm after the first (default 10)")
    parser.add_argument("--anchors", type=Path, default=dockernode.nvidia.TARBALL)
    parser.add_argument("--out", type=Path, default=dockernode.RESULTS)
    parser.add_argument("--keep", type=Path, help="also write perf script's text and the tree's root pid here")
    args = parser.parse_args(argv)
    if not shutil.which("perf"):
        sys.stderr.write("benchmarks.dockertrace: perf is not installed (Debian: linux-perf)\n")
        return 1
    load_start = os.getloadavg()
    ws, machine = workspace.with_machine("nvc-bench-dtrace-")
    base = ws.base.parent
    data = Path(tempfile.mkdtemp(prefix="nvc-perf-")) / "perf.data"
    try:
        dockerd.prepare(base)
        daemon, etc, arms, about = dockernode.setup(base, ws, machine, args.anchors)
        perf = subprocess.Popen(["perf", "record", "-q", "-a", "-k", "CLOCK_MONOTONIC", "-e", EVENTS, "-o", str(data)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)     # perf's own start: the world's first fork must be seen
        try:
            roots: list[int] = []
            samples, errors = dockernode.run_world(base, ws, machine, daemon, etc, arms, args.runs + 1, roots=roots)
        finally:
            perf.send_signal(signal.SIGINT)
            perf.wait(timeout=120)
        text = subprocess.run(["perf", "script", "-i", str(data), "-F", FIELDS], capture_output=True, text=True,
                              check=True).stdout
        if args.keep:
            args.keep.write_text(f"# root {roots[0]}\n" + text)
        trace = follow(parse(text), roots[0])
        clients = runs(trace)
        woke = warm_ups(trace)
        order = _in_run_order(samples)
        if len(clients) < len(order):
            sys.stderr.write(f"benchmarks.dockertrace: {len(clients)} docker clients traced for {len(order)} runs\n"
                             f"{errors}\n")
            return 1
        cuts: dict[str, list[dict]] = {arm: [] for arm in arms}
        for (arm, rnd), (_, start, end) in zip(order, clients[-len(order):]):
            if rnd > 0:
                cuts[arm].append(cut(trace, start, end, woke))
        summary = summarize(cuts)
        spares = spare_costs(trace, woke)
        load_end = os.getloadavg()
        sys.stdout.write(f"docker run --rm busybox true under perf's scheduler tracepoints, {args.runs} runs per arm "
                         f"after the first; load {load_start[0]:.1f} -> {load_end[0]:.1f}; {about}\n"
                         + table(summary) + "\n")
        if spares:
            sys.stdout.write(f"each spare's warm-up before its client (its standby worker's included): median "
                             f"{statistics.median(spares):.1f} ms of CPU, {len(spares)} spares, "
                             f"{spares[0]:.1f}-{spares[-1]:.1f}\n")
        workspace.save(args.out, "dockertrace", {"runs": args.runs, "nvidia_arm": about, "loadavg_start": load_start,
                                                 "loadavg_end": load_end, "summary": summary, "spare_warm_up_ms": spares,
                                                 "cuts": cuts})
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(data.parent, ignore_errors=True)


def _in_run_order(samples: dict[str, list[tuple[int, float, int]]]) -> list[tuple[str, int]]:
    """(arm, round) in the order benchmarks.docker's script ran them (round-robin, rotated by one
    arm each round)."""
    arms = list(samples)
    rounds = max((len(s) for s in samples.values()), default=0)
    return [(arms[(k + r) % len(arms)], r) for r in range(rounds) for k in range(len(arms))]


if __name__ == "__main__":
    sys.exit(main())
