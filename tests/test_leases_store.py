"""The lease file: round trip, atomic replacement under the lock, every hostile or damaged file
refused with one line and left where it is (fail closed: no lease granted while it cannot be
read), one damaged entry kept beside the others and holding GPUs until its container is known to
have ended, writer and reader sharing one bound; liveness from /proc/PID/stat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from nvcontainer.errors import NvcError
from nvcontainer.leases import liveness, store
from nvcontainer.leases.model import Lease


def lease(container="c1", gpus=(0,), pid=None, start=None):
    pid = os.getpid() if pid is None else pid
    start = liveness.start_time(pid) if start is None else start
    return Lease(gpus=tuple(f"GPU-{i}" for i in gpus), indexes=tuple(gpus), container=container, pid=pid,
                 start=start or 0, bundle="/b", since=1.5, how="free", asked="free:1")


@pytest.fixture
def path(tmp_path):
    d = tmp_path / "run"
    return str(d / store.NAME)


def test_round_trip_and_missing(path):
    assert store.load(path) == ()
    store.update(path, lambda old: ((*old, lease()), None))
    assert store.load(path) == (lease(),)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    assert json.loads(open(path).read())["version"] == store.VERSION


def test_unchanged_is_not_rewritten(path):
    store.update(path, lambda old: ((lease(),), None))
    before = os.stat(path).st_ino
    store.update(path, lambda old: (old, None))
    assert os.stat(path).st_ino == before


@pytest.mark.parametrize("damage, words", [
    (lambda p: open(p, "w").write('{"version": 1, "leases": [{"gpus"'), "truncated"),
    (lambda p: open(p, "w").write('{"leases": []}'), "older version"),
    (lambda p: open(p, "w").write('{"version": 0, "leases": []}'), "older version"),
    (lambda p: os.symlink("/etc/passwd", p), "a symlink"),
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: os.truncate(open(p, "w").name, store.MAX_FILE + 1), "more than"),
])
def test_damaged_file_is_refused_and_left_where_it_is(path, damage, words):
    """Fail closed: a file that cannot be read may name GPUs running containers hold, so no writer
    takes it as empty; each is refused with one line saying what to do."""
    os.makedirs(os.path.dirname(path), mode=0o700)
    damage(path)
    before = os.lstat(path)
    with pytest.raises(store.Closed) as exc:
        store.load(path)
    assert words in exc.value.detail and "\n" not in str(exc.value) and "move it aside" in exc.value.detail
    with pytest.raises(store.Closed) as exc:
        store.update(path, lambda old: ((*old, lease()), None))
    assert words in exc.value.detail
    after = os.lstat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert not any(n.endswith(".bad") for n in os.listdir(os.path.dirname(path)))
    assert open("/etc/passwd").read().startswith("root")   # the symlink's target untouched
    os.rename(path, path + ".moved")                        # what the line says: moved aside, leases resume
    store.update(path, lambda old: ((*old, lease()), None))
    assert store.load(path) == (lease(),)


def test_newer_version_is_left_alone(path):
    os.makedirs(os.path.dirname(path), mode=0o700)
    open(path, "w").write('{"version": 99, "leases": []}')
    with pytest.raises(NvcError, match="newer version"):
        store.update(path, lambda old: ((lease(),), None))
    assert json.load(open(path))["version"] == 99


def test_directory_of_another_user_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    with pytest.raises(NvcError, match="writable by it only"):
        store.update(str(d / store.NAME), lambda old: (old, None))


def test_concurrent_writers_lose_nothing(path):
    """Fifty threads each add a lease under the lock: all fifty are there at the end."""
    def add(n):
        store.update(path, lambda old: ((*old, lease(container=f"c{n}")), None))
    threads = [threading.Thread(target=add, args=(n,)) for n in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(x.container for x in store.load(path)) == sorted(f"c{n}" for n in range(50))


def test_killed_writer_leaves_the_old_file_whole(path):
    """A writer killed between its temporary file and the rename leaves the last complete file."""
    store.update(path, lambda old: ((lease(),), None))
    code = (f"import os, sys\nfrom nvcontainer.leases import store\n"
            f"os.rename = lambda *a, **k: os._exit(9)\n"
            f"store.update({path!r}, lambda old: ((), None))\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert store.load(path) == (lease(),)
    store.update(path, lambda old: ((), None))
    assert store.load(path) == ()


def test_liveness_pid_reuse_and_zombie():
    me = lease()
    assert liveness.alive(me)
    assert not liveness.alive(Lease(**{**me.to_json(), "gpus": me.gpus, "indexes": me.indexes,
                                       "start": me.start + 1}))       # a reused pid
    child = subprocess.Popen(["true"])
    while liveness.stat_of(child.pid)[0] != "Z":
        pass
    zombie = Lease(gpus=("GPU-0",), indexes=(0,), container="z", pid=child.pid,
                   start=liveness.stat_of(child.pid)[1])
    assert not liveness.alive(zombie)                                 # exited, not yet reaped
    assert liveness.start_time(child.pid) is None
    child.wait()
    assert not liveness.alive(zombie) and liveness.stat_of(child.pid) is None
