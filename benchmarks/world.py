"""The timed part of the benchmarks, run inside a fake GPU machine's /proc view.

``python -m benchmarks.world JOB.json RESULT.json``: one process per world (cgroup v1 or v2,
fast or slow machine), so the cost of entering the world is never in a measurement. Each step
of the job is a list of runs; every run is timed from spawn to exit with ``perf_counter`` and
its exit status kept, so a failure shows up in the results instead of as a fast sample.

A job may name a server (``nvcontainer serve``): it is started here, in this world's mount
namespace (the server declines hooks from another one), before the first step, and stopped with
SIGTERM after the last; its start-up time, memory and clean exit are part of the results.

CPU per start (issue 17: "all processes the start causes, server and spare included"): what
``runc run`` and everything it waited for used (the hook, its workers or NVIDIA's cli and its
ldconfig, the container; ``getrusage`` of this process's children, microseconds), plus what the
server's whole tree used from just before the start until it settled again after it (the
request's child, its workers and sandbox, and the warm-up of the spare that replaces the one
used), read from a cpuacct cgroup of its own (nanoseconds, reaped processes included). Without
the v1 cpuacct controller only the first part is measured.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from .worldserver import Server, children_of, memory_kb

STATE = ""   # runc's state directory, from the job
SERVER: "Server | None" = None


def _runc(*args: str) -> list[str]:
    return ["runc", "--root", STATE, *args]


def timed(argv: list[str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ms = (time.perf_counter() - start) * 1000
    return ms, proc.returncode, (proc.stderr or proc.stdout).decode(errors="replace")[-600:]


def run_container(bundle: str) -> tuple[float, int, str, float | None]:
    """``runc run`` of the bundle, timed; the container is deleted afterwards, untimed. First the
    world's server is let settle (:func:`settle`). The fourth value is the start's CPU
    milliseconds (see the module docstring): with a server, it is let settle after the run too,
    so that the spare the start used up is replaced within this start's account."""
    name = os.path.basename(bundle)
    settle()
    server_before = SERVER.cpu_ns() if SERVER else None
    before = _children_cpu_s()
    try:
        ms, rc, err = timed(_runc("run", "--bundle", bundle, name))
        cpu_ms = (_children_cpu_s() - before) * 1000
    finally:
        subprocess.run(_runc("delete", "-f", name), capture_output=True)
    if server_before is not None:
        settle()
        server_after = SERVER.cpu_ns()
        cpu_ms = None if server_after is None else cpu_ms + (server_after - server_before) / 1e6
    return ms, rc, err, cpu_ms


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


SETTLE_MAX = 1.0       # seconds
SETTLE_QUIET = 0.02    # seconds without CPU use that count as settled


def settle() -> float:
    """Wait (untimed) until the world's server does nothing: after a served run it forks its next
    spare and that warms itself (tens of ms of CPU, nvcontainer/serve.py), and whatever run came
    next, of any arm, would share the CPUs with it. Settled means a spare is there (unless the
    server runs without) and the server's whole process tree has used no CPU for
    ``SETTLE_QUIET``. Returns the seconds waited."""
    if SERVER is None or SERVER.proc is None or SERVER.proc.poll() is not None:
        return 0.0
    start = time.monotonic()
    last, quiet_since = None, start
    while time.monotonic() - start < SETTLE_MAX:
        tree = [SERVER.proc.pid]
        for pid in tree:
            tree += children_of(pid)
        cpu = sum(_cpu_ns(pid) for pid in tree)
        now = time.monotonic()
        if cpu != last:
            last, quiet_since = cpu, now
        spare = SERVER.spare is False or any(_comm(pid) == "nvc-spare" for pid in tree)
        if spare and now - quiet_since >= SETTLE_QUIET:
            break
        time.sleep(0.002)
    return time.monotonic() - start


