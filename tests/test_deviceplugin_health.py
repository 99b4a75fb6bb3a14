"""Health watching: the watcher program against the fake machine's mock NVML (events, lost
GPUs, a hung or failing driver, NVLink and PCIe topology), and the monitor that supervises it
(heartbeat deadline, restarts with backoff, nonsense on the pipe)."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time

import pytest

from nvcontainer.health import monitor as monitor_module
from nvcontainer.health.monitor import Monitor
from nvcontainer.deviceplugin.settings import Settings
from nvcontainer.inventory.identity import overflow_ids
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.kubelet import inject_event, set_driver_state

from .test_deviceplugin_core import PLAIN8


@pytest.fixture(scope="module")
def machine8(private_machine):
    """An 8-GPU machine of this module's own: the tests change its NVML's live state."""
    return private_machine(FakeSpec(gpus=8))


@pytest.fixture(autouse=True)
def driver_well(machine8):
    set_driver_state(machine8)
    yield
    set_driver_state(machine8)
    for leftover in machine8.nvml_events.iterdir():
        leftover.unlink()


class Watcher:
    """The watcher program, as the monitor starts it, reading its lines with a deadline."""

    def __init__(self, machine, interval=0.1, user=None):
        gpus = [g["uuid"] for g in machine.description()["gpus"]]
        self.proc = subprocess.Popen([sys.executable, "-I", "-m", "nvcontainer.health.watcher"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=monitor_module.WATCHER_ENV)
        request = {"library": str(machine.nvml_library), "gpus": gpus, "user": list(user or overflow_ids()),
                   "interval": interval}
        self.proc.stdin.write(json.dumps(request).encode())
        self.proc.stdin.close()
        self.buffer = b""

    def line(self, timeout=5.0):
        end = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return "EOF"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def next(self, kind, timeout=5.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            msg = self.line(end - time.monotonic())
            if msg is None:
                break
            if msg == "EOF" or msg.get("ev") in (kind, "error"):
                return msg
        return None

    def close(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def watcher(machine8):
    w = Watcher(machine8)
    yield w
    w.close()


def test_watcher_arms_every_gpu_as_nobody_and_reports_topology(machine8, watcher):
    desc = machine8.description()
    uuids = [g["uuid"] for g in desc["gpus"]]
    assert watcher.next("ready") == {"ev": "ready", "unwatched": {}}
    topo = watcher.next("topology")
    links = {(uuids.index(a), uuids.index(b)): n for a, b, n in topo["nvlink"]}
    assert {tuple(sorted(k)): v for k, v in links.items()} == {
        (0, 1): 2, (2, 3): 2, (4, 5): 2, (6, 7): 2, (1, 2): 1, (5, 6): 1}
    pcie = {tuple(sorted((uuids.index(a), uuids.index(b)))): level for a, b, level in topo["pcie"]}
    assert pcie[(0, 1)] == 10 and pcie[(0, 3)] == 40 and pcie[(3, 4)] == 50 and len(pcie) == 28
    assert watcher.next("beat") == {"ev": "beat", "lost": []}
    status = open(f"/proc/{watcher.proc.pid}/status").read()
    assert f"Uid:\t{overflow_ids()[0]}\t" in status


def test_watcher_reports_events_as_they_come(machine8, watcher):
    uuids = [g["uuid"] for g in machine8.description()["gpus"]]
    assert watcher.next("ready")
    started = time.monotonic()
    inject_event(machine8, 5, 79)
    inject_event(machine8, 2, 94, gi=3, ci=0)
    first = watcher.next("event")
    assert time.monotonic() - started < 1.0
    assert first == {"ev": "event", "gpu": uuids[5], "type": 8, "data": 79, "gi": 0xFFFFFFFF, "ci": 0xFFFFFFFF}
    assert watcher.next("event") == {"ev": "event", "gpu": uuids[2], "type": 8, "data": 94, "gi": 3, "ci": 0}
    assert list(machine8.nvml_events.iterdir()) == []       # consumed, by the unprivileged watcher


def test_watcher_beats_name_lost_gpus(machine8, watcher):
    uuids = [g["uuid"] for g in machine8.description()["gpus"]]
    assert watcher.next("ready")
    set_driver_state(machine8, "gpu3.lost=1", "gpu6.lost=1")
    beat = watcher.next("beat")
    while beat["lost"] == []:
        beat = watcher.next("beat")
    assert beat["lost"] == [uuids[3], uuids[6]]
    set_driver_state(machine8)
    while beat["lost"]:
        beat = watcher.next("beat")


def test_a_hung_driver_stops_the_beat_and_a_failing_one_ends_the_watcher(machine8, watcher):
    assert watcher.next("beat")
    set_driver_state(machine8, "hang=1")
    time.sleep(0.3)
    while watcher.line(0.05) is not None:     # what was on its way
        pass
    assert watcher.line(1.0) is None          # silence: nothing answers
    set_driver_state(machine8, "fail=999")
    error = watcher.next("error")
    assert error["ev"] == "error" and "nvmlEventSetWait" in error["why"]
    assert watcher.line(2.0) == "EOF" and watcher.proc.wait(5) == 1


PARENT = r"""
import json, subprocess, sys, time
request = sys.argv[1]
proc = subprocess.Popen([sys.executable, "-I", "-m", "nvcontainer.health.watcher"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, env=json.loads(sys.argv[2]))
proc.stdin.write(request.encode())
proc.stdin.close()
proc.stdout.readline()
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_a_watcher_stuck_in_the_driver_dies_with_a_killed_plugin(machine8):
    """The plugin SIGKILLed (OOM, a forced pod deletion) while the driver hangs: the watcher, an
    unprivileged process blocked in NVML, has no line to write and so no EPIPE to notice; its
    parent-death signal must end it."""
    gpus = [g["uuid"] for g in machine8.description()["gpus"]]
    request = {"library": str(machine8.nvml_library), "gpus": gpus, "user": list(overflow_ids()), "interval": 0.1}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, json.dumps(request), json.dumps(monitor_module.WATCHER_ENV)],
                              stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        pid = int(parent.stdout.readline())
        assert f"Uid:\t{overflow_ids()[0]}\t" in open(f"/proc/{pid}/status").read()
        set_driver_state(machine8, "hang=1")
        time.sleep(0.3)
        parent.kill()
        parent.wait()
        end = time.monotonic() + 3
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < end:
            time.sleep(0.02)
        assert not os.path.exists(f"/proc/{pid}"), "the watcher outlived its plugin"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_watcher_refuses_a_bad_request_with_one_line():
    proc = subprocess.run([sys.executable, "-I", "-m", "nvcontainer.health.watcher"], input=b"{nope",
                          capture_output=True, timeout=60, env=monitor_module.WATCHER_ENV)
    assert proc.returncode == 1 and proc.stderr == b""
    (line,) = proc.stdout.splitlines()
    assert json.loads(line)["ev"] == "error"


