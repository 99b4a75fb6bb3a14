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

from nvcontainer.apply import standby, worker
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
    """Its grandchild writes its own PID as the test sees it (the worker may be in a PID
    namespace of its own, a standby always is: /proc/self of the test's procfs tells)."""
    if os.fork() == 0:
        with open("/proc/self/status") as fh:
            host = next(line.split()[1] for line in fh if line.startswith("NSpid:"))
        with open(path, "w") as fh:
            fh.write(f"{host}\n")
        time.sleep(60)
        os._exit(0)
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


# --- start / wait / kill, and stages ----------------------------------------------------------


def wait_for_go(path):
    end = time.monotonic() + 5
    while not os.path.exists(path):
        if time.monotonic() > end:
            return "no go"
        time.sleep(0.005)
    return "went"


def test_start_returns_while_the_child_works(tmp_path):
    """The caller's own work happens between start and wait: here it is what the child waits for."""
    go = tmp_path / "go"
    running = worker.start(wait_for_go, str(go), deadline=10, name="waiter")
    go.write_text("")
    assert running.wait() == "went"


def test_the_deadline_counts_from_start():
    running = worker.start(time.sleep, 60, deadline=0.5, name="sleeper")
    time.sleep(1)
    start = time.monotonic()
    with pytest.raises(NvcError, match=r"^timeout error: sleeper: timed out after 0.5s$"):
        running.wait()
    assert time.monotonic() - start < 2.5


def test_kill_ends_the_child_and_its_grandchildren_and_reaps(tmp_path):
    pidfile = tmp_path / "grandchild"
    running = worker.start(hang_with_grandchild, str(pidfile), deadline=60, name="hang")
    grandchild = int(wait_for_file(pidfile))
    running.kill()
    with pytest.raises(ChildProcessError):   # reaped, not left a zombie
        os.waitpid(running.pid, os.WNOHANG)
    assert gone(grandchild)
    running.kill()   # again: nothing left to do
    with pytest.raises(NvcError, match="already collected"):
        running.wait()


def two_steps(path, fail):
    worker.stage("second step", "ldcache", {"first": "done"})
    if fail == "signal":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fail == "hang":
        time.sleep(60)
    if fail == "raise":
        raise ValueError("broken")
    return wait_for_go(path)


def test_a_stage_note_reaches_the_parent_while_the_child_still_works(tmp_path):
    go = tmp_path / "go"
    notes = []

    def on_stage(note):
        notes.append(note)
        go.write_text("")

    assert worker.start(two_steps, str(go), "", deadline=10, name="first step").wait(on_stage) == "went"
    assert notes == [{"first": "done"}]


@pytest.mark.parametrize("fail, expect", [
    ("raise", "^ldcache error: second step: ValueError: broken$"),
    ("signal", "^ldcache error: second step: worker killed by signal SIGSEGV$"),
    ("hang", r"^timeout error: second step: timed out after 1s$"),
])
def test_failures_after_a_stage_are_named_after_it(tmp_path, fail, expect):
    with pytest.raises(NvcError, match=expect):
        worker.start(two_steps, str(tmp_path), fail, deadline=1, name="first step", category="mount").wait()


def test_a_stage_already_sent_names_a_timeout_noticed_late(tmp_path):
    """The caller was busy past the deadline: the stage frame waiting in the pipe is read first."""
    running = worker.start(two_steps, str(tmp_path), "hang", deadline=0.5, name="first step", category="mount")
    time.sleep(1)
    with pytest.raises(NvcError, match=r"^timeout error: second step: timed out after 0.5s$"):
        running.wait()


def big_stage(n):
    worker.stage("next", "mount", "x" * n)
    return "ok"


def test_stage_notes_count_against_the_reply_limit():
    assert worker.run(big_stage, 500, deadline=5, name="big", max_reply=1000) == "ok"
    with pytest.raises(NvcError, match="^internal error: big: reply larger than 1000 bytes$"):
        worker.run(big_stage, 5000, deadline=5, name="big", max_reply=1000)


def test_stage_outside_a_worker_is_refused():
    with pytest.raises(RuntimeError):
        worker.stage("x", "mount")


def test_next_stage_returns_while_the_child_goes_on(tmp_path):
    go = tmp_path / "go"
    running = worker.start(two_steps, str(go), "", deadline=10, name="first step", category="mount")
    assert running.next_stage() == {"first": "done"}
    assert (running.name, running.category) == ("second step", "ldcache")
    go.write_text("")   # what the child's second step waits for: the caller's own work
    assert running.wait() == "went"


