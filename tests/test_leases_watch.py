"""The server's lease watch sleeps: an inotify watch of the lease file's directory wakes it when
the file changes and nothing else does, so a served node that never leases never wakes the
server for leases; where inotify cannot be had, it looks at the file every ``RESCAN`` seconds as
before. Both ways, a lease the in-process hook took is watched and freed within a second of its
container's exit.

The first cases drive ``serve/leasewatch.py`` and ``fs/dirwatch.py`` against the real kernel
(a ``sleep`` as the lease holder); the last run ``nvcontainer serve`` and real runc containers on
the fake machine (``tests/test_leases_e2e.py``'s world), one of them with inotify taken away by
the kernel itself: a user namespace whose ``max_inotify_instances`` is 0.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from nvcontainer.fs.dirwatch import DirWatch, parse, verdict, IN_MOVED_TO, IN_Q_OVERFLOW
from nvcontainer.fs.private import open_private_dir
from nvcontainer.leases import liveness, store
from nvcontainer.leases.model import PENDING_S, Lease
from nvcontainer.serve.leasewatch import RESCAN, LeaseWatch
from tests.fixtures import runtime
from tests.test_leases_e2e import Server, bundle, four, leases, settle, world  # noqa: F401 (fixture)

NO_INOTIFY = ["unshare", "--user", "--map-root-user", "--", "sh", "-c",
              'echo 0 > /proc/sys/user/max_inotify_instances && exec "$@"', "no-inotify"]


@pytest.fixture
def holder():
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def take(path: Path, proc) -> None:
    lease = Lease(gpus=("GPU-0",), indexes=(0,), container="c0", pid=proc.pid,
                  start=liveness.start_time(proc.pid), since=time.time())
    store.update(str(path), lambda old: ((*old, lease), None))


def turn(watch: LeaseWatch, most: float = 2.0) -> list[int]:
    """One turn of the server's loop over the lease watch alone: poll its fds for as long as its
    timeout says (at most ``most`` seconds), hand it what fired, refresh. The fds that fired."""
    timeout = watch.timeout()
    poller = select.poll()
    for fd in watch.fds():
        poller.register(fd, select.POLLIN)
    fired = [fd for fd, _ in poller.poll(int(1000 * (most if timeout is None else min(timeout, most))))]
    for fd in fired:
        assert watch.fired(fd)
    watch.refresh()
    return fired


def test_the_directory_watch_says_which_events_concern_the_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    dfd = open_private_dir(str(run), "leases", create=False)
    try:
        watch = DirWatch(dfd, "leases.json")
    finally:
        os.close(dfd)
    try:
        assert watch.drain() == (False, False)
        (run / "leases.lock").write_text("")               # its neighbours: not the file
        (run / ".leases.json.1.tmp").write_text("{}")
        assert watch.drain() == (False, False)
        os.rename(run / ".leases.json.1.tmp", run / "leases.json")   # the writers' atomic replace
        assert watch.drain() == (True, False)
        os.rename(run / "leases.json", run / "leases.json.bad")      # set aside by a reader
        assert watch.drain() == (True, False)
        shutil.rmtree(run)
        assert watch.drain() == (True, True)               # the directory is gone: the watch too
    finally:
        watch.close()


def test_events_are_parsed_whole_and_a_lost_queue_counts_as_a_change():
    event = (3).to_bytes(4, "little", signed=True) + IN_MOVED_TO.to_bytes(4, "little") + bytes(4) \
        + (16).to_bytes(4, "little") + b"leases.json".ljust(16, b"\0")
    assert parse(event + event[:20]) == [(3, IN_MOVED_TO, b"leases.json")]   # a torn tail is left
    assert verdict(parse(event), 3, b"leases.json") == (True, False)
    assert verdict(parse(event), 4, b"leases.json") == (False, False)      # another watch's
    overflow = (-1).to_bytes(4, "little", signed=True) + IN_Q_OVERFLOW.to_bytes(4, "little") + bytes(8)
    assert verdict(parse(overflow), 3, b"leases.json") == (True, False)


def test_a_lease_written_wakes_the_watch_at_once_and_nothing_else_does(tmp_path, holder):
    path = tmp_path / "run" / "leases.json"
    watch = LeaseWatch(str(path))
    watch.start()
    try:
        assert watch.timeout() is None and len(watch.fds()) == 1   # no periodic wake: the event fd only
        quiet = time.monotonic()
        assert turn(watch, 0.3) == [] and time.monotonic() - quiet >= 0.29
        take(path, holder)
        start = time.monotonic()
        fired = turn(watch)
        assert fired == watch.fds()[-1:] and time.monotonic() - start < 0.1, fired   # the event, not a rescan
        assert list(watch.watched.values()) == [(holder.pid, liveness.start_time(holder.pid))]
        assert watch.timeout() is None                               # a live lease: still no periodic wake
        holder.kill()
        holder.wait()
        while watch.watched:
            assert turn(watch)                                       # the pidfd fires: released
        assert leases({"leases": path}) == []
    finally:
        watch.close()


def test_a_damaged_file_is_watched_asleep_until_it_is_moved_aside(tmp_path, holder):
    """Fail closed: a lease file the server cannot read is left where it is; the watch neither
    gives up nor polls it, and watches the leases again once an operator has moved it aside."""
    path = tmp_path / "run" / "leases.json"
    path.parent.mkdir(mode=0o700)
    path.write_text('{"version": 1, "leases": [{"gpus"')
    watch = LeaseWatch(str(path))
    watch.start()
    try:
        assert watch.enabled and watch.timeout() is None and len(watch.fds()) == 1
        assert turn(watch, 0.3) == [] and path.read_text().startswith('{"version": 1')
        os.rename(path, str(path) + ".moved")
        assert turn(watch)                                           # the move is an event
        take(path, holder)
        assert turn(watch) and list(watch.watched.values()) == [(holder.pid, liveness.start_time(holder.pid))]
    finally:
        watch.close()


def test_a_pending_lease_wakes_the_watch_when_it_expires(tmp_path):
    """The shim's pending lease (no init yet) is the one thing the watch waits for with a timer:
    it is released when :data:`PENDING_S` have passed, not at the next event."""
    path = tmp_path / "run" / "leases.json"
    watch = LeaseWatch(str(path))
    watch.start()
    try:
        lease = Lease(gpus=("GPU-0",), indexes=(0,), container="c0", pid=0, start=0,
                      since=time.time() - PENDING_S + 0.3)
        store.update(str(path), lambda old: ((lease,), None))
        assert turn(watch)
        assert 0 < watch.timeout() <= 0.3
        start = time.monotonic()
        while leases({"leases": path}):
            assert turn(watch) == [] and time.monotonic() - start < 0.6   # the timer, not an event
        assert watch.timeout() is None
    finally:
        watch.close()


def test_without_its_directory_the_watch_rescans_and_arms_again(tmp_path, holder):
    path = tmp_path / "run" / "leases.json"
    watch = LeaseWatch(str(path))
    watch.start()
    try:
        shutil.rmtree(path.parent)
        assert turn(watch)                                  # the directory's end is an event too
        assert watch.fds() == [] and watch.timeout() == RESCAN
        take(path, holder)                                  # the store makes the directory again
        start = time.monotonic()
        while not watch.watched:
            assert time.monotonic() - start < 3 * RESCAN
            turn(watch)
        assert len(watch.fds()) == 2 and watch.timeout() is None   # watched again, with inotify
    finally:
        watch.close()


def switches(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))


def wakes_in(pid: int, seconds: float) -> int:
    """How often the idle server woke in ``seconds``."""
    time.sleep(1.0)   # its spare forked, its start done
    before = switches(pid)
    time.sleep(seconds)
    return switches(pid) - before


def watched_and_freed(four, tmp_path, w, server) -> None:
    """An in-process hook's lease, held by a container until its gate opens: the server watches
    its init, and frees it within a second of its exit."""
    holding = []
    runner = threading.Thread(target=lambda: holding.append(runtime.run_container(
        four, bundle(tmp_path, four, w, "free:1", served=False))))
    runner.start()
    try:
        settle(w, 1, 60)
        pid = leases(w)[0]["pid"]
        trace = w["sock"].parent / "serve.log"
        end = time.monotonic() + 5
        while f"leases: watching init {pid} " not in trace.read_text():
            assert time.monotonic() < end, trace.read_text()
            time.sleep(0.02)
    finally:
        (w["gate"] / "go").write_text("")
        runner.join(240)
    assert holding and holding[0].returncode == 0, holding and holding[0].stderr
    assert settle(w, 0, 1.0) < 1.0
    assert server.proc.poll() is None


def test_the_idle_server_sleeps_and_still_frees_an_in_process_lease(four, tmp_path, native_client):
    w = world(tmp_path, client=native_client)
    server = Server(four, w).start()
    try:
        assert wakes_in(server.proc.pid, 2.0) <= 1     # it used to wake every RESCAN (4 times)
        watched_and_freed(four, tmp_path, w, server)
        assert wakes_in(server.proc.pid, 2.0) <= 1     # and sleeps again once the lease is gone
    finally:
        server.stop()
    assert "watched with inotify" in (w["sock"].parent / "serve.log").read_text()


def test_without_inotify_the_server_rescans_and_still_frees_an_in_process_lease(four, tmp_path, native_client):
    w = world(tmp_path, client=native_client)
    server = Server(four, w, wrap=NO_INOTIFY).start()
    try:
        assert wakes_in(server.proc.pid, 2.0) >= 3     # the periodic look, every RESCAN
        watched_and_freed(four, tmp_path, w, server)
    finally:
        server.stop()
    assert "no inotify watch (inotify_init1: Too many open files)" in (w["sock"].parent / "serve.log").read_text()
