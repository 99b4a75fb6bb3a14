"""A worker forked ahead of its job: :mod:`.worker`'s fork, taken before the request comes.

Why: ``nvcontainer serve`` forks each request's child ahead (a spare), so the fork is not paid
while a container waits; the worker that child forks for the request would be. So the spare
forks its worker ahead too: the standby detaches from everything at once, takes the namespaces
the ldconfig sandbox needs, and waits for one job on a socket pair only its parent holds. It
does not warm its pages as the spare does (:mod:`.prewarm`): measured, copying the pages the
spare's requests write cost more CPU than the worker's own copy-on-write faults, and no time
(docs/performance.md). The job is what
:func:`worker.start` would have forked with (function, arguments, the fds to keep, and the
parent's umask, working directory and environment, which a fork would have inherited); the
kept fds land on the numbers the parent had, so the arguments mean what they meant there. From
then on it is the same worker: same group, deadline from the hand-over, same reply. A job that
cannot be handed over (not picklable, too large) goes to a forked worker instead. The standby
is always born isolated (:func:`worker.start`'s ``isolated``: namespaces of its own), since
it cannot know whether its job will run the ldconfig sandbox, which needs them.

Kept apart from :mod:`.worker` because only a resident server's spare ever has a standby: a
cold hook run never imports this module.
"""

from __future__ import annotations

import os
import socket
import threading

from .. import log
from ..errors import NvcError
from . import fds, ns, worker

MAX_JOB = 1 << 20
MAX_JOB_FDS = 240        # the kernel takes at most 253 fds in one message


class Standby:
    """The forked standby, from :func:`standby` until its job is handed over or it is
    discarded."""

    __slots__ = ("pid", "pidfd", "jobs", "rfd")

    def __init__(self, pid: int, pidfd: int, jobs: socket.socket, rfd: int):
        self.pid, self.pidfd, self.jobs, self.rfd = pid, pidfd, jobs, rfd

    def discard(self) -> None:
        """Kill and reap it: its job will not come."""
        self.jobs.close()
        worker.kill_group(self.pid)
        worker.reap(self.pid, self.pidfd)
        os.close(self.pidfd)
        os.close(self.rfd)

    def take(self, fn, args, keep: list[int], deadline: float, name: str, category: str,
             max_reply: int) -> worker.Worker | None:
        """Hand it the job :func:`worker.start` was asked for; None (and the standby
        discarded) if the job cannot travel."""
        import pickle

        cwd = None
        try:
            if len(keep) >= MAX_JOB_FDS:
                raise ValueError("too many fds")
            umask = os.umask(0o022)
            os.umask(umask)
            job = pickle.dumps({"fn": fn, "args": args, "keep": keep, "name": name, "category": category,
                                "max_reply": max_reply, "umask": umask, "env": dict(os.environ)})
            if len(job) > MAX_JOB:
                raise ValueError("job too large")
            cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            socket.send_fds(self.jobs, [job], [*keep, cwd])
        except (OSError, ValueError, TypeError, AttributeError, pickle.PicklingError, RecursionError) as exc:
            log.info(f"{name}: standby worker not used ({type(exc).__name__}): forking one")
            self.discard()
            return None
        finally:
            if cwd is not None:
                os.close(cwd)
        self.jobs.close()
        log.info(f"{name}: handed to the standby worker, pid {self.pid}")
        return worker.Worker(self.pid, self.pidfd, self.rfd, deadline, name, category, max_reply)


def standby() -> bool:
    """Fork the next worker now, for :func:`worker.start` to hand its job to; False if there
    already is one or it cannot be forked. For a process that knows it will start a worker soon
    and is idle now (``nvcontainer serve``'s spare child); the standby dies with this process."""
    if worker.has_standby() or threading.active_count() > 1:
        return False
    parent = os.getpid()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    rfd, wfd = os.pipe()
    try:
        pid, parent_fd = ns.fork_isolated()   # isolated, whatever the job: see the module docstring
    except OSError:
        for end in (ours, theirs):
            end.close()
        os.close(rfd)
        os.close(wfd)
        return False
    if pid == 0:
        _standby_child(parent, theirs.fileno(), wfd, parent_fd)   # never returns
    theirs.close()
    os.close(wfd)
    try:
        pidfd = worker.watch(pid)
    except OSError:
        ours.close()
        os.close(rfd)
        return False
    return worker.set_standby(Standby(pid, pidfd, ours, rfd))


def discard_standby() -> None:
    """Kill and reap the standby, if there is one (its job will not come)."""
    ready = worker.take_standby()
    if ready is not None:
        ready.discard()


def _standby_child(parent: int, jobs: int, wfd: int, parent_fd: int):
    try:
        wfd = worker.become_worker(parent, [jobs], wfd, parent_fd)   # nothing of the server's or the spare's stays here
    except BaseException:
        os._exit(1)   # the parent forks a worker of its own for the job instead
    worker.answer(wfd, worker.MAX_REPLY, "internal", "standby worker", lambda: _install(jobs, wfd))


def _install(jobs: int, wfd: int):
    """Receive the job and become the worker :func:`worker.start` would have forked for it."""
    import pickle

    conn = socket.socket(fileno=jobs)
    data, received, flags, _ = socket.recv_fds(conn, MAX_JOB + 1, MAX_JOB_FDS)
    if not data:
        os._exit(0)   # the parent went on without a job for us
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        raise NvcError("internal", "standby worker: job truncated")
    job = pickle.loads(data)   # from our parent, over a socket pair nobody else holds
    keep = job["keep"]
    if len(received) != len(keep) + 1:
        raise NvcError("internal", "standby worker: fds missing from the job")
    worker.rename(job["name"], job["category"], job["max_reply"])
    # Everything received moves above every number in use before the kept ones take theirs.
    floor = max([*keep, wfd, jobs, 2]) + 1
    wfd = fds.move_above(wfd, floor) if wfd in keep else wfd
    moved = [fds.move_above(fd, floor) for fd in received]
    for target, fd in zip(keep, moved):
        os.dup2(fd, target, inheritable=False)
    os.fchdir(moved[-1])
    os.umask(job["umask"])
    os.environ.clear()
    os.environ.update(job["env"])
    fds.stdio_to_devnull(keep)
    fds.close_fds_except([*keep, wfd])
    return wfd, job["fn"], job["args"]
