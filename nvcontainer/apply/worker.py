"""Run one function in a forked child under a deadline: the only way this project enters
another namespace or runs anything that might hang.

Why a fork and not code in the hook's own process: entering a mount namespace changes root and
cwd for good and needs a single-threaded caller, and anything touching a container can block
(a FUSE mount, a FIFO) or be slow. So the work happens in a child, and the parent keeps only
what it needs to stay in charge:

* the child dies with the parent (``PR_SET_PDEATHSIG``), because runc and crun SIGKILL only
  the hook PID on their timeout and would leave a worker mounting into a dying container;
* the child is not dumpable, so nothing in the container's PID namespace can ptrace it or open
  its ``/proc/PID/fd`` links to reach the host fds it holds;
* the child leads its own process group, so a timeout kills it *and* anything it started;
* the child holds only the fds the caller names: a stray host fd inherited into a process that
  enters a container is the CVE-2024-21626 class of bug;
* the answer is a bounded JSON document on a pipe, so a misbehaving child cannot flood or
  confuse the parent, and errors keep their category and one-line detail.

:func:`start` forks and returns at once, so the parent can do work of its own meanwhile;
:meth:`Worker.wait` then collects the answer under the same deadline, counted from the fork.
One worker may do two steps in a row (mounts, then the ldconfig sandbox): :func:`stage` tells
the parent the first one succeeded (:meth:`Worker.next_stage` returns then, and the hook writes
the devices cgroup while the second step runs), and the worker's failures from then on carry
the second step's name and category, as a worker of its own would.

A worker started ``isolated`` is born init of a new PID namespace, in new network, IPC and
UTS namespaces: the ldconfig sandbox's (:mod:`.sandbox`), taken at birth so the sandbox is the
worker itself and costs no second fork (under ``nvcontainer serve``, the network, IPC and UTS
ones are an empty set the server made once: :func:`.ns.isolate`). Such a worker may end by
executing a program whose output is its reply pipe (:func:`output_follows`): the parent then
gets the program's exit status and the tail of its output instead of a JSON answer.

The parent never starts threads: ``fork()`` in a threaded Python can deadlock on locks held by
other threads, and ``setns(CLONE_NEWNS)`` in the child would fail anyway.
"""

from __future__ import annotations

import gc
import os
import select
import sys
import time
from _signal import SIGKILL   # signal's C half: signal.py adds enums, and enum's import (milliseconds)

import prctl   # here, once: every forked worker (and the ldconfig sandbox) finds it loaded

from .. import jsontext, log
from ..errors import NvcError, escape
from . import ns
from .fds import close_fds_except, move_above, stdio_to_devnull

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:   # annotations only: collections.abc imports collections, a start's 1 ms
    from collections.abc import Callable, Iterable

MAX_REPLY = 1 << 20
MAX_OUTPUT = 64 << 10  # the tail of a program's output kept (see output_follows)
ISOLATION = ns.CLONE_NEWNET | ns.CLONE_NEWIPC | ns.CLONE_NEWUTS   # and a new PID namespace
_EXEC_FRAME = b'{"exec": true}\n'
_REAP_GRACE = 2.0      # seconds to wait for a SIGKILLed child before leaving it unreaped


def run(
    fn: Callable[..., object],
    *args: object,
    deadline: float,
    name: str,
    keep_fds: Iterable[int] = (),
    category: str = "internal",
    max_reply: int = MAX_REPLY,
    isolated: bool = False,
) -> object:
    """Return ``fn(*args)`` computed in a fresh child process.

    ``deadline`` is the number of seconds the child may take; ``name`` says which worker it was
    in every error. The child sees only ``keep_fds`` (plus fds 0-2 pointed at /dev/null unless
    kept). ``fn`` must return something ``json`` can encode. An ``NvcError`` raised by ``fn``
    comes back with its own category; any other failure becomes ``NvcError(category, ...)``,
    a timeout ``NvcError("timeout", ...)``.
    """
    return start(fn, *args, deadline=deadline, name=name, keep_fds=keep_fds, category=category,
                 max_reply=max_reply, isolated=isolated).wait()


