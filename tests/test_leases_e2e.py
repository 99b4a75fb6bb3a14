"""Leases end to end under real runc on the fake 4- and 8-GPU machines: ``free:N`` containers
get distinct GPUs until none is free, the rest are refused or wait; a container's end frees its
GPUs; the in-process hook and ``nvcontainer serve`` share the leases, and a restarted server
keeps the live ones and none of the dead."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures import runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import fake_proc_command

REPO = Path(__file__).resolve().parent.parent
ENXIO = "No such device or address"

# holds its GPUs until the test creates /gate/go; prints what it sees first
HOLD = r"""
echo "NODES:$(ls /dev | grep -E '^nvidia[0-9]+$' | sort | tr '\n' ' ')"
for n in $(ls /dev | grep -E '^nvidia[0-9]+$'); do echo "OPEN:$n:$(cat /dev/$n 2>&1 | head -1)"; done
echo "UP:1"
while [ ! -e /gate/go ]; do sleep 0.05; done
echo "DONE:ok"
"""


def world(tmp_path: Path, *, wait: float = 0, exclusive: bool = False) -> dict:
    run = tmp_path / "run"
    gate = tmp_path / "gate"
    gate.mkdir(exist_ok=True)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[nvcontainer]\ncache-dir = "{run}"\nlease-wait-seconds = {wait}\n'
                   f'exclusive-gpus = {"true" if exclusive else "false"}\n')
    return {"cfg": cfg, "leases": run / "leases.json", "gate": gate, "sock": tmp_path / "s" / "hook.sock"}


def bundle(tmp_path, machine, w, value, *, served: bool, script=HOLD):
    def gate_mount(spec):
        spec["mounts"].append({"destination": "/gate", "type": "bind", "source": str(w["gate"]),
                               "options": ["rbind", "ro"]})
    sock = str(w["sock"]) if served else ""
    return runtime.make_bundle(tmp_path, machine, [f"NVIDIA_VISIBLE_DEVICES={value}"], script,
                               hook_args=("--config", str(w["cfg"]), "--socket", sock), extra_spec=gate_mount)


def leases(w) -> list[dict]:
    try:
        return json.loads(w["leases"].read_text())["leases"]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def four(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=4))


@pytest.fixture(scope="module")
def eight(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=8))


class Server:
    """``nvcontainer serve`` on the test's socket and config, in the fake machine's world."""

    def __init__(self, machine, w):
        self.machine, self.w = machine, w
        self.proc = None

    def start(self):
        self.w["sock"].parent.mkdir(mode=0o700, exist_ok=True)
        argv = [sys.executable, "-I", "-m", "nvcontainer", "--root", str(self.machine.root), "--config",
                str(self.w["cfg"]), "--debug", str(self.w["sock"].parent / "serve.log"), "serve", "--socket",
                str(self.w["sock"])]
        self.proc = subprocess.Popen(fake_proc_command(self.machine, argv), stderr=subprocess.PIPE, text=True,
                                     cwd=REPO)
        line = self.proc.stderr.readline()
        assert "listening" in line, line + self.proc.stderr.read()
        return self

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


def run_all(machine, bundles, w, *, expect_up: int, timeout=240):
    """Start every bundle at once; once ``expect_up`` of them hold their GPUs (and the rest have
    ended), open the gate; every run's result, in order."""
    with concurrent.futures.ThreadPoolExecutor(len(bundles)) as pool:
        futures = [pool.submit(runtime.run_container, machine, b, timeout=timeout) for b in bundles]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            done = sum(f.done() for f in futures)
            if done >= len(bundles) - expect_up and len(leases(w)) >= expect_up:
                break
            time.sleep(0.1)
        held = leases(w)
        (w["gate"] / "go").write_text("")
        return [f.result() for f in futures], held


def check_distinct(results, gpus: int, wanted: int):
    ok = [r for r in results if r.returncode == 0]
    refused = [r for r in results if r.returncode != 0]
    seen = []
    for r in ok:
        got = runtime.parse_facts(r.stdout)
        assert got["DONE"] == ["ok"], r.stdout + r.stderr
        nodes = got["NODES"][0].split()
        assert len(nodes) == wanted, nodes
        for line in got["OPEN"]:
            assert line.endswith(ENXIO), line       # its own GPUs open (no driver behind them)
        seen += nodes
    assert len(seen) == len(set(seen)) == gpus     # distinct, and every GPU given out
    for r in refused:
        assert "no 1 GPU(s) free" in r.stderr or f"no {wanted} GPU(s) free" in r.stderr, r.stderr
        assert "held by container" in r.stderr
    return ok, refused


def test_32_at_once_in_process_get_distinct_gpus_until_none_is_free(eight, tmp_path):
    w = world(tmp_path)
    bundles = [bundle(tmp_path, eight, w, "free:1", served=False) for _ in range(32)]
    results, held = run_all(eight, bundles, w, expect_up=8)
    assert sorted(i for x in held for i in x["indexes"]) == list(range(8))
    ok, refused = check_distinct(results, 8, 1)
    assert len(ok) == 8 and len(refused) == 24
    # every holder has ended: the next request finds no live lease and takes GPU 0
    again = runtime.run_container(eight, bundle(tmp_path, eight, w, "free:2", served=False))
    assert again.returncode == 0, again.stderr
    assert runtime.parse_facts(again.stdout)["NODES"] == ["nvidia0 nvidia1"]
