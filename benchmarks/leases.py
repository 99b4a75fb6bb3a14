"""What a ``free:1`` allocation costs by itself: the lease taken (lock, read, liveness of every
lease, decision, atomic write) and given back, on an 8-GPU inventory with 7 GPUs held by live
leases, the file on a tmpfs (``/run`` in production; ``/dev/shm`` where a build machine's ``/run`` is a disk).

Also in a child freshly forked from that process (what a served request is), cold and after
the read-only rehearsal ``nvcontainer serve``'s spare child does ahead (``grant.rehearse``): in a
fresh child most of the cost is copy-on-write page faults.

Why apart from ``python -m benchmarks --only leases`` (a served start with ``free:1`` paired with
one naming GPU 0): a container start on a busy 2-CPU machine varies by tens of milliseconds, far
more than the allocation; this times the allocation's own code, run by run.

``python -m benchmarks.leases [--runs N]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import tempfile
import time

from nvcontainer.config.model import Config
from nvcontainer.inventory.model import Gpu, Inventory
from nvcontainer.leases import grant, store

from . import stats


def inventory(n: int) -> Inventory:
    return Inventory(root="/", driver_version="550.54.14", cuda_version="12.4", gpus=tuple(
        Gpu(index=i, minor=i, model="Fake", brand="Tesla", uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
            bus_id=f"00000000:{i + 1:02x}:00.0", arch="9.0") for i in range(n)))


def tmpfs() -> str | None:
    """/run where it is a tmpfs (production), else /dev/shm (a build machine's /run may be disk)."""
    for path in ("/run", "/dev/shm"):
        if os.access(path, os.W_OK) and _is_tmpfs(path):
            return path
    return None


def _is_tmpfs(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path and line.split()[2] == "tmpfs" for line in f)


def in_child(inv: Inventory, cfg: Config, rehearse_path: str | None) -> tuple[float, int]:
    """(ms, minor page faults) of one take in a child forked now, after a rehearsal if asked."""
    gc.collect()
    gc.freeze()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if rehearse_path:
                grant.rehearse(rehearse_path, inv)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            grant.take(inv, cfg, f"child-{os.getpid()}", os.getpid(), "/b", asked="free:1", count=1)
            ms = (time.perf_counter() - start) * 1e3
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            grant.release(cfg, f"child-{os.getpid()}")
            os.write(w, f"{ms} {faults}".encode())
        finally:
            os._exit(0)
    os.close(w)
    ms, faults = os.read(r, 64).split()
    os.close(r)
    os.waitpid(pid, 0)
    gc.unfreeze()
    return float(ms), int(faults)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.leases")
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args(argv)
    base = tempfile.mkdtemp(prefix="nvc-lease-bench-", dir=tmpfs())
    try:
        cfg = Config(cache_dir=os.path.join(base, "run"))
        inv = inventory(8)
        pid = os.getpid()
        for i in range(7):   # seven GPUs held by live leases (this process, seven containers)
            grant.take(inv, cfg, f"holder-{i}", pid, "/b", asked="free:1", count=1)
        take, give = [], []
        for n in range(args.runs):
            t0 = time.perf_counter()
            grant.take(inv, cfg, "bench", pid, "/b", asked="free:1", count=1)
            t1 = time.perf_counter()
            grant.release(cfg, "bench")
            t2 = time.perf_counter()
            take.append((t1 - t0) * 1e3)
            give.append((t2 - t1) * 1e3)
        assert len(store.load(store.path_in(cfg.cache_dir))) == 7
        path = store.path_in(cfg.cache_dir)
        cold = [in_child(inv, cfg, None) for _ in range(min(args.runs, 200))]
        rehearsed = [in_child(inv, cfg, path) for _ in range(min(args.runs, 200))]
        for label, samples in (("take free:1 (8 GPUs, 7 held)", take), ("release", give),
                               ("take, fresh fork child", [ms for ms, _ in cold]),
                               ("  its page faults", [f for _, f in cold]),
                               ("take, child after rehearsal", [ms for ms, _ in rehearsed]),
                               ("  its page faults", [f for _, f in rehearsed])):
            s = stats.summary(samples)
            print(f"{label:32} n {s['n']:5}  median {s['median']:8.3f}  p95 {s['p95']:8.3f}  "
                  f"min {s['min']:8.3f}  max {s['max']:8.3f}  (ms, or faults)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