def start(
    fn: Callable[..., object],
    *args: object,
    deadline: float,
    name: str,
    keep_fds: Iterable[int] = (),
    category: str = "internal",
    max_reply: int = MAX_REPLY,
    isolated: bool = False,
) -> "Worker":
    """:func:`run` in two halves, so the caller can do its own work while the child runs: the
    child is forked now and its deadline counts from now; :meth:`Worker.wait` collects the
    answer, :meth:`Worker.kill` ends the child and everything it started. A started worker
    must get one of the two (a caller whose own work fails calls ``kill`` before it lets the
    error go: a worker left running would go on changing a container nobody configures any
    more). The child is the same as :func:`run`'s in every other respect; ``isolated`` gives
    it namespaces of its own (see the module docstring; a standby worker always has them).
    """
    threading = sys.modules.get("threading")   # not imported: no thread it counts exists (nor its cost)
    if threading is not None and threading.active_count() > 1:
        raise NvcError("internal", f"{name}: refusing to fork a worker from a multi-threaded process")
    keep = sorted({int(fd) for fd in keep_fds})
    ready = take_standby()
    if ready is not None:
        handed = ready.take(fn, args, keep, deadline, name, category, max_reply)
        if handed is not None:
            return handed
    parent = os.getpid()
    rfd, wfd = os.pipe()
    try:
        pid, parent_fd = ns.fork_isolated() if isolated else (os.fork(), None)
    except OSError as exc:
        os.close(rfd)
        os.close(wfd)
        where = " in namespaces of its own" if isolated else ""
        raise NvcError(category, f"{name}: cannot start worker{where}: {exc.strerror}") from None
    if pid == 0:
        _child(parent, fn, args, keep, wfd, max_reply, category, name, parent_fd)  # never returns
    os.close(wfd)
    try:
        pidfd = watch(pid)
    except OSError as exc:
        os.close(rfd)
        raise NvcError(category, f"{name}: cannot watch worker: {exc.strerror}") from None
    return Worker(pid, pidfd, rfd, deadline, name, category, max_reply)


def watch(pid: int) -> int:
    """The parent's side of a fresh fork: the child's process group set from here too (killpg
    must work even if the child has not run yet), and a pidfd to wait on. Without a pidfd the
    child is killed and reaped, and the OSError raised."""
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    try:
        return os.pidfd_open(pid)
    except OSError:
        kill_group(pid)
        os.waitpid(pid, 0)
        raise


# --- parent side -----------------------------------------------------------------------------


