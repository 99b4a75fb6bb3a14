"""NodePrepareResources latency of ``nvcontainer dra-driver``, alone and under concurrent callers.

``sudo .venv/bin/python -m benchmarks.dra [--samples 50] [--claims 100] [--callers 8]`` from
the repository root: an 8-GPU fake machine, the fake API server serving the claims, the plugin
registered with a fake kubelet (tests/fixtures: kubeapi.py, dra_kubelet.py). Three runs:

* ``--samples`` claims of 1 GPU, then of all 8 GPUs, prepared one after another (each a new
  claim: the API read, the spec written, the checkpoint saved) and unprepared;
* ``--claims`` claims of 1 or 2 random GPUs prepared by ``--callers`` threads at once (each its
  own gRPC channel), every answer checked: no error, the claim's CDI names, its spec on disk.

Each call's latency is measured in the caller, from the call to the decoded response. Prints a
summary and writes ``benchmarks/results/dra-<time>.json``. Not a timed test: numbers depend on
the machine (docs/engines/kubernetes-dra-node.md has a run).
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import uuid
from pathlib import Path

from . import stats
from .machine import RESULTS, on_fake_machine

NODE = "bench-node"


def claim(server, name: str, devices: list[str]) -> tuple[str, str, str]:
    obj = server.put_claim({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": "bench", "name": name, "uid": str(uuid.uuid4())},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": d} for d in devices]}}}})
    return "bench", name, obj["metadata"]["uid"]


def timed(kubelet, c) -> tuple[float, str]:
    start = time.perf_counter()
    got = kubelet.prepare(c)
    ms = (time.perf_counter() - start) * 1000
    error, devices = got.get(c[2], ("no answer for the claim", []))
    return ms, error or ("" if devices else "no devices")


def sequential(kubelet, server, devices: list[str], samples: int, tag: str) -> dict:
    latencies, errors = [], []
    for i in range(samples):
        c = claim(server, f"{tag}-{i}", devices)
        ms, error = timed(kubelet, c)
        latencies.append(ms)
        if error:
            errors.append(error)
        kubelet.unprepare(c)
    return {"latency_ms": stats.latency_summary(latencies), "errors": len(errors), "error_samples": errors[:3]}


def concurrent(kubelet, server, gpus: list[str], claims: int, callers: int, cdi: Path) -> dict:
    rng = random.Random(1)
    wanted = [claim(server, f"many-{i}", rng.sample(gpus, rng.choice((1, 2)))) for i in range(claims)]
    shares = [wanted[i::callers] for i in range(callers)]
    latencies, errors, lock = [], [], threading.Lock()
    go = threading.Barrier(callers + 1)

    def caller(mine):
        go.wait()
        for c in mine:
            ms, error = timed(kubelet, c)
            with lock:
                latencies.append(ms)
                if error:
                    errors.append(error)

    threads = [threading.Thread(target=caller, args=(s,)) for s in shares]
    for t in threads:
        t.start()
    go.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    from nvcontainer.dra.node import claimspec

    missing = [c[2] for c in wanted if not (cdi / claimspec.file_name(c[2])).exists()]
    return {"claims": claims, "callers": callers, "errors": len(errors), "error_samples": errors[:3],
            "specs_missing": len(missing), "wall_s": wall, "claims_per_s": claims / wall,
            "latency_ms": stats.latency_summary(latencies)}


def measure(machine, base: Path, samples: int, claims: int, callers: int) -> dict:
    from tests.fixtures.dra_kubelet import FakeDraKubelet
    from tests.fixtures.kubeapi import FakeApiServer
    from tests.fixtures.kubelet import Plugin, plugin_config

    registrar, plugins, cdi = base / "registry", base / "plugins", base / "cdi"
    for d in (registrar, plugins):
        d.mkdir(mode=0o700)
    server = FakeApiServer()
    server.put_node(NODE)
    config = plugin_config(base / "config.toml", base / "cache", {})
    args = ["--node-name", NODE, "--cdi-root", str(cdi), "--kubelet-registrar-directory-path", str(registrar),
            "--kubelet-plugins-directory-path", str(plugins), "--kubeconfig",
            server.write_kubeconfig(str(base / "kubeconfig")), "--hook-path", "/usr/local/bin/nvcontainer-hook"]
    plugin = Plugin(machine, config, base / "debug.log", args, command="dra-driver")
    try:
        kubelet = FakeDraKubelet(registrar, plugins)
        kubelet.wait_registered(60)
        gpus = [f"gpu-{g['minor']}" for g in machine.description()["gpus"]]
        return {"one_gpu": sequential(kubelet, server, gpus[:1], samples, "one"),
                "eight_gpus": sequential(kubelet, server, gpus, samples, "eight"),
                "concurrent": concurrent(kubelet, server, gpus, claims, callers, cdi)}
    finally:
        plugin.terminate()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dra")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--claims", type=int, default=100)
    parser.add_argument("--callers", type=int, default=8)
    opts = parser.parse_args(argv)
    result, out = on_fake_machine("dra", lambda machine, base: measure(machine, base, opts.samples, opts.claims,
                                                                       opts.callers))
    if result is None:
        return 2
    for key, label in (("one_gpu", "1 GPU"), ("eight_gpus", "8 GPUs")):
        lat = result[key]["latency_ms"]
        print(f"prepare, {label}: p50 {lat['p50']:.1f} ms  p99 {lat['p99']:.1f} ms  ({lat['n']} claims, "
              f"{result[key]['errors']} errors)")
    many = result["concurrent"]
    lat = many["latency_ms"]
    print(f"{many['claims']} claims by {many['callers']} callers: {many['errors']} errors, {many['specs_missing']} "
          f"specs missing, {many['claims_per_s']:.0f} claims/s, p50 {lat['p50']:.1f} ms  p99 {lat['p99']:.1f} ms")
    print(f"recorded in {out.relative_to(RESULTS.parent.parent)}")
    bad = many["errors"] or many["specs_missing"] or result["one_gpu"]["errors"] or result["eight_gpus"]["errors"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
