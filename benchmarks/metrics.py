"""What a scrape of ``nvcontainer metrics`` costs: 8 GPUs and 100 containers, on the fake machine.

The exporter runs as in production (its NVML sampler program resident, the ``ps`` scan of the
host's /proc each scrape), in the fake machine's /proc view; the mock NVML reports a process in
each of the 100 containers (12 or 13 per GPU, different memory each) and busy readings and GPM
ratios on every GPU. A "container" here is what ``ps``'s scan finds one by: a process in a pid
namespace of its own (``unshare --pid --fork sleep``); engines add nothing the scan reads more
of. Measured from a client in this process, scrapes back to back:

* latency p50 and p99 (the whole HTTP exchange, text format);
* CPU per scrape: user + system time of the exporter and its sampler child, over the run;
* the exporter's resident memory after the warm-up and after ``--scrapes`` scrapes (default
  10,000): no growth is the claim;
* the same latency and CPU while 32 more containers start (each a new pid namespace, started
  32 at once in a loop during that phase, each living a second).

``python -m benchmarks.metrics [--scrapes N] [--json FILE]``; needs root (the fake machine).
A self-contained leaf: it imports no other benchmark module.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPUS, CONTAINERS, STARTING = 8, 100, 32
TICK = os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children (the sampler)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text.rpartition(")")[2].split()
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _inits(n: int, seconds: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["unshare", "--pid", "--fork", "sleep", str(seconds)], stderr=subprocess.DEVNULL)
            for _ in range(n)]


def _end(held: list[subprocess.Popen], inits: list[int]) -> None:
    """SIGKILL: a pid namespace's init ignores SIGTERM, and outlives its unshare."""
    for pid in inits:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in held:
        p.kill()
        p.wait()


def _wait_listening(port: int, exporter: subprocess.Popen) -> None:
    for _ in range(600):
        if exporter.poll() is not None:
            raise RuntimeError("the exporter exited")
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=30).request("GET", "/")
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the exporter does not answer")


def _init_pid(p: subprocess.Popen) -> int:
    """The sleep inside ``unshare --fork``: the container's init as the host numbers it."""
    for _ in range(200):
        try:
            children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise RuntimeError("unshare started no child")


def _scrape(conn: http.client.HTTPConnection) -> tuple[float, bool]:
    """The scrape's time, and whether it was whole: every GPU up, the per-container series in it."""
    start = time.perf_counter()
    conn.request("GET", "/metrics")
    body = conn.getresponse().read()
    took = time.perf_counter() - start
    whole = b"nvcontainer_container_gpu_memory_bytes{" in body and b"nvcontainer_gpu_up{" in body \
        and not any(line.startswith(b"nvcontainer_gpu_up{") and line.endswith(b" 0.0") for line in body.splitlines())
    return took, whole


def _phase(port: int, pid: int, n: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    cpu0 = _cpu(pid)
    got = [_scrape(conn) for _ in range(n)]
    cpu = _cpu(pid) - cpu0
    conn.close()
    times = [t for t, _ in got]
    return {"scrapes": n, "not_whole": sum(not whole for _, whole in got), "p50_ms": round(_percentile(times, 0.5) * 1000, 2),
            "p99_ms": round(_percentile(times, 0.99) * 1000, 2), "cpu_ms_per_scrape": round(cpu / n * 1000, 2)}


def run(scrapes: int) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.fixtures.fakegpu.build import build
    from tests.fixtures.fakegpu.readings import BUSY, set_readings
    from tests.fixtures.fakegpu.runner import fake_proc_command
    from tests.fixtures.fakegpu.spec import FakeSpec

    base = Path(tempfile.mkdtemp(prefix="nvc-bench-metrics-"))
    base.chmod(0o755)
    held = _inits(CONTAINERS, 100000)
    pids: list[int] = []
    exporter = None
    try:
        pids = [_init_pid(p) for p in held]
        machine = build(base / "m", FakeSpec(gpus=GPUS, archs=("9.0",) * GPUS, decoys=False))
        procs = tuple((i % GPUS, pid, (i + 1) << 20, "compute", i % 100) for i, pid in enumerate(pids))
        set_readings(machine, {g: BUSY for g in range(GPUS)}, processes=procs,
                     utilization=tuple((50, 20) for _ in range(GPUS)))
        port = 19400 + os.getpid() % 500
        cfg = base / "config.toml"
        cfg.write_text(f'[nvcontainer]\ncache-dir = "{base / "run"}"\n')
        argv = fake_proc_command(machine, [sys.executable, "-I", "-m", "nvcontainer", "--root", str(machine.root),
                                           "--config", str(cfg), "metrics", "--listen", f"127.0.0.1:{port}",
                                           "--kubernetes", "off"])
        exporter = subprocess.Popen(argv, env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=open(base / "exporter.err", "w"))
        pid = _python_pid(exporter.pid)
        _wait_listening(port, exporter)
        warm = _phase(port, pid, 100)
        rss_warm = _rss_kib(pid)
        steady = _phase(port, pid, scrapes)
        rss_after = _rss_kib(pid)
        stop = threading.Event()

        def churn():
            while not stop.is_set():
                batch = _inits(STARTING, 1)
                for p in batch:
                    p.wait()
                starts.append(len(batch))

        starts: list[int] = []

        thread = threading.Thread(target=churn, daemon=True)
        thread.start()
        starting = _phase(port, pid, 300)
        stop.set()
        thread.join()
        starting["containers_started_meanwhile"] = sum(starts)
        log = (base / "exporter.err").read_text(errors="replace").splitlines()
        return {"gpus": GPUS, "containers": CONTAINERS, "warm_up": warm, "steady": steady,
                "exporter_log": log[-10:],
                "rss_kib_after_warm_up": rss_warm, f"rss_kib_after_{scrapes}_scrapes": rss_after,
                "while_32_start": starting, "cpus": os.cpu_count()}
    finally:
        if exporter is not None:
            exporter.terminate()
            exporter.wait(timeout=30)
        _end(held, pids)
        shutil.rmtree(base, ignore_errors=True)


def _python_pid(outer: int) -> int:
    """The exporter's own process: ``unshare`` and ``sh`` exec into it, but wait for the exec."""
    for _ in range(600):
        try:
            cmdline = Path(f"/proc/{outer}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        if b"nvcontainer" in cmdline and b"metrics" in cmdline and b"python" in cmdline.split(b"\0")[0]:
            return outer
        time.sleep(0.05)
    raise RuntimeError("the exporter did not start")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.metrics")
    ap.add_argument("--scrapes", type=int, default=10000)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # the finally: no orphaned inits
    result = run(args.scrapes)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
