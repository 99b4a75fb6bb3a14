"""``nvcontainer serve``: a resident, root-only helper that runs hook requests warm.

Why: a cold hook spends most of its time starting an interpreter and importing the code it is
about to run; the work itself (mounts, cgroup, ldconfig) is a fraction. This process imports
that code once, builds the inventory cache once, and then forks one short-lived child per
request (see :mod:`nvcontainer.hook.client` for the client and the wire format). The child runs the very
code of ``nvcontainer-hook`` on the client's own stdin, stdout, stderr and working directory,
so a served run and an in-process run cannot differ in what they do or say.

What keeps it from being a new way in:

* the socket lives in a root-owned 0700 directory and is 0600; the peer must be uid 0
  (``SO_PEERCRED``), i.e. someone who could run the hook anyway;
* it declines, before reading anything, a client that does not share its mount, PID, cgroup
  and user namespaces and its root directory: the container's PID, the bundle path and the
  driver files would name different things here. The client then runs the hook itself;
* the client says which PID it has; it must be the one the kernel reports, or the PID
  namespaces differ in a way the namespace check could miss;
* each request runs in a fresh child (a crash or a hang there is that request's alone), which
  is killed within ``CLIENT_GONE_GRACE`` of its client going away: runtimes SIGKILL only the
  hook on their timeout, and the child's workers die with it (``PR_SET_PDEATHSIG``);
* that child is forked before its request comes (a *spare*), once no request has been in flight
  for a while; it makes its memory its own (:mod:`.prewarm`), then takes the next connection
  itself and hands the server a copy so the hang-up watch above still holds. It serves one request only, like
  any child; the time it saves is the copy-on-write faults a fresh child would take on the way.
  It warms only the pages requests were seen to write: now and then a request child reports
  them on a datagram socket only this process and its children hold (:mod:`.reports`); and it
  warms up under ``SCHED_IDLE``, lifted the moment a client comes (:mod:`.background`), so that
  its warm-up never takes a CPU from the container the last request was for;
* this process stays single-threaded, takes nothing from the client's environment but the two
  variables the hook reads (and its umask), and bounds the request (64 KiB, four fds).
"""

from __future__ import annotations

import errno
import gc
import os
import re
import select
import signal
import socket
import sys
import time

from .. import log
from ..errors import NvcError
from ..leases.grant import rehearse
from ..leases.store import path_in
from . import background, reports
from .leasewatch import LeaseWatch
from .listen import adopt, listen
from .request import become_request_child, handle

MAX_CHILDREN = 256
MAX_SPARE_FAILURES = 3   # spares in a row that died without a request: stop forking them ahead
SPARE_DELAY = 0.05       # idle seconds before the spare is forked: the runtime is still starting
                         # the container that the last hook was for, and should have the CPUs
                         # (none after a served runtime create: its own hook is what comes next)
CLIENT_GONE_GRACE = 0.1  # seconds a child may take to exit after its client hung up


def preload() -> None:
    """Import everything a GPU request touches, so that no child pays for an import (tomllib
    too: a node with a config.toml would otherwise import it in every request)."""
    import fnmatch  # noqa: F401   (ld.so.conf's rare ? and [ globs, apply/ldsoconf.py)
    import json  # noqa: F401   (what jsontext hands a document it does not parse: an error's message)
    import pickle  # noqa: F401   (handing a job to a standby worker)
    import signal  # noqa: F401   (a signal's name in a worker's failure)
    import tomllib  # noqa: F401

    from ..config import load, toolkit, values  # noqa: F401
    from ..plan import gather as configure  # noqa: F401
    from ..hook import prestart as hook  # noqa: F401
    from ..request import decide, oci, require, selection
    from ..apply import prewarm, standby  # noqa: F401   (standby: each spare imported it, 1.3 ms)
    from ..apply import execute, ldconfig, mounter, pin, worker  # noqa: F401
    from ..cgroups import bpf, locate, rules, v1, v2  # noqa: F401
    from ..inventory import cache  # noqa: F401
    from ..plan import build, container, model, volume  # noqa: F401
    from ..leases import grant, liveness, store  # noqa: F401   (free:N and exclusive-gpus starts)
    from ..request import free, placement  # noqa: F401
    from ..runtime import argv, bundle, edit, legacy, lowlevel, prepare  # noqa: F401   (the shim's front asks too)

    # The hook path's patterns are strings that re compiles on first use (a cold hook matches
    # few of them); compiled here, into re's cache, every child finds them ready.
    from ..cgroups.locate import PATTERNS as MOUNTINFO   # (cgroups.locate is also a function's name)

    for patterns in (*(module.PATTERNS for module in (values, decide, require, selection, build, container, volume)),
                     MOUNTINFO):
        for pattern in patterns:
            re.compile(pattern)


