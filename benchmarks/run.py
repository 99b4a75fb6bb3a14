"""Container start latency on the fake GPU machine: the worlds each part runs and their samples,
collected for ``python -m benchmarks`` (``benchmarks/__main__.py``; :mod:`benchmarks.report`
makes the table). See ``benchmarks/__init__.py`` for what is measured and ``docs/performance.md``
for the results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.fixtures.fakegpu import FakeSpec

from . import nvidia, workspace
from .machine import CACHE_DIR, run_world, server_job


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


