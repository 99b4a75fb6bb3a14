"""What a step cost the process that did it, for the ``--debug`` trace: its own CPU time and the
time it was ready to run but waited for a CPU.

Why: a step's wall time alone cannot tell the two apart, and on a shared machine they call
for different fixes (less work, or less competition). The mount worker's placing step took two
to four times as long under dockerd as under plain runc on the same machine, with the same
system calls (docs/performance.md, Docker's ``--runtime=nvidia``); these figures, one line per
run, said which: CPU, not waiting, and the CPU went to the kernel creating the placeholders and
links on a root file system whose inode allocator was slow there (ext4 without a journal, after
Docker's storage driver had just deleted the previous container's copy of the image).

The wait is the scheduler's own run-queue delay (``/proc/self/schedstat``, second field,
kept whenever the kernel has ``CONFIG_SCHED_INFO``); the CPU time is exact
(``CLOCK_PROCESS_CPUTIME_ID``). The worker enters the container's mount namespace between
its two samples, where ``/proc`` is not necessarily the host's, so the file is opened once,
before, and read again through that fd (a regular file of the worker's own, closed after the
last sample; it reaches nothing else). Only a ``--debug`` run measures.
"""

from __future__ import annotations

import os
import time


class Meter:
    """Samples of this process's usage; :meth:`close` when done."""

    def __init__(self):
        try:
            self._fd = os.open("/proc/self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1   # no procfs or no CONFIG_SCHED_INFO: the wait reads 0

    def sample(self) -> list[int]:
        """[monotonic ns, CPU ns, run-queue wait ns, involuntary context switches, minor page faults]."""
        wait = 0
        if self._fd >= 0:
            try:
                fields = os.pread(self._fd, 128, 0).split()
                wait = int(fields[1])
            except (OSError, IndexError, ValueError):
                pass
        import resource   # here: a run without --debug never needs it

        used = resource.getrusage(resource.RUSAGE_SELF)
        return [time.monotonic_ns(), time.process_time_ns(), wait, used.ru_nivcsw, used.ru_minflt]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def describe(what: str, samples: list, started: float) -> str:
    """One trace line from a step's first and last :meth:`Meter.sample` (taken in the process
    that did the step) and ``started`` (``time.monotonic()`` in the caller when it handed the
    step over): how long until the step began, and what it cost."""
    try:
        (t0, cpu0, wait0, inv0, flt0), (t1, cpu1, wait1, inv1, flt1) = samples
        return (f"{what}: began {(t0 / 1e9 - started) * 1000:.1f} ms after the hand-over; "
                f"{(t1 - t0) / 1e6:.1f} ms in all, {(cpu1 - cpu0) / 1e6:.1f} ms on a CPU, "
                f"{(wait1 - wait0) / 1e6:.1f} ms waiting for one, {inv1 - inv0} preemptions, "
                f"{flt1 - flt0} page faults")
    except (TypeError, ValueError):
        return f"{what}: usage not reported"
