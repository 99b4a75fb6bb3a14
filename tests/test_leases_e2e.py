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
while [ ! -e /gate/go ] && [ ! -e "/gate/$GATE" ]; do sleep 0.05; done
echo "DONE:ok"
"""


NODES_ONLY = HOLD.split("echo \"UP:1\"")[0] + "echo DONE:ok\n"


def world(tmp_path: Path, *, wait: float = 0, exclusive: bool = False, client: str | None = None) -> dict:
    run = tmp_path / "run"
    gate = tmp_path / "gate"
    gate.mkdir(exist_ok=True)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[nvcontainer]\ncache-dir = "{run}"\nlease-wait-seconds = {wait}\n'
                   f'exclusive-gpus = {"true" if exclusive else "false"}\n')
    return {"cfg": cfg, "leases": run / "leases.json", "gate": gate, "sock": tmp_path / "s" / "hook.sock",
            "trace": tmp_path / "hook.log", "client": client}


def starts(w) -> tuple[int, int]:
    """(served, in-process) prestart runs in the hooks' trace."""
    lines = [x for x in w["trace"].read_text().splitlines() if "prestart: pid" in x]
    served = sum("(served by nvcontainer serve" in x for x in lines)
    return served, len(lines) - served


def bundle(tmp_path, machine, w, value, *, served: bool, script=HOLD, gate="none"):
    args = ("--config", str(w["cfg"]), "--debug", str(w["trace"]))

    def edit(spec):
        spec["mounts"].append({"destination": "/gate", "type": "bind", "source": str(w["gate"]),
                               "options": ["rbind", "ro"]})
        if served:   # the registration setup --serve writes: the native client, which asks the server
            entry = spec["hooks"]["prestart"][1]
            entry["path"] = w["client"]
            entry["args"] = [w["client"], "--socket", str(w["sock"]), "--root", str(machine.root), *args, "prestart"]
    return runtime.make_bundle(tmp_path, machine, [f"NVIDIA_VISIBLE_DEVICES={value}", f"GATE={gate}"], script,
                               hook_args=(*args, "--socket", ""), extra_spec=edit)


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

    def __init__(self, machine, w, wrap=()):
        self.machine, self.w, self.wrap = machine, w, list(wrap)   # wrap: an argv prefix for the server
        self.proc = None

    def start(self):
        self.w["sock"].parent.mkdir(mode=0o700, exist_ok=True)
        argv = [*self.wrap, sys.executable, "-I", "-m", "nvcontainer", "--root", str(self.machine.root),
                "--config", str(self.w["cfg"]), "--debug", str(self.w["sock"].parent / "serve.log"), "serve",
                "--socket", str(self.w["sock"])]
        self.proc = subprocess.Popen(fake_proc_command(self.machine, argv), stderr=subprocess.PIPE, text=True,
                                     cwd=REPO)
        line = self.proc.stderr.readline()
        assert "listening" in line, line + self.proc.stderr.read()
        return self

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def run(self, bundle: Path, timeout: int = 240) -> subprocess.CompletedProcess:
        """``runc run`` in the server's world (its mount namespace: the server declines hooks from
        any other), as the service and the engine share a node's."""
        state, name = bundle.parent / "state-served", bundle.name
        enter = ["nsenter", "-t", str(self.proc.pid), "-m", "--", "runc", "--root", str(state)]
        try:
            return subprocess.run([*enter, "run", "--bundle", str(bundle), name], capture_output=True, text=True,
                                  timeout=timeout)
        finally:
            subprocess.run([*enter, "delete", "-f", name], capture_output=True, timeout=60)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


def run_all(machine, bundles, w, *, expect_up: int, timeout=240, server=None):
    """Start every bundle at once; once ``expect_up`` of them hold their GPUs (and the rest have
    ended), open the gate; every run's result, in order."""
    with concurrent.futures.ThreadPoolExecutor(len(bundles)) as pool:
        futures = [pool.submit(server.run, b, timeout) if server else
                   pool.submit(runtime.run_container, machine, b, timeout=timeout) for b in bundles]
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


@pytest.mark.parametrize("served", [False, True], ids=["in-process", "served"])
def test_32_at_once_get_distinct_gpus_until_none_is_free(eight, tmp_path, served, native_client):
    w = world(tmp_path, client=native_client)
    server = Server(eight, w).start() if served else None
    try:
        bundles = [bundle(tmp_path, eight, w, "free:1", served=served) for _ in range(32)]
        results, held = run_all(eight, bundles, w, expect_up=8, server=server)
    finally:
        if server:
            server.stop()
    assert starts(w) == ((32, 0) if served else (0, 32))
    assert sorted(i for x in held for i in x["indexes"]) == list(range(8))
    ok, refused = check_distinct(results, 8, 1)
    assert len(ok) == 8 and len(refused) == 24
    # every holder has ended: the next request finds no live lease and takes GPU 0
    again = runtime.run_container(eight, bundle(tmp_path, eight, w, "free:2", served=False))
    assert again.returncode == 0, again.stderr
    assert runtime.parse_facts(again.stdout)["NODES"] == ["nvidia0 nvidia1"]


