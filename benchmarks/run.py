"""Container start latency on the fake GPU machine: the runner, the table and the JSON record.

``sudo .venv/bin/python -m benchmarks [--runs N]`` from the repository root. See
``benchmarks/__init__.py`` for what is measured and ``docs/performance.md`` for the results.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import fake_proc_command
from tests.fixtures.runtime import CGROUP2_WORLD

from . import stats, workspace

RESULTS = workspace.REPO / "benchmarks" / "results"
CACHE_DIR = "/run/nvcontainer"   # the default cache-dir: the hook runs with production settings

# Targets of issue #6, in milliseconds (RSS in MiB).
TARGET_V1, TARGET_V2, TARGET_SLOW, TARGET_CONCURRENT, TARGET_RSS = 20.0, 25.0, 5.0, 3.0, 40.0


def machine_facts() -> dict:
    def first(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0].strip()
        except (OSError, IndexError):
            return "?"

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    os_release = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_mib": mem,
        "kernel": platform.release(),
        "os": os_release.get("PRETTY_NAME", "?").strip('"'),
        "python": f"{platform.python_version()} ({sys._base_executable})",
        "runc": first(["runc", "--version"]),
        "page_fault_us": page_fault_us(),
        "loadavg_start": os.getloadavg()[0],
    }


def page_fault_us(size: int = 64 << 20) -> float:
    """Microseconds per first touch of an anonymous page: what every new process, import and
    fork pays for each page it writes, and a number that differs by 10x between machines."""
    area = mmap.mmap(-1, size)
    start = time.perf_counter()
    for offset in range(0, size, mmap.PAGESIZE):
        area[offset] = 1
    elapsed = time.perf_counter() - start
    area.close()
    return round(elapsed / (size // mmap.PAGESIZE) * 1e6, 2)


def run_world(machine, job: dict, base: Path, *, cgroup2: bool = False) -> dict:
    """Run a job of :mod:`benchmarks.world` inside the machine's /proc view."""
    job_file = base / f"job-{time.monotonic_ns()}.json"
    result_file = job_file.with_suffix(".result.json")
    job_file.write_text(json.dumps(dict(job, state=str(base / "runc-state"))))
    argv = [sys.executable, "-m", "benchmarks.world", str(job_file), str(result_file)]
    if cgroup2:
        argv = ["sh", "-c", CGROUP2_WORLD, "sh", *argv]
    subprocess.run(fake_proc_command(machine, argv), check=True, cwd=workspace.REPO,
                   env=workspace.world_python_env())
    return json.loads(result_file.read_text())