def fail_first():
    raise NvcError("mount", "mount /x: not a directory")


def test_next_stage_raises_the_first_steps_error():
    running = worker.start(fail_first, deadline=5, name="first step", category="mount")
    with pytest.raises(NvcError, match="^mount error: mount /x: not a directory$"):
        running.next_stage()
    with pytest.raises(ChildProcessError):
        os.waitpid(running.pid, os.WNOHANG)


def test_next_stage_of_a_child_that_ends_without_one():
    running = worker.start(add_and_report, 1, 2, deadline=5, name="one step", category="mount")
    with pytest.raises(NvcError, match="^mount error: one step: worker ended before its next step$"):
        running.next_stage()


def test_next_stage_times_out_under_the_first_name():
    running = worker.start(time.sleep, 60, deadline=0.5, name="first step", category="mount")
    with pytest.raises(NvcError, match=r"^timeout error: first step: timed out after 0.5s$"):
        running.next_stage()
    with pytest.raises(ChildProcessError):
        os.waitpid(running.pid, os.WNOHANG)


# The standby: a worker forked ahead of its job (nvcontainer serve's spare child forks one).

@pytest.fixture
def no_standby_left():
    yield
    standby.discard_standby()


def job_facts(fd, other):
    umask = os.umask(0)
    os.umask(umask)
    try:   # the number may be taken by the worker's own reply pipe, never by the parent's file
        other_target = os.readlink(f"/proc/self/fd/{other}")
    except OSError:
        other_target = "closed"
    return {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "read": read_fd(fd),
            "other": other_target, "cwd": os.getcwd(), "umask": umask, "env": os.environ.get("NVC_STANDBY_TEST"),
            "stdio": stdio_targets(), **isolation_facts()}


def isolation_facts() -> dict:
    """The process's PID as its parent sees it, and its namespaces."""
    with open("/proc/self/status") as fh:
        nspid = next(line.split()[1:] for line in fh if line.startswith("NSpid:"))
    return {"host_pid": int(nspid[0]), "namespaces": namespaces("self")}


def namespaces(pid) -> dict:
    return {kind: os.readlink(f"/proc/{pid}/ns/{kind}") for kind in ("pid", "net", "ipc", "uts", "mnt")}


def assert_isolated(facts: dict) -> None:
    """Init of a PID namespace of its own, in network, IPC and UTS namespaces of its own (the
    ldconfig sandbox's, taken at birth), and still in its parent's mount namespace."""
    ours = namespaces("self")
    assert (facts["pid"], facts["ppid"], facts["pgid"]) == (1, 0, 1)
    for kind in ("pid", "net", "ipc", "uts"):
        assert facts["namespaces"][kind] != ours[kind], kind
    assert facts["namespaces"]["mnt"] == ours["mnt"]