def warm(cfg) -> str:
    """Build (or check) the inventory cache for ``cfg`` now, so the first container does not pay
    NVML, and parse it here, so no request does (``inventory.cache`` recalls it in every child).

    The hook's ``PATH`` is part of the entry's key, and a service manager's ``PATH`` is seldom
    the one registrations give hooks: warm this process's and the default registration's.
    A failure is reported and left to the requests to meet."""
    global INVENTORY
    from ..inventory.cache import cached_inventory
    from ..inventory.catalog import DEFAULT_PATH

    own = os.environ.get("PATH")
    status = ""
    try:
        for path in dict.fromkeys([own or DEFAULT_PATH, DEFAULT_PATH]):
            os.environ["PATH"] = path
            try:
                inventory = cached_inventory(cfg)
            except NvcError as exc:
                return f"inventory not ready: {exc.detail}"
            status = f"inventory ready: driver {inventory.driver_version}, {len(inventory.gpus)} GPU(s)"
            INVENTORY = inventory
    finally:
        if own is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = own
    return status


def _prepare_ldconfig(cfg) -> None:
    """The sealed copy of the host's ldconfig, made once here and inherited by every child (each
    run re-checks it with one stat, and copies again only if the host file changed)."""
    from ..apply import ldconfig

    try:
        ldconfig.prepare(cfg.ldconfig_program())
    except NvcError as exc:
        log.warning(f"ldconfig not prepared: {exc.detail}")


def _hold_sandbox_namespaces() -> None:
    """Empty network, IPC and UTS namespaces made once here, which every request's ldconfig
    sandbox enters instead of making three of its own (docs/security.md, "The ldconfig
    sandbox's namespaces"). Without them (a kernel or a user namespace that refuses), each
    sandbox makes its own, as a cold hook's does."""
    from ..apply import ns, worker

    try:
        ns.SANDBOX_NAMESPACES = ns.empty_namespaces(worker.ISOLATION)
    except OSError as exc:
        log.warning(f"ldconfig sandboxes make their own namespaces: {exc.strerror}")


# --- the loop --------------------------------------------------------------------------------------


class _Request:
    """A child serving one client. ``gone``: when its client hung up, if it has; ``killed``:
    the child was killed for it (it is reaped when its pidfd says so)."""

    __slots__ = ("pid", "conn", "gone", "killed")

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self.conn, self.gone, self.killed = pid, conn, None, False

    def overdue(self, now: float) -> float | None:
        """Seconds until the grace after the client hung up ends (<= 0: now); None if the
        client is still there or the child was already killed."""
        if self.gone is None or self.killed:
            return None
        return self.gone + CLIENT_GONE_GRACE - now


class _Spare:
    """The next request's child, forked ahead. ``notify``: where it hands over a copy of the
    connection it took, after which it is an ordinary request child."""

    __slots__ = ("pid", "pidfd", "notify", "low")

    def __init__(self, pid: int, pidfd: int, notify: socket.socket, low: bool):
        self.pid, self.pidfd, self.notify = pid, pidfd, notify
        self.low = low   # it warms up under SCHED_IDLE: lift it when a client comes (.background)


LEASES: str | None = None   # the lease file of the server's configuration, rehearsed by spares
INVENTORY = None            # the inventory warm() parsed, for the same


def serve(path: str, cfg, *, ready=None, spare: bool = True) -> int:
    """Serve until SIGTERM or SIGINT. ``ready`` (a callable) is told once requests are taken.

    The socket is bound before the imports and the inventory: a hook that comes during the
    warm-up (a node booting, NVML slow) waits in the backlog for a warm answer instead of
    finding nothing and running cold into the same NVML initialisation."""
    adopted = adopt(path)   # socket activation: systemd owns the socket, and removes it
    sock = adopted or listen(path)
    mine = None if adopted else os.stat(path)
    try:
        preload()
        status = warm(cfg)
        log.info(status)
        _prepare_ldconfig(cfg)
        _hold_sandbox_namespaces()
        global LEASES
        LEASES = path_in(cfg.cache_dir)
        return _loop(sock, status, ready, spare, LeaseWatch(LEASES))
    finally:
        sock.close()
        try:
            now = os.lstat(path)
            if mine is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)
        except OSError:
            pass


