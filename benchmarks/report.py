"""The table ``python -m benchmarks`` prints and the figures its JSON record derives from the
samples (:mod:`benchmarks.run` collects them)."""

from __future__ import annotations

from . import stats, targets

# Targets of issue #6, in milliseconds (RSS in MiB).
TARGET_V1, TARGET_V2, TARGET_SLOW, TARGET_CONCURRENT, TARGET_RSS = 20.0, 25.0, 5.0, 3.0, 40.0
TARGET_LEASE = 1.0   # issue 26: what a free:1 allocation may add to a served start


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