# --- the monitor, with scripted watchers ---------------------------------------------------------

FAKE = r"""
import json, sys, time
sys.stdin.read()
script = json.loads(sys.argv[1])
for step in script:
    if isinstance(step, (int, float)):
        time.sleep(step)
    elif step == "EXIT":
        sys.exit(1)
    else:
        sys.stdout.write(step + "\n")
        sys.stdout.flush()
time.sleep(60)
"""


def run_monitor(script, seconds, *, settings=None, monkeypatch=None, until=None):
    """Run a Monitor whose watcher follows ``script`` for ``seconds``; what it published and said.
    ``until(mon)``: stop as soon as it holds (``seconds`` is then only the bound), so that a
    test of a sequence does not depend on how fast a loaded machine starts the watcher."""
    settings = settings or Settings(heartbeat_seconds=0.1, heartbeat_timeout_seconds=0.5)
    published, said = [], []
    mon = Monitor(PLAIN8, "/nonexistent", settings, None, published.append, lambda t: published.append(t),
                  said.append, argv=[sys.executable, "-c", FAKE, json.dumps(script)], start_timeout=0.5)

    async def main():
        task = asyncio.create_task(mon.run())
        if until is None:
            await asyncio.sleep(seconds)
        else:
            end = time.monotonic() + seconds
            while not until(mon) and time.monotonic() < end:
                await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    return mon, published, said


@pytest.fixture
def quick_backoff(monkeypatch):
    monkeypatch.setattr(monitor_module, "BACKOFF_FIRST", 0.2)


def test_monitor_marks_everything_unhealthy_without_a_heartbeat_and_restarts(quick_backoff):
    beats = ['{"ev":"ready","unwatched":{}}'] + ['{"ev":"beat","lost":[]}', 0.05] * 4
    mon, published, said = run_monitor(beats, 2.5)
    assert mon.starts >= 2
    downs = [p for p in published if isinstance(p, dict) and len(p) == 8]
    assert downs and set(downs[0].values()) == {"no heartbeat in 0.5 s (the driver does not answer)"}
    assert {} in published                              # healthy again on the next watcher's beat
    assert all(a != b for a, b in zip(said, said[1:]))      # a line per change of state
    assert said[:2] == ["health watcher: watching 8 GPU(s)",
                        "health watcher: no heartbeat in 0.5 s (the driver does not answer); every device "
                        "unhealthy until it answers (retrying, at most every 30 s)"]


def test_a_watcher_that_never_starts_is_said_once(quick_backoff):
    mon, published, said = run_monitor([], 2.5)
    assert mon.starts >= 3
    assert said == ["health watcher: no heartbeat in 0.5 s (the driver does not answer); every device "
                    "unhealthy until it answers (retrying, at most every 30 s)"]