class Worker:
    """A forked worker, from :func:`start` until :meth:`wait` or :meth:`kill` has reaped it.

    ``name`` and ``category`` are what its errors say; a child that calls :func:`stage` changes
    both (one worker can do two steps, and each failure must still name its own step).
    """

    def __init__(self, pid: int, pidfd: int, rfd: int, deadline: float, name: str, category: str, max_reply: int):
        self.pid = pid
        self.name = name
        self.category = category
        self._pidfd = pidfd
        self._rfd = rfd
        self._deadline = deadline
        self._end = time.monotonic() + deadline
        self._max_reply = max_reply
        self._open = True
        self._data = bytearray()       # read, not yet taken apart
        self._total = 0                # bytes read in all
        self._eof = False
        self._exited = False
        self._notes: list[object] = []  # of stage frames read, not yet handed out
        self._raw = False               # past an exec frame: the rest is a program's output

    def next_stage(self) -> object:
        """Wait until the child reports its next :func:`stage`, and return that stage's note.
        The caller can then act on the first step's outcome while the child does the second.
        A child that ends instead gives its answer: its error is raised as :meth:`wait` would;
        an answer without the stage is an error too. The group is killed on any error."""
        self._check_open()
        try:
            self._pump(None, until_stage=True)
        except BaseException:
            self.kill()
            raise
        if self._notes:
            return self._notes.pop(0)
        self.wait()
        raise NvcError(self.category, f"{self.name}: worker ended before its next step")

    def wait(self, on_stage: Callable[[object], None] | None = None) -> object:
        """The child's answer, as :func:`run` returns it (or raises). ``on_stage(note)`` is
        called, in this process, for every :func:`stage` the child reports that
        :meth:`next_stage` did not return, as soon as it is read. The whole process group is
        killed on any way out."""
        self._check_open()
        try:
            self._pump(on_stage, until_stage=False)
            status = self._finish(on_stage)
        except BaseException:
            self.kill()
            raise
        self._close()
        if self._raw:
            return {"status": status, "output": bytes(self._data).decode("utf-8", "backslashreplace")}
        return _decode(bytes(self._data), status, self.name, self.category)

    def kill(self) -> None:
        """Kill the child and everything it started, and reap it. Safe to call more than once."""
        if not self._open:
            return
        try:
            kill_group(self.pid)
            reap(self.pid, self._pidfd)
        finally:
            self._close()

    def _check_open(self) -> None:
        if not self._open:
            raise NvcError("internal", f"{self.name}: worker already collected")

    def _close(self) -> None:
        if self._open:
            self._open = False
            os.close(self._rfd)
            os.close(self._pidfd)

    def _pump(self, on_stage, *, until_stage: bool) -> None:
        """Read until the child has exited or, with ``until_stage``, a stage note is waiting."""
        pidfd, rfd = self._pidfd, self._rfd
        while not self._exited and not (until_stage and self._notes):
            # Past the deadline (the caller may have been busy with its own work meanwhile),
            # one look at what is there still comes first: a stage frame already written says
            # which step the timeout hit.
            left = self._end - time.monotonic()
            ready, _, _ = select.select([pidfd] if self._eof else [pidfd, rfd], [], [], max(left, 0))
            if rfd in ready:
                chunk = os.read(rfd, 65536)
                self._eof = not chunk
                self._take(chunk, on_stage)
            if pidfd in ready:
                self._exited = True
            elif left <= 0 and not (until_stage and self._notes):
                raise NvcError("timeout", f"{self.name}: timed out after {self._deadline:g}s")

    def _finish(self, on_stage) -> int:
        """After the child exited: what is left in the pipe, and the exit status (reaped)."""
        pid, rfd = self.pid, self._rfd
        # The child is a zombie now, so its PID (and with it the group id) cannot be reused yet:
        # killing the group here reaches only processes the child left behind.
        kill_group(pid)
        if not self._eof:
            # Everything the child wrote is in the pipe; what is still open is held by a
            # leftover that was just killed, so read what is there without waiting for EOF.
            os.set_blocking(rfd, False)
            try:
                while (self._raw or self._total <= self._max_reply) and (chunk := os.read(rfd, 65536)):
                    self._take(chunk, on_stage)
            except BlockingIOError:
                pass
        return reap(pid, self._pidfd)

    def _take(self, chunk: bytes, on_stage) -> None:
        """Add what was read; act on the complete stage frames at the start. The final reply
        is JSON without a newline, so a line is always a stage frame."""
        data = self._data
        data += chunk
        if self._raw:
            del data[: max(len(data) - MAX_OUTPUT, 0)]
            return
        self._total += len(chunk)
        if self._total > self._max_reply:
            raise NvcError(self.category, f"{self.name}: reply larger than {self._max_reply} bytes")
        while (cut := data.find(b"\n")) >= 0:
            try:
                frame = jsontext.loads(data[:cut])
            except (ValueError, RecursionError):
                frame = None
            if frame == {"exec": True}:
                del data[:cut + 1]
                self._raw = True
                del data[: max(len(data) - MAX_OUTPUT, 0)]   # what followed in the chunk is output
                break
            step = frame.get("stage") if isinstance(frame, dict) else None
            if not (isinstance(step, list) and len(step) == 2 and all(isinstance(part, str) for part in step)):
                raise NvcError(self.category, f"{self.name}: worker sent a garbled reply")
            del data[:cut + 1]
            self.name, self.category = _one_line(step[0], 200), _one_line(step[1], 40)
            self._notes.append(frame.get("note"))
        if on_stage is not None:
            while self._notes:
                on_stage(self._notes.pop(0))


def kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):  # os.kill covers a child that never joined its group
        try:
            kill(pid, SIGKILL)
        except OSError:
            pass


def reap(pid: int, pidfd: int) -> int:
    """Exit status of the child as ``os.waitstatus_to_exitcode`` gives it (-N: signal N).

    A SIGKILLed child normally goes at once; one stuck in an uninterruptible sleep is left
    unreaped rather than hanging the hook past its deadline.
    """
    select.select([pidfd], [], [], _REAP_GRACE)
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return 0
    return os.waitstatus_to_exitcode(status) if done else -SIGKILL


def _decode(data: bytes, status: int, name: str, category: str) -> object:
    if not data:
        if status < 0:
            raise NvcError(category, f"{name}: worker killed by signal {_signame(-status)}")
        raise NvcError(category, f"{name}: worker exited with status {status} without a reply")
    try:
        reply = jsontext.loads(data)
    except (ValueError, RecursionError):
        reply = None
    if isinstance(reply, dict) and "ok" in reply:
        return reply["ok"]
    error = reply.get("error") if isinstance(reply, dict) else None
    if isinstance(error, list) and len(error) == 2 and all(isinstance(part, str) for part in error):
        raise NvcError(_one_line(error[0], 40), _one_line(error[1], 4000))
    raise NvcError(category, f"{name}: worker sent a garbled reply")


def _one_line(text: str, limit: int) -> str:
    """The child escaped untrusted values already; escape again only what is still not one
    printable line (a detail built without :func:`escape` somewhere), and bound the length."""
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        return escape(text, limit)
    return text if len(text) <= limit else text[:limit] + "..."


def _signame(signo: int) -> str:
    import signal   # a worker that died of a signal: its name for the message

    try:
        return signal.Signals(signo).name
    except ValueError:
        return str(signo)


# --- child side ------------------------------------------------------------------------------


class _Here:
    """The running worker's own state, in the child only: where its reply goes, what its
    errors are called now, and how much of the reply budget stage frames have used."""

    def __init__(self, wfd: int, name: str, category: str, max_reply: int):
        self.wfd, self.name, self.category, self.max_reply, self.sent = wfd, name, category, max_reply, 0

    def send(self, data: bytes) -> None:
        self.sent += len(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self.wfd, view):]


_here: _Here | None = None


def rename(name: str, category: str, max_reply: int) -> None:
    """In a worker: from now on its errors are named ``name`` with ``category``, and its reply
    may take ``max_reply`` bytes (a standby taking the job it was forked ahead for)."""
    here = _here
    here.name, here.category, here.max_reply = name, category, max_reply


def stage(name: str, category: str, note: object = None) -> None:
    """In a worker's ``fn``: the first step is done and the next begins. From now on the
    worker's failures (its unexpected exceptions, a timeout, a death by signal) are named
    ``name`` and have ``category``, as if a worker of its own did that step; ``note``
    (JSON data) reaches the parent's ``on_stage`` at once, so the parent can report the first
    step while the second runs. It counts against the reply's size limit."""
    here = _here
    if here is None:
        raise RuntimeError("worker.stage() outside a worker")
    frame = jsontext.dumps({"stage": [name, category], "note": note}, allow_nan=False).encode() + b"\n"
    if here.sent + len(frame) > here.max_reply:
        raise NvcError(here.category, f"{here.name}: reply larger than {here.max_reply} bytes")
    here.send(frame)
    here.name, here.category = name, category


def reply_fd() -> int:
    """In a worker: the fd its reply goes to."""
    return _here.wfd


def move_reply(fd: int) -> None:
    """In a worker that put its reply pipe on another number (``dup2``): the reply goes there."""
    _here.wfd = fd


