"""The timed part of the benchmarks, run inside a fake GPU machine's /proc view.

``python -m benchmarks.world JOB.json RESULT.json``: one process per world (cgroup v1 or v2,
fast or slow machine), so the cost of entering the world is never in a measurement. Each step
of the job is a list of runs; every run is timed from spawn to exit with ``perf_counter`` and
its exit status kept, so a failure shows up in the results instead of as a fast sample.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

STATE = ""   # runc's state directory, from the job


def _runc(*args: str) -> list[str]:
    return ["runc", "--root", STATE, *args]


def timed(argv: list[str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ms = (time.perf_counter() - start) * 1000
    return ms, proc.returncode, (proc.stderr or proc.stdout).decode(errors="replace")[-600:]


def run_container(bundle: str) -> tuple[float, int, str]:
    """``runc run`` of the bundle, timed; the container is deleted afterwards, untimed."""
    name = os.path.basename(bundle)
    try:
        return timed(_runc("run", "--bundle", bundle, name))
    finally:
        subprocess.run(_runc("delete", "-f", name), capture_output=True)


def interleaved(step: dict) -> dict:
    """Round-robin over the arms, rotating which goes first, so that drift in the machine's
    speed during the run lands on every arm alike."""
    arms = list(step["arms"])
    for arm in arms:
        for bundle in step.get("warmup", {}).get(arm, []):
            run_container(bundle)
    out = {arm: {"ms": [], "failures": []} for arm in arms}
    for i in range(len(step["arms"][arms[0]])):
        order = arms[i % len(arms):] + arms[:i % len(arms)]
        for arm in order:
            ms, rc, err = run_container(step["arms"][arm][i])
            if rc == 0:
                out[arm]["ms"].append(ms)
            else:
                out[arm]["failures"].append(err)
    return out


def concurrent(step: dict) -> dict:
    """All bundles started at once; each container's time is from its own spawn to its exit."""
    started, done, logs = {}, {}, {}
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
    out = {label: {"ms": [], "failures": []} for label in labels}
    for i in range(step["runs"]):
        for label in labels[i % len(labels):] + labels[:i % len(labels)]:
            ms, rc, err = timed(step["commands"][label])
            if rc == 0:
                out[label]["ms"].append(ms)
            else:
                out[label]["failures"].append(err)
    return out


def after_reboot(step: dict) -> dict:
    """With NVML made slow to initialise: a first start after a reboot, then later starts, each
    later start followed by a start with NVML fast again, ``rounds`` times over.

    The machine is the same throughout; only the mock NVML's ``init_delay_ms`` changes between
    runs, so "later" and "fast" differ in nothing but how slow NVML would be if it were asked.
    A reboot is simulated by giving the cache entry another boot id, which is what a reboot
    leaves behind (a file written in the previous boot): the first start takes the real path,
    read, reject as stale, lock, initialise NVML, rebuild, replace.
    """
    out = {key: {"ms": [], "failures": []} for key in ("first", "later", "fast")}
    bundles = iter(step["bundles"])
    try:
        for _ in range(step["rounds"]):
            set_nvml_delay(step["nvml_config"], step["delay_ms"])
            forget_boot(step["cache_dir"], step["root"])
            plan = ["first"] + ["later", "fast"] * step["later"]
            for key in plan:
                set_nvml_delay(step["nvml_config"], 0 if key == "fast" else step["delay_ms"])
                ms, rc, err = run_container(next(bundles))
                if rc == 0:
                    out[key]["ms"].append(ms)
                else:
                    out[key]["failures"].append(err)
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


STEPS = {"interleaved": interleaved, "concurrent": concurrent, "commands": commands, "after_reboot": after_reboot,
         "concurrent_after_reboot": concurrent_after_reboot}


def main(argv: list[str]) -> int:
    global STATE
    with open(argv[0]) as f:
        job = json.load(f)
    STATE = job["state"]
    os.makedirs(STATE, exist_ok=True)
    results = {}
    for step in job["steps"]:
        sys.stderr.write(f"  {step['name']} ...\n")
        results[step["name"]] = STEPS[step["kind"]](step)
    with open(argv[1], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
