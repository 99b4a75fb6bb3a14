"""The fake GPU machine as the start benchmarks use it: the facts recorded beside every result,
a job of :mod:`benchmarks.world` run inside the machine's /proc view, and the cache entries a
run leaves behind. Shared by ``python -m benchmarks``, hookprofile and the device plugin's and
DRA driver's benchmarks, which never import each other (pyproject.toml's contract)."""

from __future__ import annotations

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

from tests.fixtures.fakegpu.runner import fake_proc_command
from tests.fixtures.runtime import CGROUP2_WORLD

from . import workspace


RESULTS = workspace.REPO / "benchmarks" / "results"


CACHE_DIR = "/run/nvcontainer"   # the default cache-dir: the hook runs with production settings


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


def on_fake_machine(name: str, measure_on, gpus: int = 8):
    """``measure_on(machine, base)`` on a fresh ``gpus``-GPU fake machine, its result recorded
    with the machine's facts in ``benchmarks/results/<name>-<time>.json``: (result, that path),
    or (None, None) when not root."""
    if os.geteuid() != 0:
        print(f"benchmarks.{name}: run as root (the fake GPU machine needs mknod and mount namespaces)",
              file=sys.stderr)
        return None, None
    from tests.fixtures.fakegpu import FakeSpec, build

    from .machine import machine_facts

    base = Path(tempfile.mkdtemp(prefix=f"nvc-{name}-bench-"))
    base.chmod(0o755)
    try:
        machine = build(base / "machine", FakeSpec(gpus=gpus))
        facts = machine_facts()
        result = measure_on(machine, base)
        facts["loadavg_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    record = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": facts, **result}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}-{time.strftime('%Y-%m-%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    return result, out
