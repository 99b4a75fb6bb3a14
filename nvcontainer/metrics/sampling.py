"""The exporter's side of the NVML sampler (:mod:`..inventory.sampler`): one round per scrape,
bounded by a deadline, whatever the driver does.

Why this shape: the sampler is the only process that loads NVML, and the driver can hang in it
or it can crash. A round reads the sampler's per-GPU lines until its end line or the deadline;
what came back is used, the rest is stale for this scrape (``nvcontainer_gpu_up`` 0). At the
deadline the sampler is killed (its whole process group) and the GPU it was asking when it
stopped is skipped for ``hang_backoff`` seconds, so the next rounds answer for the other GPUs at
once instead of hanging on the same one; after that it is asked again. A sampler that cannot
start (no driver, NVML's init fails) is tried again after ``retry`` seconds, not at every
scrape. One line goes to the log per change of state, not per round.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

MAX_LINE = 4 << 20
SAMPLER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def sampler_argv() -> list[str]:
    return [sys.executable, "-I", "-m", "nvcontainer.inventory.sampler"]


class Sampler:
    def __init__(self, library: str, user, gpus: list[str], say, *, deadline: float = 5.0,
                 hang_backoff: float = 60.0, retry: float = 10.0, argv=None, clock=time.monotonic):
        self.library, self.user, self.gpus, self.say = library, user, list(gpus), say
        self.deadline, self.hang_backoff, self.retry = deadline, hang_backoff, retry
        self.argv = argv or sampler_argv()
        self.clock = clock
        self.proc: subprocess.Popen | None = None
        self.buf = b""
        self.hung: dict[str, float] = {}      # uuid → until when it is skipped
        self.next_start = 0.0
        self._said = ""

    def _tell(self, text: str) -> None:
        if text != self._said:
            self._said = text
            if text:
                self.say(text)

    # --- the process ----------------------------------------------------------------------

    def _start(self, end: float) -> bool:
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, env=SAMPLER_ENV, close_fds=True,
                                         start_new_session=True, cwd="/")
        except OSError as exc:
            self._give_up(f"metrics: the NVML sampler could not start: {exc.strerror or exc}")
            return False
        self.buf = b""
        user = None if self.user is None else list(self.user)
        if not self._send({"library": self.library, "user": user, "gpus": self.gpus}):
            self._give_up("metrics: the NVML sampler exited at start")
            return False
        line = self._line(end)
        if not isinstance(line, dict) or "ready" not in line:
            why = line.get("error") if isinstance(line, dict) else None
            self._give_up(f"metrics: NVML did not start: {why or 'no answer in time'}")
            return False
        return True

    def _give_up(self, why: str) -> None:
        self._tell(why)
        self.stop()
        self.next_start = self.clock() + self.retry

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                proc.kill()
            except OSError:
                pass
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def _send(self, obj: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except OSError:
            return False

    def _line(self, end: float):
        """The next JSON line, None at EOF or the deadline, or "garbage"."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = end - self.clock()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buf += chunk
            if len(self.buf) > MAX_LINE and b"\n" not in self.buf:
                return "garbage"
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            value = json.loads(line)
        except ValueError:
            return "garbage"
        return value if isinstance(value, dict) else "garbage"

    # --- a round --------------------------------------------------------------------------

    def round(self) -> dict[str, dict]:
        """{GPU UUID: its entry (readings, or {"error": why})} for the GPUs that answered in time."""
        now = self.clock()
        end = now + self.deadline
        if self.proc is None:
            if now < self.next_start or not self._start(end):
                return {}
        self.hung = {u: t for u, t in self.hung.items() if t > now}
        skip = sorted(self.hung)
        if not self._send({"skip": skip}):
            self._give_up("metrics: the NVML sampler exited")
            return {}
        got: dict[str, dict] = {}
        while True:
            line = self._line(end)
            if line is None or line == "garbage":
                break
            if line.get("end"):
                self._tell("metrics: NVML answers for every GPU" if self._said else "")
                return got
            if "error" in line and "gpu" not in line:
                line = "garbage"
                break
            if isinstance(line.get("gpu"), str):
                got[line["gpu"]] = line
        waiting = [u for u in self.gpus if u not in got and u not in skip]
        if line is None and self.proc is not None and self.proc.poll() is None and waiting:
            self.hung[waiting[0]] = self.clock() + self.hang_backoff
            self._tell(f"metrics: GPU {waiting[0]} did not answer NVML in {self.deadline:g} s; "
                       f"its series are stale, asked again in {self.hang_backoff:g} s")
            self.stop()
        else:
            self._give_up("metrics: the NVML sampler " + ("wrote garbage" if line == "garbage" else "exited")
                          + "; started again at a later scrape")
        return got
