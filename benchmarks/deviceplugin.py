"""Allocate latency of ``nvcontainer device-plugin`` under concurrent clients.

``sudo .venv/bin/python -m benchmarks.deviceplugin [--calls 1000] [--clients 8]`` from the
repository root: an 8-GPU fake machine, the plugin serving it (envvar and cdi-cri strategies),
a fake kubelet it registers with, and ``--clients`` client processes (each its own gRPC channel,
as separate callers; processes, so one client's Python does not queue behind another's) that
together make ``--calls`` Allocate calls for one or two random GPUs, all started at once.
Each call's latency is measured in its client, from the call to the decoded response. Prints a
summary and writes ``benchmarks/results/deviceplugin-<time>.json``; docs/performance.md has the
results.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from . import stats
from .machine import RESULTS, on_fake_machine


def client(socket_path: str, calls: int, ids: list[str], seed: int) -> None:
    """One client process: warm up, say ready, wait for 'go', make ``calls`` calls, print JSON."""
    import grpc

    from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb
    from nvcontainer.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    stub = pb_grpc.DevicePluginStub(grpc.insecure_channel(f"unix:{socket_path}"))
    requests = [pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
        devices_ids=rng.sample(ids, rng.choice((1, 2))))]) for _ in range(calls)]
    stub.Allocate(requests[0], timeout=30)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    latencies, errors = [], []
    for request in requests:
        start = time.perf_counter()
        try:
            response = stub.Allocate(request, timeout=30)
            if len(response.container_responses) != 1:
                errors.append("wrong number of responses")
        except grpc.RpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")
        latencies.append((time.perf_counter() - start) * 1000)
    sys.stdout.write(json.dumps({"latencies": latencies, "errors": errors}) + "\n")


def measure(machine, base: Path, calls: int = 1000, clients: int = 8) -> dict:
    """Run the plugin on ``machine`` and ``clients`` clients making ``calls`` calls in all."""
    from tests.fixtures.kubelet import FakeKubelet, Plugin, plugin_config

    directory = base / "device-plugins"
    directory.mkdir(mode=0o700)
    table = {"socket-dir": str(directory), "sysfs": str(machine.sysfs), "device-list-strategy": ["envvar", "cdi-cri"]}
    config = plugin_config(base / "config.toml", base / "cache", table)
    kubelet = FakeKubelet(directory).start()
    plugin = Plugin(machine, config, base / "debug.log")
    procs = []
    try:
        (reg,) = kubelet.wait_registered(1)
        ids = [g["uuid"] for g in machine.description()["gpus"]]
        share = [calls // clients + (1 if i < calls % clients else 0) for i in range(clients)]
        for i, n in enumerate(share):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.deviceplugin", "--client", str(directory / reg.endpoint), str(n),
                 ",".join(ids), str(i)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent))
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a client did not start")
        started = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in procs]
        wall = time.perf_counter() - started
        for p in procs:
            p.wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        plugin.terminate()
        kubelet.stop()
    latencies = [x for r in results for x in r["latencies"]]
    errors = [e for r in results for e in r["errors"]]
    return {"calls": len(latencies), "clients": clients, "errors": len(errors), "error_samples": errors[:5],
            "wall_s": wall, "calls_per_s": len(latencies) / wall, "latency_ms": stats.latency_summary(latencies)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.deviceplugin")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--client", nargs=4, metavar=("SOCKET", "CALLS", "IDS", "SEED"), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.client:
        socket_path, calls, ids, seed = opts.client
        client(socket_path, int(calls), ids.split(","), int(seed))
        return 0
    result, out = on_fake_machine("deviceplugin", lambda machine, base: measure(machine, base, opts.calls,
                                                                                  opts.clients))
    if result is None:
        return 2
    lat = result["latency_ms"]
    print(f"{result['calls']} Allocate calls from {result['clients']} clients: {result['errors']} errors, "
          f"{result['calls_per_s']:.0f} calls/s")
    print(f"latency ms: p50 {lat['p50']:.2f}  p90 {lat['p90']:.2f}  p99 {lat['p99']:.2f}  max {lat['max']:.2f}")
    print(f"recorded in {out.relative_to(RESULTS.parent.parent)}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
