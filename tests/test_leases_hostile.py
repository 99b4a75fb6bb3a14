"""Leases against hostile requests and faults, under real runc on the fake 4-GPU machine, by the
in-process hook and by ``nvcontainer serve`` (issue 35): a container that spells one GPU's UUID
140 ways holds that GPU and nothing else, and nobody else is granted it; a damaged entry holds
its GPU for as long as its container runs; a server killed in the middle of a lease request
leaves a readable file and no GPU held by a container that never started."""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import subprocess
import time

import pytest

from nvcontainer.leases import liveness, store
from tests.fixtures import runtime
from tests.test_leases_bounds import spellings
from tests.test_leases_e2e import NODES_ONLY, Server, bundle, four, leases, settle, world  # noqa: F401 (fixture)


def refusal(res) -> str:
    assert res.returncode != 0 and "DONE" not in res.stdout, res.stdout
    ours = [x for x in res.stderr.splitlines() if "nvcontainer" in x and "error" in x]
    assert len(ours) == 1, res.stderr
    return ours[0]


@pytest.mark.parametrize("served", [False, True], ids=["in-process", "served"])
def test_140_spellings_of_one_uuid_hold_that_gpu_and_no_other_is_granted_it(four, tmp_path, served, native_client):
    w = world(tmp_path, exclusive=True, client=native_client)
    uuid = four.description()["gpus"][1]["uuid"]
    server = Server(four, w).start() if served else None
    run = server.run if served else (lambda b: runtime.run_container(four, b))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            holder = pool.submit(run, bundle(tmp_path, four, w, spellings(uuid, 140), served=served))
            settle(w, 1, 60)
            (lease,) = leases(w)
            assert (lease["indexes"], lease["gpus"], lease["asked"]) == ([1], [uuid], "1")
            assert store.load(str(w["leases"]))[0].container   # the file reads back whole
            other = run(bundle(tmp_path, four, w, "free:3", served=served, script=NODES_ONLY))
            assert other.returncode == 0, other.stderr
            assert runtime.parse_facts(other.stdout)["NODES"] == ["nvidia0 nvidia2 nvidia3"]
            line = refusal(run(bundle(tmp_path, four, w, "free:4", served=served, script="echo DONE:ok")))
            assert "no 4 GPU(s) free; GPU 1 held by container" in line, line
            line = refusal(run(bundle(tmp_path, four, w, uuid.lower(), served=served, script="echo DONE:ok")))
            assert "exclusive-gpus: GPU 1 held by container" in line, line
            (w["gate"] / "go").write_text("")
            assert holder.result().returncode == 0
    finally:
        if server:
            server.stop()
    assert [x for x in store.load(str(w["leases"])) if liveness.alive(x)] == []


def test_a_damaged_entry_holds_its_gpu_while_its_container_runs(four, tmp_path):
    """An entry an older nvcontainer wrote past the reader's bound, held by a running process:
    kept beside a new lease, its GPU refused to others, dropped once the process has ended."""
    w = world(tmp_path)
    holder = subprocess.Popen(["sleep", "600"])
    try:
        entry = {"gpus": ["GPU-x"], "indexes": [2], "container": "old", "pid": holder.pid,
                 "start": liveness.start_time(holder.pid), "bundle": "/b", "since": time.time(), "how": "explicit",
                 "asked": "x" * 6000}
        w["leases"].parent.mkdir(mode=0o700)
        w["leases"].write_text(json.dumps({"version": store.VERSION, "leases": [entry]}))
        got = runtime.run_container(four, bundle(tmp_path, four, w, "free:3", served=False, script=NODES_ONLY))
        assert got.returncode == 0, got.stderr
        assert runtime.parse_facts(got.stdout)["NODES"] == ["nvidia0 nvidia1 nvidia3"]
        line = refusal(runtime.run_container(four, bundle(tmp_path, four, w, "free:4", served=False,
                                                          script="echo DONE:ok")))
        assert "GPU 2 held by unreadable lease entry" in line and "field 'asked' is 6000 characters" in line, line
        assert entry in json.loads(w["leases"].read_text())["leases"]
    finally:
        holder.kill()
        holder.wait()
    got = runtime.run_container(four, bundle(tmp_path, four, w, "free:4", served=False, script=NODES_ONLY))
    assert got.returncode == 0, got.stderr
    assert entry not in json.loads(w["leases"].read_text())["leases"]


def test_a_damaged_file_refuses_every_lease_in_one_line_until_moved_aside(four, tmp_path):
    w = world(tmp_path)
    w["leases"].parent.mkdir(mode=0o700)
    w["leases"].write_text('{"version": 1, "leases": [{"gpus"')
    line = refusal(runtime.run_container(four, bundle(tmp_path, four, w, "free", served=False, script="echo DONE:ok")))
    assert "truncated or not JSON" in line and "no GPU is leased while it cannot be read" in line, line
    os.rename(w["leases"], str(w["leases"]) + ".moved")
    got = runtime.run_container(four, bundle(tmp_path, four, w, "free", served=False, script=NODES_ONLY))
    assert got.returncode == 0, got.stderr


def test_a_server_killed_in_the_middle_of_a_lease_leaves_nothing_held(four, tmp_path, native_client):
    """The served request waits for the lease file's lock (held here) when its server is killed:
    the start fails with one line, the file stays readable, nothing is held by the container
    that never started, and the next start (in-process) gets every GPU."""
    w = world(tmp_path, client=native_client)
    server = Server(four, w).start()
    lock = os.open(w["leases"].parent / store.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = pool.submit(server.run, bundle(tmp_path, four, w, "free:2", served=True, script="echo DONE:ok"))
            end = time.monotonic() + 60
            while not (w["trace"].exists() and "prestart: pid" in w["trace"].read_text()):
                assert time.monotonic() < end and not started.done()
                time.sleep(0.02)
            time.sleep(0.2)   # in the lease's wait for the lock
            server.kill()
            fcntl.flock(lock, fcntl.LOCK_UN)
            res = started.result()
    finally:
        os.close(lock)
        server.stop()
    line = refusal(res)
    assert "nvcontainer serve" in line, line
    assert [x for x in store.load(str(w["leases"])) if liveness.alive(x)] == []
    got = runtime.run_container(four, bundle(tmp_path, four, w, "free:4", served=False, script=NODES_ONLY))
    assert got.returncode == 0, got.stderr
    assert runtime.parse_facts(got.stdout)["NODES"] == ["nvidia0 nvidia1 nvidia2 nvidia3"]