def output_follows() -> None:
    """In a worker about to ``execve`` a program whose stdout is its reply pipe: everything
    after this is the program's output, and the parent's :meth:`Worker.wait` returns
    ``{"status": the exit status, "output": the last MAX_OUTPUT bytes}`` instead of an answer."""
    _here.send(_EXEC_FRAME)


def _child(parent: int, fn, args, keep: list[int], wfd: int, max_reply: int, category: str, name: str,
           parent_fd: int | None):
    """Body of the forked child; ends in ``os._exit`` whatever happens, so control never
    returns into the parent's stack (which would run the rest of the hook twice)."""
    answer(wfd, max_reply, category, name, lambda: (become_worker(parent, keep, wfd, parent_fd), fn, args))


def answer(wfd: int, max_reply: int, category: str, name: str, setup):
    """Run what ``setup()`` returns (the result fd, the function, its arguments) and write the
    reply; ends in ``os._exit``. A failure of ``setup`` is the worker's failure."""
    global _here
    code = 0
    try:
        here = _here = _Here(wfd, name, category, max_reply)
        try:
            here.wfd, fn, args = setup()
            reply = {"ok": fn(*args)}
        except NvcError as exc:
            reply, code = {"error": [exc.category, exc.detail]}, 1
        except BaseException as exc:  # anything at all must come back as data, not a traceback
            reply, code = {"error": [here.category, f"{here.name}: {type(exc).__name__}: {escape(exc)}"]}, 1
        category, name = here.category, here.name
        try:
            data = jsontext.dumps(reply, allow_nan=False).encode()
        except (TypeError, ValueError):
            data, code = jsontext.dumps({"error": [category, f"{name}: worker result is not JSON data"]}).encode(), 1
        if here.sent + len(data) > max_reply:
            data, code = jsontext.dumps({"error": [category, f"{name}: reply larger than {max_reply} bytes"]}).encode(), 1
        here.send(data)
    finally:
        os._exit(code)


def become_worker(parent: int, keep: list[int], wfd: int, parent_fd: int | None = None) -> int:
    """Detach from everything the parent holds. Returns the (possibly moved) result fd.
    ``parent_fd`` is the parent's pidfd that :func:`.ns.fork_isolated` gives its child: such
    a child also leaves for network, IPC and UTS namespaces of its own."""
    prctl.set_pdeathsig(SIGKILL)
    # The parent may have died between fork() and the line above; the death signal would then
    # never come. After that, getppid() names whoever adopted us, not the parent (or reads 0
    # in a PID namespace of our own, where the parent's pidfd tells instead).
    if parent_fd is None:
        orphaned = os.getppid() != parent
    else:
        orphaned = bool(select.select([parent_fd], [], [], 0)[0])   # a pidfd reads ready once its process exited
    if orphaned:
        os._exit(1)
    if parent_fd is not None:
        ns.isolate(ISOLATION)   # an OSError: the worker's failure (the standby's: none comes)
    prctl.set_dumpable(False)
    os.setpgid(0, 0)
    # Objects the parent left for the cycle collector may own fds; collected here, they would
    # close fd numbers that by then belong to something else.
    gc.freeze()
    log.close()
    if wfd < 3:
        wfd = move_above(wfd, 3)
    stdio_to_devnull(keep)
    close_fds_except([*keep, wfd])
    return wfd


# --- the standby: a worker forked ahead of its job (apply/standby.py) -------------------------

_standby = None   # a standby.Standby that the next start() hands its job to, if any


def set_standby(ready) -> bool:
    """Make ``ready`` (a :class:`standby.Standby`) the worker the next :func:`start` hands its
    job to; False if there already is one."""
    global _standby
    if _standby is not None:
        return False
    _standby = ready
    return True


def has_standby() -> bool:
    return _standby is not None


def take_standby():
    """The standby worker, if there is one, no longer the next :func:`start`'s."""
    global _standby
    ready, _standby = _standby, None
    return ready
