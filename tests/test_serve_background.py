"""The spare's warm-up runs under ``SCHED_IDLE`` and never keeps a client waiting
(``nvcontainer/serve/background.py``).

A real server in the test's own namespaces (``tests/test_serve.py``'s ``server`` fixture); a
first served hook run (a container that asks for no GPU, traced so that the client does not
answer it itself) reports the pages it wrote, which the next spares then warm: the work they
do at idle priority. CPU hogs keep a lowered spare in its warm-up long enough to be
seen and stopped there.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.test_dry_run import bundle, pid, write_config  # noqa: F401 (fixtures)
from tests.test_serve import client, server, state  # noqa: F401 (fixtures)

DECLINED = b"NVC1 1 18 1 0\nprestart\0"   # a PID that is not the sender's: declined, answered

if not hasattr(os, "SCHED_IDLE"):
    pytest.skip("no SCHED_IDLE here", allow_module_level=True)


def _spare(server_pid: int) -> int | None:
    """The server's spare child, read from /proc (no pgrep: under the CPU hogs an exec per look
    took longer than a spare's whole warm-up at idle priority, which then went unseen)."""
    try:
        with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
            children = f.read().split()
    except OSError:
        return None
    for child in children:
        try:
            with open(f"/proc/{child}/comm") as f:
                if f.read().strip() == "nvc-spare":
                    return int(child)
        except OSError:
            continue
    return None


def _wait(what, timeout: float = 20.0, step: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(step)
    return None


def _policy(pid: int) -> int | None:
    try:
        return os.sched_getscheduler(pid)
    except ProcessLookupError:
        return None


def _served_run(sock, tmp_path, bundle, pid) -> None:  # noqa: F811
    write_config(bundle, [])
    res = subprocess.run(client(str(sock), "--debug", str(tmp_path / "hook.log"), "prestart"),
                         input=state(pid, bundle), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "served by nvcontainer serve" in (tmp_path / "hook.log").read_text()


def _spare_that_warmed(server_pid: int, log) -> int:
    """The spare forked after the first request reported its pages, once it has warmed them."""
    text = _wait(lambda: "spare" in (t := log.read_text()) and ": warmed" in t and t)
    assert text, "no spare warmed the learned pages"
    spare = _wait(lambda: _spare(server_pid))
    assert spare
    return spare


def test_a_spare_waits_for_its_client_at_the_normal_policy(server, tmp_path, bundle, pid):  # noqa: F811
    """Lowered for its warm-up, the spare lifts itself before it waits: the accept and the
    request it then runs are never at idle priority."""
    proc, sock = server
    _served_run(sock, tmp_path, bundle, pid)
    spare = _spare_that_warmed(proc.pid, tmp_path / "serve.log")
    time.sleep(0.2)
    assert _policy(spare) == os.SCHED_OTHER


def test_a_client_lifts_a_spare_caught_in_its_warm_up(server, tmp_path, bundle, pid):  # noqa: F811
    """A spare still warming up under SCHED_IDLE (kept there by CPU hogs, then stopped so that it
    cannot notice anything itself) is lifted by the server as soon as a client connects, and
    the request is served."""
    proc, sock = server
    # the hogs first: started after the run, they could come only once the spare forked after it
    # had already warmed up at idle priority (an idle machine gives it a CPU at once), and no
    # other spare is forked before the next request
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4 * (os.cpu_count() or 1))]
    stopped = None
    try:
        _served_run(sock, tmp_path, bundle, pid)   # its report: what the next spares warm
        # the spares after the report: each is lowered once it forked its worker, and starves;
        # looked for at a high priority, so that the hogs do not keep this process from looking
        # while the spare is low
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, -15)
        try:
            low = _wait(lambda: (s := _spare(proc.pid)) and _policy(s) == os.SCHED_IDLE and s, timeout=30, step=0.002)
        finally:
            os.setpriority(os.PRIO_PROCESS, 0, before)
        assert low, "no spare was ever seen under SCHED_IDLE"
        os.kill(low, signal.SIGSTOP)
        stopped = low
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
    try:
        if "warmed" in (tmp_path / "serve.log").read_text().split(f"spare {stopped}:", 1)[-1][:40]:
            pytest.skip("the spare finished its warm-up before it was stopped")  # never seen, but not a failure
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(str(sock))   # pending: only the (stopped) spare accepts
            assert _wait(lambda: _policy(stopped) == os.SCHED_OTHER, timeout=5), "the server did not lift the spare"
            os.kill(stopped, signal.SIGCONT)
            stopped = None
            s.sendall(DECLINED)
            s.settimeout(30)
            assert s.recv(4096).startswith(b"declined")   # served (declined: no fds) by that spare
    finally:
        if stopped:
            os.kill(stopped, signal.SIGCONT)
    assert proc.poll() is None
    _served_run(sock, tmp_path, bundle, pid)   # and the next, from the spare after it