def settle(w, want: int, within: float) -> float:
    """Seconds until the lease file holds ``want`` leases (fails after ``within``)."""
    start = time.monotonic()
    while len(leases(w)) != want:
        assert time.monotonic() - start < within, leases(w)
        time.sleep(0.02)
    return time.monotonic() - start


def test_served_and_in_process_share_leases_and_an_exit_frees_within_a_second(four, tmp_path, native_client):
    w = world(tmp_path, client=native_client)
    server = Server(four, w).start()
    try:
        bundles = [bundle(tmp_path, four, w, "free:1", served=True) for _ in range(10)]
        # one in-process holder among the served ones: they share the file and its lock
        bundles.append(bundle(tmp_path, four, w, "free:1", served=False))
        results, held = run_all(four, bundles, w, expect_up=4, server=server)
        check_distinct(results, 4, 1)
        assert starts(w) == (10, 1)
        assert settle(w, 0, 1.0) < 1.0       # the server saw every init exit
    finally:
        server.stop()


def test_killed_server_restarts_keeping_live_leases_and_none_of_dead(four, tmp_path, native_client):
    w = world(tmp_path, client=native_client)
    server = Server(four, w).start()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a = pool.submit(server.run, bundle(tmp_path, four, w, "free:1", served=True, gate="a"))
        b = pool.submit(server.run, bundle(tmp_path, four, w, "free:1", served=True, gate="b"))
        settle(w, 2, 60)
        end = time.monotonic() + 60   # both hooks done: the containers run (a kill before is a start that fails)
        while w["trace"].read_text().count("prestart done") < 2:
            assert time.monotonic() < end
            time.sleep(0.05)
        server.kill()
        (w["gate"] / "a").write_text("")
        assert a.result().returncode == 0
        assert len(leases(w)) == 2           # no server: nobody released it yet
        server = Server(four, w).start()
        try:
            assert settle(w, 1, 1.0) < 1.0   # reconciled at start: a's released, b's kept
            (w["gate"] / "b").write_text("")
            assert b.result().returncode == 0
            assert settle(w, 0, 1.0) < 1.0   # and b's watched by the new server
        finally:
            server.stop()


def test_wait_starts_containers_as_others_exit(four, tmp_path):
    w = world(tmp_path, wait=60)
    quick = 'echo "NODES:$(ls /dev | grep -E \'^nvidia[0-9]+$\' | tr \'\\n\' \' \')"; sleep 1; echo DONE:ok'
    bundles = [bundle(tmp_path, four, w, "free:2", served=False, script=quick) for _ in range(5)]
    with concurrent.futures.ThreadPoolExecutor(len(bundles)) as pool:
        results = list(pool.map(lambda b: runtime.run_container(four, b, timeout=240), bundles))
    for r in results:
        assert r.returncode == 0, r.stderr
        assert len(runtime.parse_facts(r.stdout)["NODES"][0].split()) == 2


def test_exclusive_explicit_requests_take_and_respect_leases(four, tmp_path):
    w = world(tmp_path, exclusive=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder = pool.submit(runtime.run_container, four, bundle(tmp_path, four, w, "1", served=False))
        settle(w, 1, 60)
        assert leases(w)[0]["how"] == "explicit" and leases(w)[0]["indexes"] == [1]
        clash = runtime.run_container(four, bundle(tmp_path, four, w, "1", served=False, script="echo DONE:ok"))
        assert clash.returncode != 0
        line = [x for x in clash.stderr.splitlines() if "exclusive-gpus" in x]
        assert line and "GPU 1 held by container" in line[0], clash.stderr
        other = runtime.run_container(four, bundle(tmp_path, four, w, "free:2", served=False, script=NODES_ONLY))
        assert other.returncode == 0, other.stderr
        assert runtime.parse_facts(other.stdout)["NODES"] == ["nvidia0 nvidia2"]
        (w["gate"] / "go").write_text("")
        assert holder.result().returncode == 0


@pytest.mark.parametrize("value, words", [
    ("free:99", "free:99: this node has 4 GPU(s)"),
    ("free:0", "expected free or free:N"),
    ("free,2", "cannot be mixed"),
])
def test_bad_free_requests_are_one_line(four, tmp_path, value, words):
    w = world(tmp_path)
    res = runtime.run_container(four, bundle(tmp_path, four, w, value, served=False, script="echo DONE:ok"))
    assert res.returncode != 0 and "DONE" not in res.stdout
    ours = [x for x in res.stderr.splitlines() if "nvcontainer" in x and "error" in x]
    assert len(ours) == 1 and words in ours[0], res.stderr
    assert leases(w) == []


def test_a_start_that_fails_after_its_lease_gives_the_gpus_back(four, tmp_path):
    """The lease is taken, then the plan refuses the container (an unmet requirement): the hook
    fails and the GPUs are free again before it exits."""
    w = world(tmp_path)
    b = bundle(tmp_path, four, w, "free:2", served=False, script="echo DONE:ok")
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["env"].append("NVIDIA_REQUIRE_CUDA=cuda>=99.0")
    (b / "config.json").write_text(json.dumps(spec))
    res = runtime.run_container(four, b)
    assert res.returncode != 0 and "requirement error" in res.stderr, res.stderr
    assert w["leases"].exists() and leases(w) == []   # written once, then given back
