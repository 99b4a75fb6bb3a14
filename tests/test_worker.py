"""The forked worker: answers and errors come back intact, deadlines kill the whole process
group, and the child holds nothing of the parent's but what it was given."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nvcontainer.apply import worker
from nvcontainer.errors import NvcError


def gone(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` no longer runs (absent, or a zombie nobody has reaped yet)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


def wait_for_file(path, timeout: float = 5.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path) and (text := open(path).read()).endswith("\n"):
            return text
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def add_and_report(a, b):
    return {"sum": a + b, "pid": os.getpid(), "pgid": os.getpgid(0)}


def test_result_comes_back_from_another_process():
    reply = worker.run(add_and_report, 2, 40, deadline=5, name="add")
    assert reply["sum"] == 42
    assert reply["pid"] != os.getpid()
    assert reply["pgid"] == reply["pid"]  # leads its own process group


def raise_nvc():
    raise NvcError("mount", "target /x: refusing to mount over a symlink")


def test_nvc_error_keeps_its_category_and_detail():
    with pytest.raises(NvcError) as info:
        worker.run(raise_nvc, deadline=5, name="mounter")
    assert info.value.category == "mount"
    assert info.value.detail == "target /x: refusing to mount over a symlink"


def raise_value_error():
    raise ValueError("bad\nvalue\x1b[2J")


def test_unexpected_exception_is_one_escaped_line_in_the_callers_category():
    with pytest.raises(NvcError) as info:
        worker.run(raise_value_error, deadline=5, name="mounter", category="mount")
    assert info.value.category == "mount"
    assert info.value.detail == "mounter: ValueError: bad\\nvalue\\x1b[2J"


def test_result_must_be_json_data():
    with pytest.raises(NvcError, match="odd: worker result is not JSON data"):
        worker.run(object, deadline=5, name="odd")


def big_reply(n):
    return "x" * n


def test_reply_size_is_bounded():
    assert worker.run(big_reply, 500, deadline=5, name="big", max_reply=1000) == "x" * 500
    with pytest.raises(NvcError, match="big: reply larger than 1000 bytes"):
        worker.run(big_reply, 5000, deadline=5, name="big", max_reply=1000)


def hang_with_grandchild(path):
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    with open(path, "w") as fh:
        fh.write(f"{pid}\n")
    time.sleep(60)


def test_deadline_kills_the_child_and_its_grandchildren(tmp_path):
    pidfile = tmp_path / "grandchild"
    start = time.monotonic()
    with pytest.raises(NvcError) as info:
        worker.run(hang_with_grandchild, str(pidfile), deadline=1.0, name="hang")
    assert time.monotonic() - start < 4
    assert info.value.category == "timeout"
    assert info.value.detail == "hang: timed out after 1s"
    grandchild = int(wait_for_file(pidfile))
    assert gone(grandchild)


def crash():
    os.kill(os.getpid(), signal.SIGSEGV)


def test_death_by_signal_names_the_worker_and_the_signal():
    with pytest.raises(NvcError, match=r"^internal error: crasher: worker killed by signal SIGSEGV$"):
        worker.run(crash, deadline=5, name="crasher")


def test_exit_without_a_reply():
    with pytest.raises(NvcError, match="quitter: worker exited with status 7 without a reply"):
        worker.run(os._exit, 7, deadline=5, name="quitter")


def fd_state(fd):
    try:
        os.fstat(fd)
    except OSError:
        return "closed"
    return "open"


def read_fd(fd):
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 100).decode()


def stdio_targets():
    return [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)]


def test_parent_fds_do_not_reach_the_child(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    fd = os.open(secret, os.O_RDONLY)
    os.set_inheritable(fd, True)  # even an inheritable fd must not get through
    try:
        assert worker.run(fd_state, fd, deadline=5, name="leak") == "closed"
        assert worker.run(read_fd, fd, deadline=5, name="keep", keep_fds=[fd]) == "host secret"
    finally:
        os.close(fd)


def test_child_stdio_is_dev_null():
    assert worker.run(stdio_targets, deadline=5, name="stdio") == ["/dev/null"] * 3


def test_refuses_to_fork_from_a_threaded_process():
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        with pytest.raises(NvcError, match="multi-threaded"):
            worker.run(add_and_report, 1, 2, deadline=5, name="threads")
    finally:
        release.set()
        thread.join()


ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from nvcontainer.apply import worker

    def sleeper(path):
        with open(path, "w") as fh:
            fh.write(f"{os.getpid()}\\n")
        time.sleep(60)

    worker.run(sleeper, sys.argv[1], deadline=60, name="orphan")
    """
)


def test_worker_dies_with_its_parent(tmp_path):
    """runc kills only the hook PID on a timeout; the worker must not outlive it."""
    pidfile = tmp_path / "worker"
    hook = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(pidfile)])
    try:
        child = int(wait_for_file(pidfile, timeout=20))
        assert not gone(child, timeout=0.2)
    finally:
        hook.kill()
        hook.wait()
    assert gone(child)
