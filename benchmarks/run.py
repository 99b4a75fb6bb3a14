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

from . import nvidia, stats, targets, workspace

RESULTS = workspace.REPO / "benchmarks" / "results"
CACHE_DIR = "/run/nvcontainer"   # the default cache-dir: the hook runs with production settings

# Targets of issue #6, in milliseconds (RSS in MiB).
TARGET_V1, TARGET_V2, TARGET_SLOW, TARGET_CONCURRENT, TARGET_RSS = 20.0, 25.0, 5.0, 3.0, 40.0
TARGET_LEASE = 1.0   # issue 26: what a free:1 allocation may add to a served start


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
        # a server on the default socket would be asked (and decline: another mount namespace) by
        # the in-process arms' hooks, a round trip they would not pay without it
        "default_socket_present": os.path.lexists("/run/nvcontainer/hook.sock"),
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


# /run/nvcontainer on a tmpfs of the world's own, as /run is on a node (systemd's); a build
# machine's /run may be a disk, where each rename of the lease file waits on the journal
RUN_TMPFS_WORLD = "mkdir -p /run/nvcontainer && mount -t tmpfs -o mode=700 nvc-run /run/nvcontainer && exec \"$@\""


def run_world(machine, job: dict, base: Path, *, cgroup2: bool = False, run_tmpfs: bool = False) -> dict:
    """Run a job of :mod:`benchmarks.world` inside the machine's /proc view."""
    job_file = base / f"job-{time.monotonic_ns()}.json"
    result_file = job_file.with_suffix(".result.json")
    job_file.write_text(json.dumps(dict(job, state=str(base / "runc-state"))))
    argv = [sys.executable, "-m", "benchmarks.world", str(job_file), str(result_file)]
    if cgroup2:
        argv = ["sh", "-c", CGROUP2_WORLD, "sh", *argv]
    if run_tmpfs:
        argv = ["sh", "-c", RUN_TMPFS_WORLD, "sh", *argv]
    subprocess.run(fake_proc_command(machine, argv), check=True, cwd=workspace.REPO,
                   env=workspace.world_python_env())
    return json.loads(result_file.read_text())


def server_job(ws: workspace.Workspace, machine, world: str, socket: Path) -> dict:
    """What :mod:`benchmarks.world` needs to run this world's ``nvcontainer serve``."""
    return {"name": world, "argv": ws.server_argv(machine, socket), "env": workspace.SERVER_ENV,
            "socket": str(socket), "log": str(ws.base / f"serve-{world}.log")}


def merge(results: dict, world: dict) -> None:
    """A world's results into the run's; the servers of all worlds side by side."""
    servers = world.pop("servers", {})
    results.update(world)
    results.setdefault("servers", {}).update(servers)