def _loop(sock: socket.socket, status: str, ready, use_spare: bool, leases: LeaseWatch) -> int:
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    stopping: list[int] = []

    def on_signal(signo, _frame):
        stopping.append(signo)

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    children: dict[int, _Request] = {}   # by pidfd
    learn_r, reports.REPORT_TO = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    learn_r.setblocking(False)
    reports.REPORT_TO.setblocking(False)
    spare: _Spare | None = None
    spare_failures = 0
    hook_follows = False   # a served runtime create said its hook comes next
    idle_since: float | None = time.monotonic() - SPARE_DELAY   # nothing has run yet: fork one at once
    # Everything imported so far lives as long as the server: keep it out of the collector's
    # walks, here and in every child, whose pages then stay shared.
    leases.start()
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    if ready:
        ready(status)
    try:
        while not stopping:
            # Only after a while idle: a fork (and the spare's warm-up) beside a request in
            # flight, or beside the start it was for, takes CPU from them; until there is a
            # spare, connections are accepted here, one fork each. From the fork until the
            # spare takes a connection no other request runs: only the spare accepts.
            leases.refresh()
            timeout = leases.timeout()   # None unless a lease is pending or inotify failed
            if children:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            if spare is None and use_spare and idle_since is not None:
                wait = spare_wait(idle_since, time.monotonic(), hook_follows)
                if wait <= 0:
                    spare = _fork_spare(sock)
                    hook_follows = False
                else:
                    timeout = wait if timeout is None else min(timeout, wait)
            poller = select.poll()
            for fd in leases.fds():
                poller.register(fd, select.POLLIN)
            poller.register(wake_r, select.POLLIN)
            poller.register(learn_r.fileno(), select.POLLIN)
            if spare is not None:   # the spare accepts; this process does only without one
                poller.register(spare.notify.fileno(), select.POLLIN)
                poller.register(spare.pidfd, select.POLLIN)
                if spare.low:       # ... but lifts it when a client comes during its warm-up
                    poller.register(sock.fileno(), select.POLLIN)
            elif len(children) < MAX_CHILDREN:
                poller.register(sock.fileno(), select.POLLIN)
            by_conn = {}
            for pidfd, req in children.items():
                poller.register(pidfd, select.POLLIN)
                if req.gone is None:
                    poller.register(req.conn.fileno(), 0)   # only POLLHUP/POLLERR: the client hung up
                    by_conn[req.conn.fileno()] = pidfd
                elif (left := req.overdue(time.monotonic())) is not None:
                    timeout = left if timeout is None else min(timeout, left)
            events = poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1))
            polled_spare = spare
            if spare is not None and any(fd in (spare.notify.fileno(), spare.pidfd) for fd, _ in events):
                taken = _taken(spare, children)
                spare_failures = 0 if taken else spare_failures + 1
                spare = None
                if use_spare and spare_failures >= MAX_SPARE_FAILURES:
                    # also on stderr (the service's journal): every start is slower from now on,
                    # and an operator without --debug would otherwise never learn why
                    message = (f"{spare_failures} spare children in a row died without a request: "
                               "forking per request from now on")
                    log.warning(message)
                    sys.stderr.write(f"nvcontainer serve: warning: {message}\n")
                    sys.stderr.flush()
                    use_spare = False
            for fd, what in events:
                if fd == wake_r:
                    _drain(wake_r)
                elif fd == learn_r.fileno():
                    hook_follows = reports.learn(learn_r) or hook_follows
                elif fd == sock.fileno() and polled_spare is not None:
                    polled_spare.low = False
                    background.lift(polled_spare.pid)
                elif fd == sock.fileno():
                    _accept(sock, children)
                elif fd in children:
                    _reap(fd, children)
                elif leases.fired(fd):
                    pass
                elif fd in by_conn and what & (select.POLLHUP | select.POLLERR) and by_conn[fd] in children:
                    children[by_conn[fd]].gone = time.monotonic()
            # A client hangs up once it has its answer, and a child that answered exits at once:
            # only one still there after the grace lost its client (a runtime's timeout), and
            # nobody is waiting for what it would still do.
            now = time.monotonic()
            for req in children.values():
                left = req.overdue(now)
                if left is not None and left <= 0:
                    log.info(f"client of request {req.pid} went away: killing it")
                    _kill(req.pid)
                    req.killed = True
    finally:
        signal.set_wakeup_fd(-1)
        for signo, handler in old_handlers.items():
            signal.signal(signo, handler)
        if spare is not None:   # it has no request (a handed-over one is in children)
            _kill(spare.pid)
            _taken(spare, children)
        for pidfd, req in list(children.items()):
            select.select([pidfd], [], [], 5.0)   # let a request in flight finish
            _kill(req.pid)
            _reap(pidfd, children)
        leases.close()
        os.close(wake_r)
        os.close(wake_w)
        learn_r.close()
        reports.REPORT_TO.close()
        reports.REPORT_TO = None
    log.info(f"stopped by signal {stopping[0]}" if stopping else "stopped")
    return 0


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def spare_wait(idle_since: float, now: float, hook_follows: bool) -> float:
    """Seconds until the next spare is forked (<= 0: now): :data:`SPARE_DELAY` after the server
    went idle, or at once when a served runtime create said its hook comes next. That hook
    follows within runc's create, tens of milliseconds on a real node: without a spare ready
    it would be served by a child forked for it, paying the copy-on-write faults and its
    worker's fork on the container's path."""
    return idle_since + (0.0 if hook_follows else SPARE_DELAY) - now


