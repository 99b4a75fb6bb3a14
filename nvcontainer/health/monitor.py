"""Runs the health watcher (``watcher.py``) and turns its lines into health changes.

Why this shape: the watcher is the only process that loads NVML, and it may hang inside the
driver, crash or print nonsense. The plugin must never wait on it: it reads the watcher's lines
with a deadline (a beat every ``heartbeat-seconds``; ``heartbeat-timeout-seconds`` without one
means the driver stopped answering), and whatever goes wrong, the watcher is killed (its whole
process group), every device is marked unhealthy, and it is started again after a pause that
doubles up to a limit. What the watcher reported before stays in :class:`health.Health`, so a
restart loses nothing. One line goes to the log per change of state, not per attempt.

The watcher is started with ``subprocess`` (fork and exec at once, safe in this threaded
process), ``python -I``, a fixed environment and no inherited descriptors.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

from .. import log
from ..documents import json_value
from ..errors import NvcError, escape
from . import rules
from .topology import from_report

MAX_LINE = 1 << 20
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0
CLOSE_WAITS = (1.0, 1.0, 6.0)      # seconds after each cancel; the last covers _kill's 5 s
WATCHER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


NVML_PREFIX = "libnvidia-ml.so"
NO_EVENTS = "no-events:"      # _run_once's answer for a driver without NVML's event API


def watcher_argv() -> list[str]:
    return [sys.executable, "-I", "-m", "nvcontainer.health.watcher"]


class Monitor:
    """``publish(bad)`` is called with {unit UUID: why} whenever that changes; ``on_topology``
    with a :class:`topology.Topology` when the watcher reports one."""

    def __init__(self, inv, library: str, settings, user, publish, on_topology, say, *,
                 numa: dict | None = None, argv=None, start_timeout: float = 30.0, clock=time.monotonic,
                 on_unmonitored=None):
        self.on_unmonitored = on_unmonitored or (lambda why: None)
        self.inv = inv
        self.library = library
        self.settings = settings
        self.user = user
        self.publish = publish
        self.on_topology = on_topology
        self.say = say
        self.argv = argv or watcher_argv()
        self.start_timeout = max(start_timeout, settings.heartbeat_timeout_seconds)
        self.clock = clock
        self.policy = rules.Policy(frozenset(settings.ignore_xids), settings.xid_recovery_seconds)
        self.health = rules.Health()
        self.numa = dict(numa or {})
        self._said = None
        self.starts = 0
        self._closing = False

    def _state(self, line: str) -> None:
        """Say ``line`` once, however often the same state is reached again."""
        if line != self._said:
            self._said = line
            self.say(line)

    def _update(self, health: rules.Health) -> None:
        self.health = health
        self.publish(rules.bad_units(health, self.inv))

    async def close(self, task: asyncio.Task) -> None:
        """End ``task`` (the one running :meth:`run`), and with it the watcher.

        Why not only ``task.cancel()``: on Python 3.11, ``asyncio.wait_for`` returns the awaited
        result and drops the cancellation when both land in one turn of the loop (CPython
        gh-86296), here a watcher's line arriving as SIGTERM does; the task then read on, and
        the plugin never exited. So the monitor also stops by itself after its next line, the
        cancel is repeated, and the wait is bounded: a shutdown never hangs on the watcher."""
        self._closing = True
        for limit in CLOSE_WAITS:
            if task.done():
                break
            task.cancel()
            await asyncio.wait({task}, timeout=limit)
        if not task.done():
            log.warning("health watcher: its task did not end; leaving it")
        elif not task.cancelled() and task.exception() is not None:
            log.warning(f"health watcher: ended with {escape(task.exception(), 200)}")

    async def run(self) -> None:
        backoff = BACKOFF_FIRST
        while not self._closing:
            started = self.clock()
            why = await self._run_once()
            if self._closing:
                return
            if why.startswith(NO_EVENTS):
                # NVIDIA's plugins: a driver without the event API keeps every device, unwatched
                self._update(rules.Health())
                self._state(f"health checks off: the driver's NVML has no event API ({why[len(NO_EVENTS):]}); "
                            "every device stays available, unmonitored")
                self.on_unmonitored(why[len(NO_EVENTS):])
                return
            if self.clock() - started > 10 * BACKOFF_MAX:
                backoff = BACKOFF_FIRST
            self._update(rules.on_down(self.health, why))
            self._state(f"health watcher: {why}; every device unhealthy until it answers (retrying, at most "
                        f"every {BACKOFF_MAX:g} s)")
            log.info(f"health watcher: next start in {backoff:g} s")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _run_once(self) -> str:
        """Run one watcher until it ends or stops beating; why it did."""
        self.starts += 1
        request = {"library": self.library, "gpus": [g.uuid for g in self.inv.gpus], "user": self.user,
                   "interval": self.settings.heartbeat_seconds}
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL, env=WATCHER_ENV, close_fds=True, start_new_session=True,
                limit=MAX_LINE)
        except OSError as exc:
            return f"cannot start: {escape(exc.strerror or exc)}"
        try:
            proc.stdin.write(json.dumps(request).encode())
            await proc.stdin.drain()
            proc.stdin.close()
            return await self._read(proc)
        except (BrokenPipeError, ConnectionResetError):
            return "exited before it was given its request"
        finally:
            await _kill(proc)

    async def _read(self, proc) -> str:
        timeout = self.start_timeout
        error = ""
        while True:
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            except asyncio.TimeoutError:
                return f"no heartbeat in {timeout:g} s (the driver does not answer)"
            except ValueError:
                return "a line longer than the limit"
            if not line:
                return error or "exited"
            if self._closing:
                return "closing"
            try:
                msg = json_value(line, "line", cap=MAX_LINE)
            except NvcError:
                return "a line that is not JSON"
            if not isinstance(msg, dict):
                return "a line that is not a JSON object"
            kind = msg.get("ev")
            if kind == "error":
                error = f"NVML failed: {escape(msg.get('why'), 200)}"
            elif kind == "no-events":
                return NO_EVENTS + escape(msg.get("why"), 200)
            elif kind == "ready":
                timeout = self.settings.heartbeat_timeout_seconds
                unwatched = msg.get("unwatched")
                detail = f" ({len(unwatched)} GPU(s) without events)" if isinstance(unwatched, dict) and unwatched else ""
                self._state(f"health watcher: watching {len(self.inv.gpus)} GPU(s){detail}")
                if isinstance(unwatched, dict):
                    for uuid, why in list(unwatched.items())[:64]:
                        log.warning(f"health watcher: no events for {escape(uuid, 80)}: {escape(why, 120)}")
            elif kind == "topology":
                self.on_topology(from_report(msg, self.inv, self.numa))
            elif kind == "beat":
                lost = msg.get("lost")
                lost = [u for u in lost if isinstance(u, str)] if isinstance(lost, list) else []
                self._update(rules.on_beat(self.health, lost, self.clock(), self.policy))
            elif kind == "event":
                self._event(msg)

    def _event(self, msg: dict) -> None:
        values = [msg.get(k) for k in ("type", "data", "gi", "ci")]
        gpu = msg.get("gpu")
        if not isinstance(gpu, str) or not all(type(v) is int for v in values):
            return
        event_type, xid, gi, ci = values
        log.info(f"NVML event on {escape(gpu, 80)}: type {event_type:#x} data {xid} gi {gi} ci {ci}")
        self._update(rules.on_event(self.health, gpu, event_type, xid, gi, ci, self.clock(), self.policy))


async def _kill(proc) -> None:
    """The watcher and anything it started: its own process group."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        await asyncio.wait_for(proc.wait(), 5)
    except asyncio.TimeoutError:
        log.warning(f"health watcher {proc.pid} did not die")


def nvml_library(inv) -> str | None:
    """The host path of the NVML library the inventory chose (the running driver's version)."""
    for lib in inv.libraries:
        if lib.name == NVML_PREFIX:
            return os.path.join(inv.root, lib.path.lstrip("/"))
    return None