def test_a_standby_takes_the_next_job_as_a_fork_would_have(tmp_path, monkeypatch, no_standby_left):
    """It was forked before the fds, the directory, the umask and the variable below existed:
    the job brings them, onto the same fd numbers, and nothing else."""
    assert standby.standby()
    standby_pid = worker._standby.pid
    assert not standby.standby()   # one at a time
    (tmp_path / "kept").write_text("kept file")
    kept = os.open(tmp_path / "kept", os.O_RDONLY)
    other = os.open(tmp_path / "kept", os.O_RDONLY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NVC_STANDBY_TEST", "from the parent")
    old_umask = os.umask(0o027)
    try:
        reply = worker.run(job_facts, kept, other, deadline=10, name="standby", keep_fds=[kept])
    finally:
        os.umask(old_umask)
        os.close(kept)
        os.close(other)
    assert reply["host_pid"] == standby_pid
    assert_isolated(reply)   # whatever the job: it cannot know whether the next one needs it
    assert reply["read"] == "kept file" and reply["other"] != str(tmp_path / "kept")
    assert (reply["cwd"], reply["umask"], reply["env"]) == (str(tmp_path), 0o027, "from the parent")
    assert reply["stdio"] == ["/dev/null"] * 3
    assert worker._standby is None and gone(standby_pid)
    # the next one is forked again
    assert worker.run(add_and_report, 1, 2, deadline=5, name="add")["pid"] != standby_pid


def test_an_isolated_worker_is_born_in_namespaces_of_its_own(tmp_path):
    (tmp_path / "kept").write_text("kept file")
    kept = os.open(tmp_path / "kept", os.O_RDONLY)
    try:
        before = namespaces("self")
        reply = worker.run(job_facts, kept, kept, deadline=10, name="isolated", keep_fds=[kept], isolated=True)
        plain = worker.run(job_facts, kept, kept, deadline=10, name="plain", keep_fds=[kept])
    finally:
        os.close(kept)
    assert_isolated(reply)
    assert reply["read"] == "kept file" and reply["host_pid"] != os.getpid()
    assert namespaces("self") == before   # the parent forks into its own PID namespace again
    assert (plain["pid"], plain["ppid"]) == (plain["host_pid"], os.getpid())
    assert plain["namespaces"] == before


@pytest.fixture
def held_namespaces(monkeypatch):
    """Empty network, IPC and UTS namespaces held as ``nvcontainer serve`` holds them, set as
    the ones isolated workers enter; their ``/proc/.../ns`` names, by kind."""
    from nvcontainer.apply import ns

    held = ns.empty_namespaces(worker.ISOLATION)
    monkeypatch.setattr(ns, "SANDBOX_NAMESPACES", held)
    kinds = {ns.CLONE_NEWNET: "net", ns.CLONE_NEWIPC: "ipc", ns.CLONE_NEWUTS: "uts"}
    yield {kinds[kind]: os.readlink(f"/proc/self/fd/{fd}") for fd, kind in held}
    for fd, _ in held:
        os.close(fd)


def test_isolated_workers_enter_the_held_namespaces_instead_of_making_their_own(tmp_path, held_namespaces,
                                                                                 no_standby_left):
    """Under the server every ldconfig sandbox shares one set of empty network, IPC and UTS
    namespaces (docs/security.md); the PID namespace stays each worker's own, and neither
    the held set nor the worker's is the parent's."""
    ours = namespaces("self")
    assert sorted(held_namespaces) == ["ipc", "net", "uts"]
    assert all(held_namespaces[kind] != ours[kind] for kind in held_namespaces)
    (tmp_path / "kept").write_text("kept file")
    kept = os.open(tmp_path / "kept", os.O_RDONLY)
    try:
        forked = [worker.run(job_facts, kept, kept, deadline=10, name="isolated", keep_fds=[kept], isolated=True)
                  for _ in range(2)]
        assert standby.standby()
        handed = worker.run(job_facts, kept, kept, deadline=10, name="standby", keep_fds=[kept])
    finally:
        os.close(kept)
    for reply in (*forked, handed):
        assert (reply["pid"], reply["ppid"], reply["read"]) == (1, 0, "kept file")
        assert {kind: reply["namespaces"][kind] for kind in held_namespaces} == held_namespaces
        assert reply["namespaces"]["pid"] != ours["pid"] and reply["namespaces"]["mnt"] == ours["mnt"]
    assert forked[0]["namespaces"]["pid"] != forked[1]["namespaces"]["pid"]
    assert namespaces("self") == ours


def test_held_namespaces_are_made_without_moving_the_caller():
    from nvcontainer.apply import ns

    before = namespaces("self")
    held = ns.empty_namespaces(ns.CLONE_NEWNET)
    try:
        assert [kind for _, kind in held] == [ns.CLONE_NEWNET]
        assert os.readlink(f"/proc/self/fd/{held[0][0]}").startswith("net:[")
        assert os.readlink(f"/proc/self/fd/{held[0][0]}") != before["net"]
        assert os.get_inheritable(held[0][0]) is False
    finally:
        os.close(held[0][0])
    assert namespaces("self") == before


def test_a_job_the_standby_cannot_take_goes_to_a_forked_worker(no_standby_left):
    assert standby.standby()
    standby_pid = worker._standby.pid
    local = lambda: os.getpid()   # noqa: E731 (not picklable, so it cannot be handed over)
    pid = worker.run(local, deadline=5, name="lambda")
    assert pid not in (standby_pid, os.getpid())
    assert gone(standby_pid)


def test_a_standby_job_keeps_the_deadline_and_the_group_kill(tmp_path, no_standby_left):
    assert standby.standby()
    pidfile = tmp_path / "grandchild"
    with pytest.raises(NvcError, match="^timeout error: hang: timed out after 1s$"):
        worker.run(hang_with_grandchild, str(pidfile), deadline=1.0, name="hang")
    assert gone(int(wait_for_file(pidfile)))


def test_a_standby_dies_with_its_parent(tmp_path):
    out = tmp_path / "standby"
    child = os.fork()
    if child == 0:
        try:
            standby.standby()
            with open(out, "w") as f:
                f.write(f"{worker._standby.pid}\n")
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert gone(int(wait_for_file(out)))


def test_no_standby_from_a_threaded_process(no_standby_left):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not standby.standby() and worker._standby is None
    finally:
        stop.set()
        t.join()