def _cpu_ns(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def interleaved(step: dict) -> dict:
    """Round-robin over the arms, rotating which goes first, so that drift in the machine's
    speed during the run lands on every arm alike."""
    arms = list(step["arms"])
    for arm in arms:
        for bundle in step.get("warmup", {}).get(arm, []):
            run_container(bundle)
    return _round_robin(arms, len(step["arms"][arms[0]]), lambda arm, i: run_container(step["arms"][arm][i]))


def _results(keys) -> dict:
    return {key: {"ms": [], "failures": []} for key in keys}


def _record(entry: dict, result: tuple) -> None:
    """One run's ``(ms, rc, err[, cpu_ms])``: its time (and CPU) if it exited 0, else its error."""
    ms, rc, err = result[:3]
    if rc == 0:
        entry["ms"].append(ms)
        if len(result) > 3 and result[3] is not None:   # None: the server's share was not read
            entry.setdefault("cpu_ms", []).append(result[3])
    else:
        entry["failures"].append(err)


def _round_robin(names: list[str], rounds: int, run) -> dict:
    """``run(name, i)`` for every name in every round, the first name rotating; the times of
    the runs that exited 0, the errors of the others."""
    out = _results(names)
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            _record(out[name], run(name, i))
    return out


def concurrent(step: dict) -> dict:
    """All bundles started at once; each container's time is from its own spawn to its exit."""
    started, done, logs = {}, {}, {}
    settle()
    for bundle in step["bundles"]:
        name = os.path.basename(bundle)
        log = os.open(os.path.join(bundle, "run.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        argv = _runc("run", "--bundle", bundle, name)
        null = os.open(os.devnull, os.O_RDONLY)
        actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, log, 1), (os.POSIX_SPAWN_DUP2, log, 2)]
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
        started[pid] = time.perf_counter()
        logs[pid] = bundle
        os.close(log)
        os.close(null)
    while len(done) < len(started):
        pid, status = os.waitpid(-1, 0)
        if pid in started:
            done[pid] = ((time.perf_counter() - started[pid]) * 1000, os.waitstatus_to_exitcode(status))
    out = {"ms": [], "failures": []}
    for pid, (ms, rc) in done.items():
        bundle = logs[pid]
        subprocess.run(_runc("delete", "-f", os.path.basename(bundle)), capture_output=True)
        if rc == 0:
            out["ms"].append(ms)
        else:
            with open(os.path.join(bundle, "run.log"), errors="replace") as f:
                out["failures"].append(f.read()[-600:])
    return out


def commands(step: dict) -> dict:
    """Each command of ``step["commands"]`` (label → argv) run ``runs`` times, interleaved."""
    labels = list(step["commands"])
    for label in labels:
        timed(step["commands"][label])
    return _round_robin(labels, step["runs"], lambda label, _i: timed(step["commands"][label]))


def after_reboot(step: dict) -> dict:
    """With NVML made slow to initialise: a first start after a reboot, then later starts, each
    later start followed by a start with NVML fast again, ``rounds`` times over.

    The machine is the same throughout; only the mock NVML's ``init_delay_ms`` changes between
    runs, so "later" and "fast" differ in nothing but how slow NVML would be if it were asked.
    A reboot is simulated by giving the cache entry another boot id, which is what a reboot
    leaves behind (a file written in the previous boot): the first start takes the real path,
    read, reject as stale, lock, initialise NVML, rebuild, replace.
    """
    out = _results(("first", "later", "fast"))
    bundles = iter(step["bundles"])
    try:
        for _ in range(step["rounds"]):
            set_nvml_delay(step["nvml_config"], step["delay_ms"])
            forget_boot(step["cache_dir"], step["root"])
            plan = ["first"] + ["later", "fast"] * step["later"]
            for key in plan:
                set_nvml_delay(step["nvml_config"], 0 if key == "fast" else step["delay_ms"])
                _record(out[key], run_container(next(bundles)))
    finally:
        set_nvml_delay(step["nvml_config"], 0)
    return out


def concurrent_after_reboot(step: dict) -> dict:
    set_nvml_delay(step["nvml_config"], step["delay_ms"])
    forget_boot(step["cache_dir"], step["root"])
    try:
        return concurrent(step)
    finally:
        set_nvml_delay(step["nvml_config"], 0)


def set_nvml_delay(path: str, ms: int) -> None:
    """The fake machine's knob: the mock NVML sleeps this long in every nvmlInit."""
    with open(path) as f:
        lines = [f"init_delay_ms={ms}" if line.startswith("init_delay_ms=") else line for line in f.read().splitlines()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def forget_boot(cache_dir: str, root: str) -> None:
    for name in os.listdir(cache_dir):
        if not name.startswith("inventory-"):
            continue
        path = os.path.join(cache_dir, name)
        with open(path) as f:
            entry = json.load(f)
        if entry.get("inputs", {}).get("root") != root:
            continue
        entry["machine"]["boot_id"] = "a-previous-boot"
        tmp = path + ".bench.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.rename(tmp, path)


def served_check(step: dict) -> dict:
    """Containers with a served registration, run while this process samples the server's
    descendants (untimed: the sampling takes CPU). Per run: whether the request was served, and
    the memory it took on the server's side.

    Served means a grandchild of the server was seen: a request the server takes runs the hook in
    its child, which forks the mount and ldconfig workers; a declined one (another namespace) ends
    in the child within a millisecond, and the client then runs the hook in-process, which would
    look like a slow served run in the timings. ``child_hwm_kb`` is the child's VmHWM (it counts
    the pages it shares with the server); ``private_kb`` the peak, over the samples, of the
    private memory of the whole request tree (child and workers): what a request adds."""
    out = {}
    for arm, bundles in step["arms"].items():
        runs = []
        for bundle in bundles:
            name = os.path.basename(bundle)
            seen_children, seen_grandchildren, hwm, private = set(), set(), 0, 0
            proc = subprocess.Popen(_runc("run", "--bundle", bundle, name), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                while proc.poll() is None:
                    server = SERVER.proc.pid
                    total = 0
                    for child in children_of(server):
                        seen_children.add(child)
                        tree = [child]
                        for p in tree:
                            kids = children_of(p)
                            seen_grandchildren.update(kids)
                            tree += kids
                        for p in tree:
                            mem = memory_kb(p)
                            total += mem.get("Private", 0)
                            if p == child:
                                hwm = max(hwm, mem.get("VmHWM", 0))
                    private = max(private, total)
                    time.sleep(0.0005)
                err = proc.stdout.read().decode(errors="replace")[-600:]
            finally:
                subprocess.run(_runc("delete", "-f", name), capture_output=True)
            runs.append({"rc": proc.returncode, "served": bool(seen_grandchildren), "children": len(seen_children),
                         "child_hwm_kb": hwm, "private_kb": private, "error": err if proc.returncode else ""})
        out[arm] = runs
    return out


def after_reboot_served(step: dict) -> dict:
    """The served hook with NVML slow. A server builds the inventory before it listens, so after
    a reboot it is the server's start-up that meets NVML, not a container. Each round:

    * a reboot is simulated (the cache entry gets another boot id) and the server restarted:
      ``serve-start`` is its time to listening (NVML paid there), ``first`` the first container
      after that;
    * ``later`` starts, each followed by a ``fast`` one (NVML fast again), as in-process;
    * ``stale``: the cache entry made stale again under the running server (as if the driver or
      the ld cache changed): that request pays NVML itself.
    """
    out = _results(("serve-start", "first", "later", "fast", "stale"))
    bundles = iter(step["bundles"])

    def one(key: str) -> None:
        _record(out[key], run_container(next(bundles)))

    try:
        for _ in range(step["rounds"]):
            set_nvml_delay(step["nvml_config"], step["delay_ms"])
            SERVER.stop()
            forget_boot(step["cache_dir"], step["root"])
            out["serve-start"]["ms"].append(SERVER.start())
            one("first")
            for key in ["later", "fast"] * step["later"]:
                set_nvml_delay(step["nvml_config"], 0 if key == "fast" else step["delay_ms"])
                one(key)
            set_nvml_delay(step["nvml_config"], step["delay_ms"])
            forget_boot(step["cache_dir"], step["root"])
            one("stale")
    finally:
        set_nvml_delay(step["nvml_config"], 0)
    return out


STEPS = {"interleaved": interleaved, "concurrent": concurrent, "commands": commands, "after_reboot": after_reboot,
         "concurrent_after_reboot": concurrent_after_reboot, "served_check": served_check,
         "after_reboot_served": after_reboot_served}


def main(argv: list[str]) -> int:
    global STATE, SERVER
    with open(argv[0]) as f:
        job = json.load(f)
    STATE = job["state"]
    os.makedirs(STATE, exist_ok=True)
    results = {}
    if job.get("server"):
        SERVER = Server(job["server"])
        sys.stderr.write("  nvcontainer serve ...\n")
        SERVER.start()
    try:
        for step in job["steps"]:
            sys.stderr.write(f"  {step['name']} ...\n")
            before = SERVER.children_cpu_ms() if SERVER else None
            results[step["name"]] = STEPS[step["kind"]](step)
            after = SERVER.children_cpu_ms() if SERVER else None
            if before is not None and after is not None:   # a restart in the step resets the count
                SERVER.record["children_cpu_ms"][step["name"]] = after - before
        if SERVER:
            SERVER.measure_memory()
    finally:
        if SERVER:
            SERVER.stop()
            SERVER.remove_account()
    if SERVER:
        results["servers"] = {job["server"]["name"]: SERVER.record}
    with open(argv[1], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