def probe_results(path: Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    ok = [r for r in lines if r["rc"] == 0]
    return {"ms": [r["ms"] for r in ok], "cpu_ms": [r["cpu_ms"] for r in ok], "minflt": [r["minflt"] for r in ok],
            "maxrss_kb": [r["maxrss_kb"] for r in lines], "failures": [r for r in lines if r["rc"] != 0]}


PARTS = ("v1", "concurrent", "probes", "commands", "v2", "slow")

# What a GPU container's hook run imports: the standard modules our code is written with (the
# floor of any hook in this style), then all of our modules on that path.
STDLIB_FLOOR = "json, re, dataclasses, ctypes, typing, fcntl, select, signal, resource, struct"
HOT_MODULES = ("nvcontainer.hook, nvcontainer.config, nvcontainer.oci, nvcontainer.request, nvcontainer.configure, "
               "nvcontainer.inventory.cache, nvcontainer.apply.execute, nvcontainer.apply.ldconfig, "
               "nvcontainer.cgroups.v1")


def collect(ws: workspace.Workspace, runs: int, concurrency: int, nvml_delay: int, base: Path,
            parts=PARTS) -> dict:
    fast = ws.machine("fast", FakeSpec(gpus=2))
    config = base / "config.toml"
    config.write_text("deadline = 30\n")
    results: dict = {}

    def bundles(n: int, *hooks: dict, env=workspace.CONTAINER_ENV) -> list[str]:
        return [str(ws.bundle(list(hooks), env=env)) for _ in range(n)]

    arms = {"none": ([], workspace.CONTAINER_ENV), "hook": ([ws.hook_entry(fast)], workspace.CONTAINER_ENV),
            "hook+config": ([ws.hook_entry(fast, None, "--config", str(config))], workspace.CONTAINER_ENV),
            "hook-nogpu": ([ws.hook_entry(fast)], [])}
    if ws.editable_hook:
        arms["hook-editable"] = ([ws.hook_entry(fast, ws.editable_hook)], workspace.CONTAINER_ENV)
    for label, script in ws.others.items():
        arms[f"hook-{label}"] = ([ws.hook_entry(fast, script)], workspace.CONTAINER_ENV)
        arms[f"hook-{label}-nogpu"] = ([ws.hook_entry(fast, script)], [])
    probes = {"hook": [str(ws.hook), "--root", str(fast.root), "prestart"],
              "configure": [str(ws.cli), "--root", str(fast.root), "configure", "--pid", "{pid}", "--device", "0",
                            "--compute", "--utility", "{rootfs}"]}
    for label, script in ws.others.items():
        probes[f"hook-{label}"] = [str(script), "--root", str(fast.root), "prestart"]
    steps = []
    if "v1" in parts:
        steps.append({"kind": "interleaved", "name": "v1",
                      "arms": {arm: bundles(runs, *hooks, env=env) for arm, (hooks, env) in arms.items()},
                      "warmup": {arm: bundles(2, *hooks, env=env) for arm, (hooks, env) in arms.items()}})
    if "concurrent" in parts:
        steps += [{"kind": "concurrent", "name": "concurrent-hook", "bundles": bundles(concurrency, ws.hook_entry(fast))},
                  {"kind": "concurrent", "name": "concurrent-none", "bundles": bundles(concurrency)}]
    if "probes" in parts:
        steps.append({"kind": "interleaved", "name": "probes",
                      "arms": {arm: bundles(runs, ws.probe_entry(base / f"probe-{arm}.jsonl", argv))
                               for arm, argv in probes.items()},
                      "warmup": {arm: bundles(2, ws.probe_entry(base / "probe-warmup.jsonl", argv))
                                 for arm, argv in probes.items()}})
    if "commands" in parts:
        rootfs = str(ws.bundle([]) / "rootfs")
        steps.append({"kind": "commands", "name": "commands", "runs": runs, "commands": {
            "info": [str(ws.cli), "--root", str(fast.root), "info"],
            "list": [str(ws.cli), "--root", str(fast.root), "list"],
            "dry-run": [str(ws.cli), "--root", str(fast.root), "configure", "--dry-run", "--device", "0",
                        "--compute", "--utility", rootfs],
            "python": [str(ws.python), "-c", "pass"],
            "python-IS": [str(ws.python), "-I", "-S", "-c", "pass"],
            "python-stdlib": [str(ws.python), "-I", "-c", f"import {STDLIB_FLOOR}"],
            "python-modules": [str(ws.python), "-I", "-c", f"import {HOT_MODULES}"]}})
    if steps:
        sys.stderr.write("cgroup v1, fast NVML\n")
        results.update(run_world(fast, {"steps": steps}, base))
    if "probes" in parts:
        for arm in probes:
            results[f"probe-{arm}"] = probe_results(base / f"probe-{arm}.jsonl")

    if "v2" in parts:
        job_v2 = {"steps": [{"kind": "interleaved", "name": "v2",
                             "arms": {"none": bundles(runs), "hook": bundles(runs, ws.hook_entry(fast))},
                             "warmup": {"none": bundles(2), "hook": bundles(2, ws.hook_entry(fast))}}]}
        sys.stderr.write("cgroup v2, fast NVML\n")
        results.update(run_world(fast, job_v2, base, cgroup2=True))

    if "slow" in parts:
        rounds, later = max(3, runs // 6), 5
        knob = {"nvml_config": str(fast.nvml_config), "delay_ms": nvml_delay, "cache_dir": CACHE_DIR,
                "root": str(fast.root)}
        steps = [
            dict(knob, kind="after_reboot", name="slow", rounds=rounds, later=later,
                 bundles=bundles(rounds * (1 + 2 * later), ws.hook_entry(fast))),
            dict(knob, kind="concurrent_after_reboot", name="concurrent-after-reboot",
                 bundles=bundles(concurrency, ws.hook_entry(fast))),
        ]
        sys.stderr.write(f"cgroup v1, NVML initialisation {nvml_delay} ms\n")
        results.update(run_world(fast, {"steps": steps}, base))
    return results


ROWS = (
    ("# runc run of busybox true (interleaved)", None),
    ("cgroup v1, no hook", "v1/none"),
    ("cgroup v1, hook", "v1/hook"),
    ("cgroup v1, hook + config.toml", "v1/hook+config"),
    ("cgroup v1, hook (editable install)", "v1/hook-editable"),
    ("cgroup v1, hook, container asks no GPU", "v1/hook-nogpu"),
    ("cgroup v1, hook ({label})", "v1/hook-*"),
    ("cgroup v2, no hook", "v2/none"),
    ("cgroup v2, hook", "v2/hook"),
    ("# NVML initialisation {delay} ms, interleaved (cgroup v1)", None),
    ("first start after reboot", "slow/first"),
    ("later starts", "slow/later"),
    ("starts with NVML fast (0 ms)", "slow/fast"),
    ("# {concurrency} containers started at once", None),
    ("no hook", "concurrent-none"),
    ("hook", "concurrent-hook"),
    ("hook, right after reboot (NVML {delay} ms)", "concurrent-after-reboot"),
    ("# one process, timed alone", None),
    ("nvcontainer-hook (in a prestart)", "probe-hook"),
    ("  its CPU time (user + system)", "probe-hook/cpu"),
    ("nvcontainer configure (in a prestart)", "probe-configure"),
    ("  its CPU time (user + system)", "probe-configure/cpu"),
    ("nvcontainer-hook ({label})", "probe-hook-*"),
    ("nvcontainer configure --dry-run", "commands/dry-run"),
    ("nvcontainer info", "commands/info"),
    ("nvcontainer list", "commands/list"),
    ("python -c pass", "commands/python"),
    ("python -I -S -c pass", "commands/python-IS"),
    ("python -I: import json, re, dataclasses, ctypes, ...", "commands/python-stdlib"),
    ("python -I: import the hook's modules (GPU path)", "commands/python-modules"),
)


def report(results: dict, facts: dict, runs: int, concurrency: int, nvml_delay: int) -> tuple[str, dict]:
    series = _series(results)
    s = {name: stats.summary(value["ms"]) for name, value in series.items()}
    for name, value in results.items():
        if "cpu_ms" in value:
            s[f"{name}/cpu"] = stats.summary(value["cpu_ms"])

    def median(name: str) -> float | None:
        return s.get(name, {}).get("median")

    def diff(a: str, b: str) -> float | None:
        return None if median(a) is None or median(b) is None else median(a) - median(b)

    def paired(a: str, b: str) -> float | None:
        return stats.paired_median(series[a]["ms"], series[b]["ms"]) if a in series and b in series else None

    rss = results.get("probe-hook", {}).get("maxrss_kb")
    rss_mib = max(rss) / 1024 if rss else None
    single, conc = median("v1/hook"), s.get("concurrent-hook", {})
    ratio = conc["p95"] / single if conc.get("n") and single else None
    later_ok = None
    if diff("slow/later", "slow/fast") is not None:
        later_ok = diff("slow/later", "slow/fast") <= TARGET_SLOW and s["slow/later"]["max"] < s["slow/first"]["min"]
    derived = {
        "overhead_v1_ms": diff("v1/hook", "v1/none"), "overhead_v2_ms": diff("v2/hook", "v2/none"),
        "paired_overhead_v1_ms": paired("v1/hook", "v1/none"), "paired_overhead_v2_ms": paired("v2/hook", "v2/none"),
        "slow_later_minus_fast_ms": diff("slow/later", "slow/fast"),
        "paired_slow_later_minus_fast_ms": paired("slow/later", "slow/fast"),
        "concurrent_p95_over_single_median": ratio, "hook_peak_rss_mib": rss_mib,
        "failures": {name: len(value["failures"]) for name, value in series.items() if value["failures"]},
    }
    for name in series:
        if name.startswith("v1/hook"):
            derived[f"overhead_{name[3:]}_ms"] = diff(name, "v1/none")

    def within(value, target):
        return None if value is None else value <= target

    checks = [
        ("hook overhead, cgroup v1 (Δ median)", derived["overhead_v1_ms"], f"<= {TARGET_V1:g} ms (aim 15)",
         within(derived["overhead_v1_ms"], TARGET_V1)),
        ("hook overhead, cgroup v2 (Δ median)", derived["overhead_v2_ms"], f"<= {TARGET_V2:g} ms",
         within(derived["overhead_v2_ms"], TARGET_V2)),
        (f"NVML {nvml_delay} ms: later - fast (median)", derived["slow_later_minus_fast_ms"], f"<= {TARGET_SLOW:g} ms",
         later_ok),
        (f"{concurrency} at once: p95 / single median", ratio, f"<= {TARGET_CONCURRENT:g} (x), all succeed",
         None if ratio is None else ratio <= TARGET_CONCURRENT and not results["concurrent-hook"]["failures"]),
        ("hook peak RSS (MiB)", rss_mib, f"<= {TARGET_RSS:g} MiB", within(rss_mib, TARGET_RSS)),
    ]
    labels = sorted({name.split("hook-", 1)[1].split("/")[0] for name in s
                     if name.startswith(("v1/hook-", "probe-hook-")) and name not in ("v1/hook-editable", "v1/hook-nogpu")})
    rows = []
    for label, name in ROWS:
        label = label.replace("{delay}", str(nvml_delay)).replace("{concurrency}", str(concurrency))
        if name is None:
            rows.append((label, {}))
        elif "*" in name:
            for other in labels:
                if name.replace("*", other) in s:
                    shown = (label.replace("({label})", f"({other[:-6]}), container asks no GPU")
                             if other.endswith("-nogpu") else label.replace("{label}", other))
                    rows.append((shown, s[name.replace("*", other)]))
                if f"{name.replace('*', other)}/cpu" in s:
                    rows.append(("  its CPU time (user + system)", s[f"{name.replace('*', other)}/cpu"]))
        elif name in s:
            rows.append((label, s[name]))
    rows = [row for i, row in enumerate(rows)   # no section heading without rows under it
            if not row[0].startswith("#") or (i + 1 < len(rows) and not rows[i + 1][0].startswith("#"))]
    head = (f"machine: {facts['cpu']}, {facts['cpus']} CPUs, {facts['memory_mib']} MiB, {facts['os']}, "
            f"kernel {facts['kernel']}\n"
            f"         Python {facts['python']}, {facts['runc']}, page fault {facts['page_fault_us']} µs, "
            f"load {facts['loadavg_start']:.2f} at start\n"
            f"runs per series: {runs}; fake GPU machine: 2 GPUs, driver 550.54.14\n\n")
    text = head + stats.table(rows, [c for c in checks if c[1] is not None])
    if derived["failures"]:
        text += f"\nFAILED RUNS: {derived['failures']}\n"
    return text, {"summaries": s, "derived": derived, "checks": [
        {"label": label, "value": value, "target": target, "met": met} for label, value, target, met in checks]}


def _series(results: dict) -> dict:
    """Flatten results to ``step/arm`` → {"ms": [...], "failures": [...]}."""
    out = {}
    for name, value in results.items():
        if "ms" in value:
            out[name] = value
        else:
            for arm, series in value.items():
                out[f"{name}/{arm}"] = series
    return out


def cleanup_cache(base: Path) -> None:
    """Remove the cache entries of this run's fake machines from the real cache directory."""
    try:
        names = os.listdir(CACHE_DIR)
    except OSError:
        return
    for name in names:
        path = os.path.join(CACHE_DIR, name)
        try:
            with open(path) as f:
                root = json.load(f).get("inputs", {}).get("root", "")
        except (OSError, ValueError, AttributeError):
            continue
        if root.startswith(f"{base}/"):
            os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per series (default 30)")
    parser.add_argument("--concurrency", type=int, default=32, help="containers started at once (default 32)")
    parser.add_argument("--nvml-delay-ms", type=int, default=300, help="slow NVML initialisation (default 300)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON record")
    parser.add_argument("--keep", action="store_true", help="keep the temporary workspace")
    parser.add_argument("--only", action="append", choices=PARTS, help="run only these parts (repeatable)")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=TREE",
                        help="also time the hook of another tree (a directory holding nvcontainer/, or git:REV) "
                             "in the cgroup v1 series")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root (runc, mount namespaces, device nodes)")
    for tool in ("runc", "gcc", "unshare", "busybox"):
        if shutil.which(tool) is None and not Path(f"/bin/{tool}").exists():
            parser.error(f"{tool} is not installed")
    facts = machine_facts()
    base = Path(tempfile.mkdtemp(prefix="nvc-bench-"))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        compare = dict(item.split("=", 1) for item in args.compare)
        ws = workspace.create(base, compare)
        results = collect(ws, args.runs, args.concurrency, args.nvml_delay_ms, base, args.only or PARTS)
    finally:
        cleanup_cache(base)
        if not args.keep:
            workspace.remove(base)
    facts["loadavg_end"] = os.getloadavg()[0]
    text, derived = report(results, facts, args.runs, args.concurrency, args.nvml_delay_ms)
    sys.stdout.write(text)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"started": started, "machine": facts, "runs": args.runs, "concurrency": args.concurrency,
              "nvml_delay_ms": args.nvml_delay_ms, **derived, "samples": results, "table": text}
    name = f"{started.replace(':', '')}.json"
    (args.out / name).write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "latest.json").write_text(json.dumps(record, indent=1) + "\n")
    sys.stdout.write(f"\nwritten: {args.out / name}\n")
    return 0