def _accept(sock: socket.socket, children: dict) -> None:
    try:
        conn, _ = sock.accept()
    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
        return
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            log.warning(f"accept: {exc.strerror}")
            return
        raise
    reports.will_report()
    try:
        pid = os.fork()
    except OSError as exc:
        log.warning(f"cannot fork for a request: {exc.strerror}")
        conn.close()
        return
    if pid == 0:
        code = 1
        try:
            sock.close()
            code = handle(conn)
        finally:
            os._exit(code)
    children[os.pidfd_open(pid)] = _Request(pid, conn)


def _fork_spare(sock: socket.socket) -> _Spare | None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    reports.will_report()
    try:
        pid = os.fork()
    except OSError as exc:
        log.warning(f"cannot fork a spare child: {exc.strerror}")
        ours.close()
        theirs.close()
        return None
    if pid == 0:
        code = 1
        try:
            ours.close()
            code = _spare_child(sock, theirs)
        finally:
            os._exit(code)
    theirs.close()
    return _Spare(pid, os.pidfd_open(pid), ours, background.may_lower())


def _taken(spare: _Spare, children: dict) -> bool:
    """The spare's news: it took a connection (it becomes a request child watched through the
    copy it handed over; True), or it ended without one (reaped here; False)."""
    conn = None
    try:
        _, fds, _, _ = socket.recv_fds(spare.notify, 1, 1, socket.MSG_DONTWAIT)
        if fds:
            conn = socket.socket(fileno=fds[0])
        for extra in fds[1:]:
            os.close(extra)
    except (BlockingIOError, InterruptedError):
        pass
    except OSError as exc:
        log.warning(f"spare child {spare.pid}: {exc.strerror}")
    spare.notify.close()
    if conn is None:
        _kill(spare.pid)   # whatever it was doing, it has no client to do it for
        _reap(spare.pidfd, {spare.pidfd: _Request(spare.pid, None)})
        return False
    children[spare.pidfd] = _Request(spare.pid, conn)
    return True


def _spare_child(sock: socket.socket, notify: socket.socket) -> int:
    import prctl

    from ..apply import prewarm, standby

    become_request_child()
    prctl.set_name("nvc-spare")

    def client_waiting() -> bool:
        return bool(select.select([sock], [], [], 0)[0])

    # The server is idle (it forks a spare only then). The request's worker first, forked
    # ahead too: after this process warmed up, a fork would share and write-protect its pages
    # again. Then the pages requests were seen to write, if known (apply/prewarm.py).
    standby.standby()
    # The rest is for the next request, whenever it comes: only on CPUs nobody else wants
    # (.background). Looked at once lowered: a client that came before the server could see
    # this process low must not wait on it.
    if background.lower() and client_waiting():
        background.lift()
    if prewarm.LEARNED is not None:
        log.info(f"spare {os.getpid()}: warmed {prewarm.own_pages(client_waiting, prewarm.LEARNED) >> 10} KiB")
    if LEASES is not None and not client_waiting():
        rehearse(LEASES, INVENTORY)
    background.lift()
    while True:
        select.select([sock], [], [])   # the server going away kills this child (PDEATHSIG)
        try:
            conn, _ = sock.accept()
            break
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            continue
    sock.close()
    log.info(f"spare {os.getpid()} took a request")
    socket.send_fds(notify, [b"t"], [conn.fileno()])
    notify.close()
    return handle(conn)


def _reap(pidfd: int, children: dict) -> None:
    req = children.pop(pidfd)
    try:
        os.waitpid(req.pid, 0)
    except ChildProcessError:
        pass
    os.close(pidfd)
    if req.conn is not None:
        req.conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)   # not reaped yet, so the number is still this child's
    except ProcessLookupError:
        pass
