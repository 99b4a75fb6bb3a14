"""One request, in the child the server forked for it: check the peer, take its fds, become
the hook it stands for, answer.

Why in a child: a crash or a hang is that request's alone, and the child can take over the
client's stdio, working directory, umask and two environment variables wholesale, so the hook
code runs exactly as it would have in the client's own process. The checks come first and
read nothing of the request's content: a client in another mount, PID, cgroup or user
namespace, under another root or not root is declined, and runs the hook itself.

The runtime shim's front (``native/runtime.c``) asks here too, with its own first word
(``NVR1``): the spec edit its Python half would make (``runtime/prepare.py``), made by the same
code in a child that already has it imported and the inventory parsed, about 50 ms sooner per
GPU container under ``--runtime=nvidia``. The child then runs exactly as that Python half would
have: the arguments the front would have passed it, "/" as working directory, ``PATH`` the only
variable, the front's umask and stderr, /dev/null as stdin and stdout (the front sends those).
It is declined, and the front runs its Python half, when the front belongs to another install
(its interpreter in another directory: the hook it names, and the code, would differ). The
answer is the low-level runtime's path, which the front executes, or the exit status.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys

from .. import log
from ..errors import escape
from ..hook import client as hookclient
from . import reports

REQUEST_TIMEOUT = 10.0   # for the request message to arrive after connect
_NAMESPACES = ("mnt", "pid", "cgroup", "user")


def handle(conn: socket.socket) -> int:
    """Check the peer, take its fds, become the hook it stands for, answer. Returns the exit
    code of this child (not of the hook)."""
    become_request_child()
    conn.settimeout(REQUEST_TIMEOUT)
    try:
        data, fds = _receive(conn)
    except (OSError, ValueError) as exc:
        return _decline(conn, f"bad request: {exc}")
    runtime = data.startswith(hookclient.RUNTIME_MAGIC)
    try:
        magic = hookclient.RUNTIME_MAGIC if runtime else hookclient.MAGIC
        claimed, umask, argv, env = hookclient.decode_request(data, magic)
        reason = _decline_reason(conn, claimed) or (_runtime_decline(argv, env) if runtime else None)
    except ValueError as exc:
        reason = f"bad request: {exc}"
    if reason:
        for fd in fds:
            os.close(fd)
        return _decline(conn, reason)
    if runtime:
        log.info(f"runtime request from pid {claimed}: {' '.join(escape(a) for a in argv[1:])}")
    log.close()   # the server's trace; the hook opens its own (--debug) as it would in-process
    stdin, stdout, stderr, cwd = fds
    # From here on the run is the client's: its stdio, its cwd, its two variables.
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.fchdir(cwd)
    os.close(cwd)
    os.umask(umask)
    os.environ.clear()
    os.environ.update(env)
    if runtime:
        return _run_runtime(conn, argv[1:])
    from ..hook import main as hook, prestart
    from ..hook.usage import PROG

    prestart.SERVED_BY = os.getppid()
    try:
        status = hook.run(argv)
    except BaseException as exc:   # a bug: one line, as everywhere, and the client still hears
        os.write(2, f"{PROG}: internal error: {type(exc).__name__}: {escape(exc)}\n".encode())
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        pass
    code = _answer(conn, f"rc {status & 0xFF}", code=0)
    reports.report_pages()
    return code


def _runtime_decline(argv: list[str], env: dict) -> str | None:
    """Why the runtime front's request must go to its own Python half: it is not of this
    install. ``argv[0]`` is the interpreter the front would run; the rest its arguments."""
    if env or not argv or not os.path.isabs(argv[0]):
        return "bad runtime request"
    if _real_dir(argv[0]) != _real_dir(sys.executable):
        return f"runtime front of another install ({escape(argv[0])})"
    return None


def _real_dir(program: str) -> str:
    """The real directory of a program, its name aside: a virtualenv's ``bin/python`` links to
    the system's interpreter, so the file alone would make every install the same."""
    return os.path.realpath(os.path.dirname(program))


def _run_runtime(conn: socket.socket, argv: list[str]) -> int:
    """The runtime shim's Python half on the front's arguments; the answer is the runtime to
    execute (``runtime PATH``) or the exit status (``rc N``), its error line already on the
    front's stderr. The front sent "/" as the working directory and no environment: ``PATH``
    is set as the front sets it for its Python half."""
    from ..inventory.catalog import DEFAULT_PATH
    from ..runtime.prepare import PROG, run

    os.environ["PATH"] = DEFAULT_PATH
    try:
        status, runtime = run(argv)
    except BaseException as exc:   # a bug: one line, as everywhere, and the front still hears
        os.write(2, f"{PROG}: internal error: {type(exc).__name__}: {escape(exc)}\n".encode())
        status, runtime = 1, None
    try:
        sys.stderr.flush()
    except OSError:
        pass
    if status == 0 and runtime:
        reports.tell(reports.HOOK_FOLLOWS)   # before the answer: the hook's spare is forked once this child ends
        return _answer(conn, f"runtime {runtime}", code=0)
    return _answer(conn, f"rc {status & 0xFF or 1}", code=0)


def become_request_child() -> None:
    import prctl

    prctl.set_pdeathsig(signal.SIGKILL)   # a server stopped hard takes its requests with it
    prctl.set_name("nvc-request")         # what ps shows: a request, or (renamed) the spare
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)


def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
    data, fds, flags, _ = socket.recv_fds(conn, hookclient.MAX_REQUEST, hookclient.MAX_FDS)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != hookclient.MAX_FDS:
        for fd in fds:
            os.close(fd)
        raise ValueError("request too large or without its four fds")
    return data, fds


def _decline_reason(conn: socket.socket, claimed: int) -> str | None:
    """Why this server must not run the request (``claimed``: the PID the client says it has)."""
    peer_pid, peer_uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if peer_uid != 0:
        return f"client uid {peer_uid} is not root"
    if peer_pid <= 0 or claimed != peer_pid:
        return "client in another PID namespace"
    try:
        for name in _NAMESPACES:
            if _identity(f"/proc/{peer_pid}/ns/{name}") != _identity(f"/proc/self/ns/{name}"):
                return f"client in another {name} namespace"
        if _identity(f"/proc/{peer_pid}/root") != _identity("/"):
            return "client has another root directory"
    except OSError as exc:
        return f"cannot inspect the client: {exc.strerror}"
    return None


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _decline(conn: socket.socket, reason: str) -> int:
    """The client runs the hook itself after this; the server's trace says why."""
    log.info(f"request declined: {reason}")
    return _answer(conn, f"declined {reason}")


def _answer(conn: socket.socket, text: str, code: int = 1) -> int:
    try:
        conn.send(text.encode("ascii", "backslashreplace")[:4096])
    except OSError:
        pass
    return code
