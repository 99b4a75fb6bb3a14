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

The parent never starts threads: ``fork()`` in a threaded Python can deadlock on locks held by
other threads, and ``setns(CLONE_NEWNS)`` in the child would fail anyway.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import os
import resource
import select
import signal
import threading
import time
from typing import Callable, Iterable

import prctl   # here, once: every forked worker (and the ldconfig sandbox) finds it loaded

from .. import log
from ..errors import NvcError, escape

MAX_REPLY = 1 << 20
_NR_CLOSE_RANGE = 436  # the same on every architecture (post-5.1 syscall table)
_REAP_GRACE = 2.0      # seconds to wait for a SIGKILLed child before leaving it unreaped


def run(
    fn: Callable[..., object],
    *args: object,
    deadline: float,
    name: str,
    keep_fds: Iterable[int] = (),
    category: str = "internal",
    max_reply: int = MAX_REPLY,
) -> object:
    """Return ``fn(*args)`` computed in a fresh child process.

    ``deadline`` is the number of seconds the child may take; ``name`` says which worker it was
    in every error. The child sees only ``keep_fds`` (plus fds 0-2 pointed at /dev/null unless
    kept). ``fn`` must return something ``json`` can encode. An ``NvcError`` raised by ``fn``
    comes back with its own category; any other failure becomes ``NvcError(category, ...)``,
    a timeout ``NvcError("timeout", ...)``.
    """
    if threading.active_count() > 1:
        raise NvcError("internal", f"{name}: refusing to fork a worker from a multi-threaded process")
    keep = sorted({int(fd) for fd in keep_fds})
    parent = os.getpid()
    rfd, wfd = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(rfd)
        os.close(wfd)
        raise NvcError(category, f"{name}: cannot start worker: {exc.strerror}") from None
    if pid == 0:
        _child(parent, fn, args, keep, wfd, max_reply, category, name)  # never returns
    os.close(wfd)
    # Also set the group from this side: killpg must work even if the child has not run yet.
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    try:
        data, status = _wait(pid, rfd, deadline, max_reply, name, category)
    finally:
        os.close(rfd)
    return _decode(data, status, name, category)


# --- parent side -----------------------------------------------------------------------------


def _wait(pid: int, rfd: int, deadline: float, max_reply: int, name: str, category: str) -> tuple[bytes, int]:
    """Collect the reply and the exit status; kill the whole process group on any way out."""
    end = time.monotonic() + deadline
    pidfd = os.pidfd_open(pid)
    data = bytearray()
    eof = exited = False
    try:
        while not exited:
            left = end - time.monotonic()
            if left <= 0:
                raise NvcError("timeout", f"{name}: timed out after {deadline:g}s")
            ready, _, _ = select.select([pidfd] if eof else [pidfd, rfd], [], [], left)
            if rfd in ready:
                chunk = os.read(rfd, 65536)
                eof = not chunk
                data += chunk
            if pidfd in ready:
                exited = True
            if len(data) > max_reply:
                raise NvcError(category, f"{name}: reply larger than {max_reply} bytes")
        # The child is a zombie now, so its PID (and with it the group id) cannot be reused yet:
        # killing the group here reaches only processes the child left behind.
        _kill_group(pid)
        if not eof:
            # Everything the child wrote is in the pipe; what is still open is held by a
            # leftover that was just killed, so read what is there without waiting for EOF.
            os.set_blocking(rfd, False)
            try:
                while len(data) <= max_reply and (chunk := os.read(rfd, 65536)):
                    data += chunk
            except BlockingIOError:
                pass
            if len(data) > max_reply:
                raise NvcError(category, f"{name}: reply larger than {max_reply} bytes")
        return bytes(data), _reap(pid, pidfd)
    except BaseException:
        _kill_group(pid)
        _reap(pid, pidfd)
        raise
    finally:
        os.close(pidfd)


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):  # os.kill covers a child that never joined its group
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _reap(pid: int, pidfd: int) -> int:
    """Exit status of the child as ``os.waitstatus_to_exitcode`` gives it (-N: signal N).

    A SIGKILLed child normally goes at once; one stuck in an uninterruptible sleep is left
    unreaped rather than hanging the hook past its deadline.
    """
    select.select([pidfd], [], [], _REAP_GRACE)
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return 0
    return os.waitstatus_to_exitcode(status) if done else -signal.SIGKILL