@pytest.mark.parametrize("line, why", [
    ("not json", "a line that is not JSON"),
    ("[1, 2]", "a line that is not a JSON object"),
    ('{"ev":"error","why":"Driver Not Loaded\\n"}', "NVML failed: Driver Not Loaded\\n"),
])
def test_monitor_survives_nonsense(quick_backoff, line, why):
    mon, published, said = run_monitor(['{"ev":"beat","lost":[]}', line, "EXIT"], 20, until=lambda m: m.starts >= 2)
    assert said[0] == f"health watcher: {why}; every device unhealthy until it answers (retrying, at most every 30 s)"
    assert mon.starts >= 2 and len(published[-1]) == 8


def test_monitor_applies_events_and_ignores_malformed_ones(quick_backoff):
    u = PLAIN8.gpus[4].uuid
    script = ['{"ev":"ready","unwatched":{}}', '{"ev":"beat","lost":[]}',
              '{"ev":"event","gpu":"%s","type":8,"data":"79","gi":0,"ci":0}' % u,
              '{"ev":"event","gpu":"%s","type":8,"data":79,"gi":4294967295,"ci":4294967295}' % u,
              '{"ev":"beat","lost":["%s", 7]}' % PLAIN8.gpus[1].uuid]
    mon, published, said = run_monitor(script + ['{"ev":"beat","lost":[]}', 0.05] * 3, 0.4)
    assert {u: "XID 79"} in published
    assert {u: "XID 79", PLAIN8.gpus[1].uuid: "GPU is lost"} in published


def test_close_ends_the_monitor_and_its_watcher_when_a_cancel_is_swallowed(quick_backoff, monkeypatch):
    """Python 3.11's wait_for drops a cancellation that lands in the turn its future completes
    (CPython gh-86296): modelled here by a wait_for that swallows the first one and returns a
    line, as the real one does when a watcher's beat comes with SIGTERM. The plugin then never
    exited (seen in CI). close() still ends the task within its bound, and the watcher is gone."""
    real, swallowed, armed = asyncio.wait_for, [], [True]

    async def swallowing(aw, timeout):
        try:
            return await real(aw, timeout)
        except asyncio.CancelledError:
            if swallowed or not armed:
                raise
            swallowed.append(True)
            return b'{"ev":"beat","lost":[]}\n'

    monkeypatch.setattr(asyncio, "wait_for", swallowing)
    settings = Settings(heartbeat_seconds=0.1, heartbeat_timeout_seconds=0.5)
    mon = Monitor(PLAIN8, "/nonexistent", settings, None, lambda bad: None, lambda t: None, lambda line: None,
                  argv=[sys.executable, "-c", FAKE, json.dumps(['{"ev":"beat","lost":[]}', 0.05] * 400)],
                  start_timeout=0.5)
    watchers = []

    async def main():
        task = asyncio.create_task(mon.run())
        await asyncio.sleep(0.5)
        watchers.extend(child_pids())
        started = time.monotonic()
        try:
            await real(mon.close(task), 10)
        finally:
            armed.clear()          # asyncio.run's own cancel at the end is not swallowed
        return task.done(), time.monotonic() - started

    done, took = asyncio.run(main())
    assert swallowed and done and took < 3, (swallowed, done, took)
    assert watchers and not set(watchers) & set(child_pids())


def child_pids() -> list[int]:
    mine = str(os.getpid())
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == mine and fields[0] != "Z":
            out.append(int(entry))
    return out


def test_a_gpu_lost_before_the_watcher_starts_is_lost_in_every_beat(machine8):
    uuids = [g["uuid"] for g in machine8.description()["gpus"]]
    set_driver_state(machine8, "gpu4.lost=1")
    w = Watcher(machine8)
    try:
        ready = w.next("ready")
        assert list(ready["unwatched"]) == [uuids[4]]
        assert w.next("beat")["lost"] == [uuids[4]]
        assert w.next("beat")["lost"] == [uuids[4]]
    finally:
        w.close()


def test_a_driver_without_the_event_api_is_reported_once(machine8):
    set_driver_state(machine8, "no_events=1")
    w = Watcher(machine8)
    try:
        assert w.next("no-events") == {"ev": "no-events", "why": "nvmlEventSetCreate: Not Supported"}
    finally:
        w.close()
        set_driver_state(machine8)


def test_no_event_api_keeps_every_device_with_health_checks_off(quick_backoff):
    """NVIDIA's plugins: a driver whose NVML has no event API keeps its devices, unwatched; one
    line, no retry, nothing withdrawn (before: every GPU unhealthy, retried for ever)."""
    unmonitored = []
    mon, published, said = run_monitor(['{"ev":"no-events","why":"nvmlEventSetCreate: Not Supported"}'], 1.0)
    assert mon.starts == 1 and published == [{}]
    assert said == ["health checks off: the driver's NVML has no event API (nvmlEventSetCreate: Not Supported); "
                    "every device stays available, unmonitored"]
    mon.on_unmonitored = unmonitored.append
    asyncio.run(mon.run())             # returns: no watcher restarted
    assert unmonitored == ["nvmlEventSetCreate: Not Supported"]
