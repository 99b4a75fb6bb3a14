"""The spare's warm-up runs only on a CPU nobody else wants (``SCHED_IDLE``), and is lifted back
to the normal policy the moment a client comes.

Why: the server forks a spare once it has been idle for ``SPARE_DELAY``, and the spare then
spends 7 to 15 ms of CPU making its pages its own (:mod:`..apply.prewarm`). That is work for the
*next* request, but it used to run at the same priority as the container the last request was
for: under Docker a GPU container asks twice (the runtime shim's spec edit, then the hook about
150 ms later on a 2-vCPU machine), so the spare forked after the edit warmed up while runc was
still creating that very container and delayed its hook by about as much
(``benchmarks/dockertrace.py``: runc's time from its exec to the hook, served against NVIDIA's
arm, docs/performance.md). Under ``SCHED_IDLE`` the warm-up yields to any runnable task and
still completes on an idle node, where it was always meant to happen.

A task under ``SCHED_IDLE`` on a busy machine may wait a long time for a CPU, so it must never
be the one a client waits on:

* the spare lowers itself only after it forked its standby worker (which stays normal), and
  only where it may raise itself again (``CAP_SYS_NICE``; a server without it skips all this);
* it raises itself before it waits for a connection, so the accept and the request run at the
  normal policy;
* while it is low, the server (normal policy) also watches the listening socket, and raises it
  (:func:`lift`) as soon as a connection is pending; the spare looks for a waiting client right
  after lowering itself, so a connection that came before cannot be missed either.
"""

from __future__ import annotations

import os

_NORMAL = os.sched_param(0)
_may: bool | None = None   # may_lower()'s answer, once asked


def may_lower() -> bool:
    """Whether this process may go to ``SCHED_IDLE`` and come back (``CAP_SYS_NICE``; asked once:
    the server's capabilities do not change, and its children inherit them)."""
    global _may
    if _may is None:
        try:
            import prctl
            _may = bool(prctl.cap_effective.sys_nice)
        except (ImportError, OSError, AttributeError):
            _may = False
    return _may


def lower() -> bool:
    """This process to ``SCHED_IDLE``; False (and nothing changed) where it cannot be."""
    if not may_lower():
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, _NORMAL)
    except OSError:
        return False
    return True


def lift(pid: int = 0) -> None:
    """``pid`` (this process by default) back to the normal policy; a process that is gone, or
    already normal, is fine."""
    try:
        if os.sched_getscheduler(pid) != os.SCHED_OTHER:
            os.sched_setscheduler(pid, os.SCHED_OTHER, _NORMAL)
    except (ProcessLookupError, PermissionError):
        pass