def _decode(data: bytes, status: int, name: str, category: str) -> object:
    if not data:
        if status < 0:
            raise NvcError(category, f"{name}: worker killed by signal {_signame(-status)}")
        raise NvcError(category, f"{name}: worker exited with status {status} without a reply")
    try:
        reply = json.loads(data)
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
    try:
        return signal.Signals(signo).name
    except ValueError:
        return str(signo)


# --- child side ------------------------------------------------------------------------------


def _child(parent: int, fn, args, keep: list[int], wfd: int, max_reply: int, category: str, name: str):
    """Body of the forked child; ends in ``os._exit`` whatever happens, so control never
    returns into the parent's stack (which would run the rest of the hook twice)."""
    code = 0
    try:
        try:
            wfd = _become_worker(parent, keep, wfd)
            reply = {"ok": fn(*args)}
        except NvcError as exc:
            reply, code = {"error": [exc.category, exc.detail]}, 1
        except BaseException as exc:  # anything at all must come back as data, not a traceback
            reply, code = {"error": [category, f"{name}: {type(exc).__name__}: {escape(exc)}"]}, 1
        try:
            data = json.dumps(reply, allow_nan=False).encode()
        except (TypeError, ValueError):
            data, code = json.dumps({"error": [category, f"{name}: worker result is not JSON data"]}).encode(), 1
        if len(data) > max_reply:
            data, code = json.dumps({"error": [category, f"{name}: reply larger than {max_reply} bytes"]}).encode(), 1
        view = memoryview(data)
        while view:
            view = view[os.write(wfd, view):]
    finally:
        os._exit(code)


def _become_worker(parent: int, keep: list[int], wfd: int) -> int:
    """Detach from everything the parent holds. Returns the (possibly moved) result fd."""
    prctl.set_pdeathsig(signal.SIGKILL)
    # The parent may have died between fork() and the line above; the death signal would then
    # never come. After that, getppid() names whoever adopted us, not the parent.
    if os.getppid() != parent:
        os._exit(1)
    prctl.set_dumpable(False)
    os.setpgid(0, 0)
    # Objects the parent left for the cycle collector may own fds; collected here, they would
    # close fd numbers that by then belong to something else.
    gc.freeze()
    log.close()
    if wfd < 3:
        wfd = _move_above(wfd, 3)
    _stdio_to_devnull(keep)
    close_fds_except([*keep, wfd])
    return wfd


def _move_above(fd: int, floor: int) -> int:
    import fcntl

    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)
    os.close(fd)
    return new


def _stdio_to_devnull(keep: list[int]) -> None:
    """Point fds 0-2 at /dev/null rather than closing them: a closed stdio number is handed to
    the next ``open()``, and a stray ``print`` would then write into that file."""
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    for fd in (0, 1, 2):
        if fd not in keep and fd != null:
            os.dup2(null, fd)
    if null > 2:
        os.close(null)


def close_fds_except(keep: Iterable[int]) -> None:
    """Close every fd from 3 up except ``keep`` (fds 0-2 are left alone)."""
    low = 3
    for fd in sorted({fd for fd in keep if fd >= 3}):
        if fd > low:
            _close_range(low, fd - 1)
        low = fd + 1
    _close_range(low, 0xFFFFFFFF)


# Loaded here, at import, so every forked worker inherits it instead of loading libc again.
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _close_range(first: int, last: int) -> None:
    ret = _libc.syscall(ctypes.c_long(_NR_CLOSE_RANGE), ctypes.c_uint(first), ctypes.c_uint(last), ctypes.c_uint(0))
    if ret == 0:
        return
    err = ctypes.get_errno()
    if err != errno.ENOSYS:
        raise OSError(err, f"close_range: {os.strerror(err)}")
    # Kernels before 5.9: no fd can be at or above the hard limit, so that bounds the loop.
    os.closerange(first, min(last, resource.getrlimit(resource.RLIMIT_NOFILE)[1]) + 1)