def probe_results(path: Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    ok = [r for r in lines if r["rc"] == 0]
    return {"ms": [r["ms"] for r in ok], "cpu_ms": [r["cpu_ms"] for r in ok], "minflt": [r["minflt"] for r in ok],
            "maxrss_kb": [r["maxrss_kb"] for r in lines], "failures": [r for r in lines if r["rc"] != 0]}


PARTS = ("v1", "concurrent", "probes", "commands", "v2", "slow", "growth", "leases")

# What a GPU container's hook run imports: the standard modules our code is written with (the
# floor of any hook in this style), then all of our modules on that path.
STDLIB_FLOOR = "json, re, dataclasses, ctypes, typing, fcntl, select, signal, resource, struct"
HOT_MODULES = ("nvcontainer.hook.main, nvcontainer.hook.prestart, nvcontainer.config.model, nvcontainer.request.oci, "
               "nvcontainer.request.decide, nvcontainer.plan.gather, "
               "nvcontainer.inventory.cache, nvcontainer.apply.execute, nvcontainer.apply.ldconfig, "
               "nvcontainer.cgroups.v1")


def collect(ws: workspace.Workspace, runs: int, concurrency: int, nvml_delay: int, base: Path,
            parts=PARTS, anchors: Path = nvidia.TARBALL) -> dict:
    # no decoy CUDA stubs in its ld cache: NVIDIA's cli would load the stub NVML (its loader takes the
    # first cache entry) and fail, and its arm is the yardstick
    fast = ws.machine("fast", FakeSpec(gpus=2, decoys=False))
    config = base / "config.toml"
    config.write_text("deadline = 30\n")
    results: dict = {}
    sock_v1, sock_v2, sock_slow = ws.socket("v1"), ws.socket("v2"), ws.socket("slow")

    def bundles(n: int, *hooks: dict, env=workspace.CONTAINER_ENV) -> list[str]:
        return [str(ws.bundle(list(hooks), env=env)) for _ in range(n)]

    def check(n: int, entries: dict) -> dict:
        """A served_check step: ``n`` runs of each served registration (verified, memory)."""
        return {"kind": "served_check", "name": "served-check", "arms": {arm: bundles(n, entry)
                                                                          for arm, entry in entries.items()}}

    served, served_console = ws.served_entry(fast, sock_v1), ws.hook_entry(fast, None, "--socket", str(sock_v1))
    # Served arms first in the table; every arm of a step is interleaved with every other.
    arms = {"none": ([], workspace.CONTAINER_ENV),
            "served": ([served], workspace.CONTAINER_ENV),
            "served-python": ([ws.served_entry(fast, sock_v1, native=False)], workspace.CONTAINER_ENV),
            "served-console": ([served_console], workspace.CONTAINER_ENV),
            "served-nogpu": ([served], []),
            "hook": ([ws.hook_entry(fast)], workspace.CONTAINER_ENV),
            # setup's registration while its server is down: the client, then the in-process hook
            "fallback": ([ws.served_entry(fast, ws.socket("none"))], workspace.CONTAINER_ENV),
            "hook+config": ([ws.hook_entry(fast, None, "--config", str(config))], workspace.CONTAINER_ENV),
            "hook-nogpu": ([ws.hook_entry(fast)], []),
            # the floor of any prestart hook: runc forking and executing a static program that
            # does nothing (what a container that asks for no GPU cannot get below)
            "empty": ([workspace.empty_hook_entry()], [])}
    theirs = nvidia.hook_entry(base, fast, anchors)
    if theirs is not None:
        arms["nvidia"] = ([theirs], workspace.CONTAINER_ENV)
        arms["nvidia-nogpu"] = ([theirs], [])
    if ws.editable_hook:
        arms["hook-editable"] = ([ws.hook_entry(fast, ws.editable_hook)], workspace.CONTAINER_ENV)
    for label, script in ws.others.items():
        arms[f"hook-{label}"] = ([ws.hook_entry(fast, script)], workspace.CONTAINER_ENV)
        arms[f"hook-{label}-nogpu"] = ([ws.hook_entry(fast, script)], [])
    # The client's own peak RSS: a child spawned by the (Python) probe reports the probe's peak
    # too (the kernel keeps the larger of the pre- and post-exec figures), so GNU time, a small
    # C program, spawns it and writes %M.
    client_rss = base / "client-maxrss-kb.txt"
    probes = {"served": ws.client_argv(fast, sock_v1),
              "served-rss": ["/usr/bin/time", "-a", "-o", str(client_rss), "-f", "%M", *ws.client_argv(fast, sock_v1)],
              "hook": [str(ws.hook), "--root", str(fast.root), "prestart"],
              "configure": [str(ws.cli), "--root", str(fast.root), "configure", "--pid", "{pid}", "--device", "0",
                            "--compute", "--utility", "{rootfs}"]}
    for label, script in ws.others.items():
        probes[f"hook-{label}"] = [str(script), "--root", str(fast.root), "prestart"]
    steps = []
    if {"v1", "concurrent", "probes"} & set(parts):
        # first: is every served registration served in this world? (and the server's first forks)
        steps.append(check(max(3, min(runs, 10)) if "probes" in parts else 3,
                           {"served": served, "served-python": arms["served-python"][0][0],
                            "served-console": served_console}))
    if "v1" in parts:
        steps.append({"kind": "interleaved", "name": "v1",
                      "arms": {arm: bundles(runs, *hooks, env=env) for arm, (hooks, env) in arms.items()},
                      "warmup": {arm: bundles(2, *hooks, env=env) for arm, (hooks, env) in arms.items()}})
    if "concurrent" in parts:
        steps += [{"kind": "concurrent", "name": "concurrent-served", "bundles": bundles(concurrency, served)},
                  {"kind": "concurrent", "name": "concurrent-hook", "bundles": bundles(concurrency, ws.hook_entry(fast))}]
        if theirs is not None:   # issue 27's target 3: each burst's added p95 against NVIDIA's
            steps.append({"kind": "concurrent", "name": "concurrent-nvidia", "bundles": bundles(concurrency, theirs)})
        steps.append({"kind": "concurrent", "name": "concurrent-none", "bundles": bundles(concurrency)})
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
        job = {"steps": steps}
        if steps[0]["kind"] == "served_check":
            job["server"] = server_job(ws, fast, "v1", sock_v1)
        merge(results, run_world(fast, job, base))
    if "probes" in parts:
        for arm in probes:
            results[f"probe-{arm}"] = probe_results(base / f"probe-{arm}.jsonl")
        if client_rss.exists():
            results["client-maxrss-kb"] = [int(line) for line in client_rss.read_text().split() if line.isdigit()]

    if "v2" in parts:
        served_v2 = ws.served_entry(fast, sock_v2)
        v2_arms = {"none": [], "served": [served_v2], "hook": [ws.hook_entry(fast)]}
        job_v2 = {"server": server_job(ws, fast, "v2", sock_v2), "steps": [
            dict(check(3, {"served": served_v2}), name="served-check-v2"),
            {"kind": "interleaved", "name": "v2",
             "arms": {arm: bundles(runs, *hooks) for arm, hooks in v2_arms.items()},
             "warmup": {arm: bundles(2, *hooks) for arm, hooks in v2_arms.items()}}]}
        sys.stderr.write("cgroup v2, fast NVML\n")
        merge(results, run_world(fast, job_v2, base, cgroup2=True))

    if "growth" in parts:
        # issue 17: a node with 8 GPUs, served: every GPU against one (more nodes, mounts, rules)
        eight = ws.machine("eight", FakeSpec(gpus=8, decoys=False))
        sock_eight = ws.socket("growth")
        served_eight = ws.served_entry(eight, sock_eight)
        growth_arms = {"none": ([], workspace.CONTAINER_ENV),
                       "one": ([served_eight], workspace.CONTAINER_ENV),
                       "all": ([served_eight], ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"])}
        job = {"server": server_job(ws, eight, "growth", sock_eight), "steps": [
            dict(check(3, {"served": served_eight}), name="served-check-growth"),
            {"kind": "interleaved", "name": "growth",
             "arms": {arm: bundles(runs, *hooks, env=env) for arm, (hooks, env) in growth_arms.items()},
             "warmup": {arm: bundles(2, *hooks, env=env) for arm, (hooks, env) in growth_arms.items()}}]}
        sys.stderr.write("cgroup v1, 8 GPUs\n")
        merge(results, run_world(eight, job, base))
    if "leases" in parts:
        # issue 26: free:1 (a lease decided and written under the lock, released when the
        # container ends) against a plain index request, both served, interleaved on 4 GPUs
        four = ws.machine("leases", FakeSpec(gpus=4, decoys=False))
        sock_leases = ws.socket("leases")
        served_four = ws.served_entry(four, sock_leases)
        lease_arms = {"index": ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
                      "free": ["NVIDIA_VISIBLE_DEVICES=free:1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]}
        job = {"server": server_job(ws, four, "leases", sock_leases), "steps": [
            dict(check(3, {"served": served_four}), name="served-check-leases"),
            {"kind": "interleaved", "name": "leases",
             "arms": {arm: bundles(runs, served_four, env=env) for arm, env in lease_arms.items()},
             "warmup": {arm: bundles(2, served_four, env=env) for arm, env in lease_arms.items()}}]}
        sys.stderr.write("cgroup v1, 4 GPUs, leases\n")
        merge(results, run_world(four, job, base, run_tmpfs=True))
    if "slow" in parts:
        rounds, later = max(3, runs // 6), 5
        knob = {"nvml_config": str(fast.nvml_config), "delay_ms": nvml_delay, "cache_dir": CACHE_DIR,
                "root": str(fast.root)}
        served_slow = ws.served_entry(fast, sock_slow)
        steps = [
            dict(check(3, {"served": served_slow}), name="served-check-slow"),
            dict(knob, kind="after_reboot", name="slow", rounds=rounds, later=later,
                 bundles=bundles(rounds * (1 + 2 * later), ws.hook_entry(fast))),
            dict(knob, kind="after_reboot_served", name="slow-served", rounds=rounds, later=later,
                 bundles=bundles(rounds * (2 + 2 * later), served_slow)),
            dict(knob, kind="concurrent_after_reboot", name="concurrent-after-reboot",
                 bundles=bundles(concurrency, ws.hook_entry(fast))),
            dict(knob, kind="concurrent_after_reboot", name="concurrent-after-reboot-served",
                 bundles=bundles(concurrency, served_slow)),
        ]
        sys.stderr.write(f"cgroup v1, NVML initialisation {nvml_delay} ms\n")
        merge(results, run_world(fast, {"server": server_job(ws, fast, "slow", sock_slow), "steps": steps}, base))
    return results


ROWS = (
    ("# runc run of busybox true (interleaved)", None),
    ("cgroup v1, no hook", "v1/none"),
    ("  CPU of the start: runc and all it waited for, and the server's tree", "v1/none/cpu"),
    ("cgroup v1, hook (served)", "v1/served"),
    ("  CPU of the start: runc and all it waited for, and the server's tree", "v1/served/cpu"),
    ("cgroup v1, hook (served, Python client)", "v1/served-python"),
    ("cgroup v1, hook (served, console script)", "v1/served-console"),
    ("cgroup v1, hook (served), container asks no GPU", "v1/served-nogpu"),
    ("cgroup v1, hook (in-process)", "v1/hook"),
    ("  CPU of the start: runc and all it waited for, and the server's tree", "v1/hook/cpu"),
    ("cgroup v1, hook (setup's registration, no server: in-process)", "v1/fallback"),
    ("cgroup v1, hook (in-process) + config.toml", "v1/hook+config"),
    ("cgroup v1, hook (in-process, editable install)", "v1/hook-editable"),
    ("cgroup v1, hook (in-process), container asks no GPU", "v1/hook-nogpu"),
    ("cgroup v1, a hook that does nothing (static busybox true)", "v1/empty"),
    ("cgroup v1, hook ({label})", "v1/hook-*"),
    ("cgroup v1, NVIDIA's hook 1.17.9 + cli 1.17.0", "v1/nvidia"),
    ("  CPU of the start: runc and all it waited for, and the server's tree", "v1/nvidia/cpu"),
    ("cgroup v1, NVIDIA's hook, container asks no GPU", "v1/nvidia-nogpu"),
    ("8 GPUs, cgroup v1, no hook", "growth/none"),
    ("8 GPUs, hook (served), GPU 0", "growth/one"),
    ("8 GPUs, hook (served), all GPUs", "growth/all"),
    ("cgroup v2, no hook", "v2/none"),
    ("cgroup v2, hook (served)", "v2/served"),
    ("# leases: 4 GPUs, hook (served), interleaved", None),
    ("GPU 0 named (NVIDIA_VISIBLE_DEVICES=0)", "leases/index"),
    ("free:1 (lease taken, released at exit)", "leases/free"),
    ("cgroup v2, hook (in-process)", "v2/hook"),
    ("# NVML initialisation {delay} ms, hook (served), cgroup v1", None),
    ("serve start-up after reboot, to listening (pays NVML)", "slow-served/serve-start"),
    ("first start after reboot, server started after it", "slow-served/first"),
    ("later starts", "slow-served/later"),
    ("starts with NVML fast (0 ms)", "slow-served/fast"),
    ("start with the cache stale under a running server", "slow-served/stale"),
    ("# NVML initialisation {delay} ms, hook (in-process), cgroup v1", None),
    ("first start after reboot", "slow/first"),
    ("later starts", "slow/later"),
    ("starts with NVML fast (0 ms)", "slow/fast"),
    ("# {concurrency} containers started at once", None),
    ("no hook", "concurrent-none"),
    ("hook (served)", "concurrent-served"),
    ("hook (in-process)", "concurrent-hook"),
    ("NVIDIA's hook 1.17.9 + cli 1.17.0", "concurrent-nvidia"),
    ("hook (served), cache stale under a running server", "concurrent-after-reboot-served"),
    ("hook (in-process), right after reboot", "concurrent-after-reboot"),
    ("# one process, timed alone (in a prestart)", None),
    ("hook client (served): wall, the server's work included", "probe-served"),
    ("  the client's CPU time (not the server's child's)", "probe-served/cpu"),
    ("nvcontainer-hook (in-process)", "probe-hook"),
    ("  its CPU time (user + system)", "probe-hook/cpu"),
    ("nvcontainer configure", "probe-configure"),
    ("  its CPU time (user + system)", "probe-configure/cpu"),
    ("nvcontainer-hook ({label})", "probe-hook-*"),
    ("# commands", None),
    ("nvcontainer configure --dry-run", "commands/dry-run"),
    ("nvcontainer info", "commands/info"),
    ("nvcontainer list", "commands/list"),
    ("python -c pass", "commands/python"),
    ("python -I -S -c pass", "commands/python-IS"),
    ("python -I: import json, re, dataclasses, ctypes, ...", "commands/python-stdlib"),
    ("python -I: import the hook's modules (GPU path)", "commands/python-modules"),
)


def _mib(kb) -> float | None:
    return None if kb is None else kb / 1024


def server_section(results: dict) -> tuple[list[str], dict]:
    """Lines about the resident servers and the served requests' memory, and their numbers.
    The table's rows are times; this is what the server itself cost and whether it served."""
    servers = results.get("servers", {})
    checks = {name: value for name, value in results.items() if name.startswith("served-check")}
    lines: list[str] = []
    facts: dict = {"not_served": {}, "unclean_stop": {}}
    if not servers and not checks:
        return lines, facts
    lines.append("nvcontainer serve (one per world, in runc's mount namespace)")
    for world, record in servers.items():
        ready = record.get("ready_ms", [])
        mem = record.get("memory") or {}
        text = f"  {world}: start-up to listening {ready[0]:.0f} ms" if ready else f"  {world}: never ready"
        if len(ready) > 1:
            text += f" (restarts: median {stats.summary(ready[1:])['median']:.0f} ms)"
        if mem:
            text += (f"; resident: VmRSS {mem['VmRSS'] / 1024:.1f} MiB, VmHWM {mem['VmHWM'] / 1024:.1f}, "
                     f"Pss {mem.get('Pss', 0) / 1024:.1f}, private {mem.get('Private', 0) / 1024:.1f}")
        lines.append(text)
        if record.get("status"):
            lines.append(f"    {record['status'][0]}")
        bad = [(rc, left) for rc, left in zip(record.get("stop_rc", []), record.get("socket_left", []))
               if rc != 0 or left]
        if bad or not record.get("stop_rc") or record.get("died"):
            facts["unclean_stop"][world] = {"exit status, socket left": bad, "died": record.get("died", 0)}
            lines.append(f"    DIED OR DID NOT STOP CLEANLY on SIGTERM: {facts['unclean_stop'][world]}")
    for step, arms in checks.items():
        for arm, runs in arms.items():
            served = sum(1 for r in runs if r["served"] and r["rc"] == 0)
            if served < len(runs):
                facts["not_served"][f"{step}/{arm}"] = [r for r in runs if not (r["served"] and r["rc"] == 0)]
            lines.append(f"  {step}/{arm}: {served} of {len(runs)} runs served (a worker of the server's child seen)"
                         + ("" if served == len(runs) else "  NOT SERVED: the timings of this registration are "
                                                            "in-process runs"))
    cpu = servers.get("v1", {}).get("children_cpu_ms", {}).get("concurrent-served")
    n = len(results.get("concurrent-served", {}).get("ms", []))
    if cpu is not None and n:
        facts["concurrent_server_cpu_ms_per_request"] = cpu / n
        lines.append(f"  concurrent-served: CPU of the server's children (requests and their workers), "
                     f"per request: {cpu / n:.1f} ms")
    runs = [r for r in checks.get("served-check", {}).get("served", []) if r["served"]]
    client = results.get("client-maxrss-kb") or results.get("probe-served", {}).get("maxrss_kb")
    inproc = results.get("probe-hook", {}).get("maxrss_kb")
    facts.update(client_rss_mib=_mib(max(client)) if client else None,
                 inprocess_rss_mib=_mib(max(inproc)) if inproc else None,
                 request_private_mib=_mib(max(r["private_kb"] for r in runs)) if runs else None,
                 request_child_hwm_mib=_mib(max(r["child_hwm_kb"] for r in runs)) if runs else None)
    lines.append("memory per container start, MiB (max over the runs)")
    for label, key in (("hook client (served): peak RSS (GNU time's %M)", "client_rss_mib"),
                       ("served request: private memory of the server's child and its workers (sampled)",
                        "request_private_mib"),
                       ("served request: the server's child's VmHWM (counts pages it shares with the server)",
                        "request_child_hwm_mib"),
                       ("nvcontainer-hook (in-process): peak RSS of the hook or a worker", "inprocess_rss_mib")):
        if facts[key] is not None:
            lines.append(f"  {label}: {facts[key]:.1f}")
    return lines, facts


def report(results: dict, facts: dict, runs: int, concurrency: int, nvml_delay: int) -> tuple[str, dict]:
    series = _series(results)
    s = {name: stats.summary(value["ms"]) for name, value in series.items()}
    for name, value in [*results.items(), *series.items()]:
        if isinstance(value, dict) and value.get("cpu_ms"):
            s[f"{name}/cpu"] = stats.summary(value["cpu_ms"])

    def median(name: str) -> float | None:
        return s.get(name, {}).get("median")

    def diff(a: str, b: str) -> float | None:
        return None if median(a) is None or median(b) is None else median(a) - median(b)

    def paired(a: str, b: str) -> float | None:
        return stats.paired_median(series[a]["ms"], series[b]["ms"]) if a in series and b in series else None

    def ratio(step: str, single: str) -> float | None:
        conc = s.get(step, {})
        return conc["p95"] / median(single) if conc.get("n") and median(single) else None

    def slow_ok(step: str, first: str) -> bool | None:
        """later - fast within target, and the later starts all faster than a start that paid NVML
        (else NVML was never slow and the comparison says nothing)."""
        gap = diff(f"{step}/later", f"{step}/fast")
        if gap is None or not s.get(f"{step}/{first}", {}).get("n"):
            return None
        return gap <= TARGET_SLOW and s[f"{step}/later"]["max"] < s[f"{step}/{first}"]["min"]

    lines, served_facts = server_section(results)
    rss = served_facts.get("client_rss_mib")
    private = served_facts.get("request_private_mib")
    served_rss = None if rss is None or private is None else rss + private
    derived = {
        "overhead_v1_ms": diff("v1/served", "v1/none"), "overhead_v2_ms": diff("v2/served", "v2/none"),
        "paired_overhead_v1_ms": paired("v1/served", "v1/none"), "paired_overhead_v2_ms": paired("v2/served", "v2/none"),
        "slow_later_minus_fast_ms": diff("slow-served/later", "slow-served/fast"),
        "paired_slow_later_minus_fast_ms": paired("slow-served/later", "slow-served/fast"),
        "concurrent_p95_over_single_median": ratio("concurrent-served", "v1/served"),
        "served_memory_per_start_mib": served_rss,
        "paired_lease_ms": paired("leases/free", "leases/index"),   # issue 26: < 1 ms
        "inprocess": {
            "overhead_v1_ms": diff("v1/hook", "v1/none"), "overhead_v2_ms": diff("v2/hook", "v2/none"),
            "paired_overhead_v1_ms": paired("v1/hook", "v1/none"),
            "paired_overhead_v2_ms": paired("v2/hook", "v2/none"),
            "slow_later_minus_fast_ms": diff("slow/later", "slow/fast"),
            "concurrent_p95_over_single_median": ratio("concurrent-hook", "v1/hook"),
            "hook_peak_rss_mib": served_facts.get("inprocess_rss_mib")},
        **served_facts,
        "failures": {name: len(value["failures"]) for name, value in series.items() if value["failures"]},
    }
    for name in series:
        if name.startswith("v1/") and name != "v1/none":
            derived[f"overhead_{name[3:]}_ms"] = diff(name, "v1/none")
        if name.startswith("v2/") and name != "v2/none":
            derived[f"overhead_v2_{name[3:]}_ms"] = diff(name, "v2/none")

    def within(value, target):
        return None if value is None else value <= target

    def all_ok(step: str) -> bool:
        return not results.get(step, {}).get("failures")

    inproc = derived["inprocess"]
    checks = [
        ("hook overhead, cgroup v1, served (Δ median)", derived["overhead_v1_ms"], f"<= {TARGET_V1:g} ms (aim 15)",
         within(derived["overhead_v1_ms"], TARGET_V1)),
        ("hook overhead, cgroup v2, served (Δ median)", derived["overhead_v2_ms"], f"<= {TARGET_V2:g} ms",
         within(derived["overhead_v2_ms"], TARGET_V2)),
        (f"NVML {nvml_delay} ms, served: later - fast (median)", derived["slow_later_minus_fast_ms"],
         f"<= {TARGET_SLOW:g} ms", slow_ok("slow-served", "stale")),
        (f"{concurrency} at once, served: p95 / single median", derived["concurrent_p95_over_single_median"],
         f"<= {TARGET_CONCURRENT:g} (x), all succeed",
         None if derived["concurrent_p95_over_single_median"] is None else
         derived["concurrent_p95_over_single_median"] <= TARGET_CONCURRENT and all_ok("concurrent-served")),
        ("served: client RSS + request's private (MiB)", served_rss, f"<= {TARGET_RSS:g} MiB",
         within(served_rss, TARGET_RSS)),
        ("free:1 against GPU 0 named, served (paired Δ median)", derived["paired_lease_ms"],
         f"< {TARGET_LEASE:g} ms", None if derived["paired_lease_ms"] is None else
         derived["paired_lease_ms"] < TARGET_LEASE and all_ok("leases")),
    ]
    comparison = [
        ("hook overhead, cgroup v1, in-process", inproc["overhead_v1_ms"], f"<= {TARGET_V1:g} ms"),
        ("hook overhead, cgroup v2, in-process", inproc["overhead_v2_ms"], f"<= {TARGET_V2:g} ms"),
        (f"NVML {nvml_delay} ms, in-process: later - fast", inproc["slow_later_minus_fast_ms"], f"<= {TARGET_SLOW:g} ms"),
        (f"{concurrency} at once, in-process: p95 / median", inproc["concurrent_p95_over_single_median"],
         f"<= {TARGET_CONCURRENT:g} (x)"),
        ("hook peak RSS, in-process (MiB)", inproc["hook_peak_rss_mib"], f"<= {TARGET_RSS:g} MiB"),
    ]
    # a registration that was not served makes its "served" numbers in-process ones
    if served_facts["not_served"] or any(u["died"] for u in served_facts["unclean_stop"].values()):
        checks = [(label, value, target, "INVALID: not served") for label, value, target, _ in checks]
    labels = sorted({name.split("hook-", 1)[1].split("/")[0] for name in s
                     if name.startswith(("v1/hook-", "probe-hook-"))
                     and "/".join(name.split("/")[:2]) not in ("v1/hook-editable", "v1/hook-nogpu")})
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
                if name.startswith("probe-") and f"{name.replace('*', other)}/cpu" in s:
                    rows.append(("  its CPU time (user + system)", s[f"{name.replace('*', other)}/cpu"]))
        elif name in s:
            rows.append((label, s[name]))
    rows = [row for i, row in enumerate(rows)   # no section heading without rows under it
            if not row[0].startswith("#") or (i + 1 < len(rows) and not rows[i + 1][0].startswith("#"))]
    head = (f"machine: {facts['cpu']}, {facts['cpus']} CPUs, {facts['memory_mib']} MiB, {facts['os']}, "
            f"kernel {facts['kernel']}\n"
            f"         Python {facts['python']}, {facts['runc']}, page fault {facts['page_fault_us']} µs, "
            f"load {facts['loadavg_start']:.2f} at start, {facts.get('loadavg_end', 0):.2f} at end\n"
            f"runs per series: {runs}; fake GPU machine: 2 GPUs, driver 550.54.14\n"
            "served: the hook handed to a resident `nvcontainer serve` (the targets are judged on it);\n"
            "in-process: the hook run by its own interpreter, as without a server (for comparison)\n"
            + ("WARNING: something listens on /run/nvcontainer/hook.sock: the in-process arms paid its answer\n"
               if facts.get("default_socket_present") else "") + "\n")
    goals = targets.judge(targets.from_summaries(s, concurrency, derived["failures"]), real_node=False)
    if served_facts["not_served"] or any(u["died"] for u in served_facts["unclean_stop"].values()):
        goals = targets.invalidate(goals, "INVALID: not served")
    derived["issue27"] = targets.record(goals)
    shown_checks = [c for c in checks if c[1] is not None]
    shown_comparison = [(label, value, target, "(not judged)") for label, value, target in comparison
                        if value is not None]
    text = head + stats.table(rows, shown_checks, notes=lines, comparison=shown_comparison)
    text += "\n" + targets.render(goals, "issue 27's targets: medians over this run's no-hook arm, against NVIDIA's "
                                         "hook 1.17.9 + cli 1.17.0 in the same run (fake machine)"
                                  + ("" if "v1/nvidia" in s else "; NVIDIA's arm absent: no anchors tarball"),
                                  targets.FOOTER_FAKE)
    if derived["failures"]:
        text += f"\nFAILED RUNS: {derived['failures']}\n"
    if served_facts["not_served"]:
        text += f"\nNOT SERVED (the server declined or was not reached): {sorted(served_facts['not_served'])}\n"
    return text, {"summaries": s, "derived": derived, "checks": [
        {"label": label, "value": value, "target": target, "met": met} for label, value, target, met in checks]}


def _series(results: dict) -> dict:
    """Flatten results to ``step/arm`` → {"ms": [...], "failures": [...]}; what is not a timing
    series (servers, served checks) is left out."""
    out = {}
    for name, value in results.items():
        if not isinstance(value, dict):
            continue
        if "ms" in value:
            out[name] = value
        else:
            for arm, series in value.items():
                if isinstance(series, dict) and "ms" in series:
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
    parser.add_argument("--anchors", type=Path, default=nvidia.TARBALL,
                        help="NVIDIA's tools to time beside ours (default: %(default)s; absent: no NVIDIA arm)")
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
        results = collect(ws, args.runs, args.concurrency, args.nvml_delay_ms, base, args.only or PARTS,
                          args.anchors)
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
