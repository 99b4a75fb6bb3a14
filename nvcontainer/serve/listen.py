"""The server's socket: where ``nvcontainer serve`` listens, and what doctor and set-up see there.

Why it matters: the socket is the server's only door, and it runs every request as root. It
lives in a directory only root may enter (0700, owned by us, writable by nobody else) and is
itself 0600; a stale socket left by a server that did not stop cleanly is replaced, a live one
means another server, which is an error rather than a silent takeover.
"""

from __future__ import annotations

import os
import socket
import stat

from ..errors import NvcError, escape

BACKLOG = 256
LISTEN_FDS_START = 3   # sd_listen_fds(3): the first socket systemd passes


def adopt(path: str) -> socket.socket | None:
    """The socket systemd passed (``nvcontainer-serve.socket``: ``LISTEN_PID`` is us and
    ``LISTEN_FDS`` is 1), or None when we were not socket-activated.

    Why check it rather than take fd 3: the server runs every request as root, so the socket it
    serves must be the one the hooks reach, set up as ``listen`` would set it up: a listening
    ``AF_UNIX`` ``SOCK_SEQPACKET`` socket bound to ``path`` in a directory only root may write
    to, itself 0600 (made so, if the activator left it looser: the directory is the gate).
Anything else is an error naming what is wrong. The variables are removed,
    so no child takes the socket for its own."""
    pid, count = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS")
    if pid is None and count is None:
        return None
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if pid != str(os.getpid()):
        return None   # meant for the process that started us
    if count != "1":
        raise NvcError("input", f"LISTEN_FDS: expected 1 socket from systemd, got {escape(str(count))}")
    try:
        sock = socket.socket(fileno=LISTEN_FDS_START)
    except OSError as exc:
        raise NvcError("input", f"LISTEN_FDS: fd {LISTEN_FDS_START} is not a socket: {exc.strerror}") from None
    try:
        _check_adopted(sock, path)
    except BaseException:
        sock.detach()
        raise
    os.set_inheritable(sock.fileno(), False)
    return sock


def _check_adopted(sock: socket.socket, path: str) -> None:
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        raise NvcError("input", "LISTEN_FDS: the socket from systemd must be a unix seqpacket socket "
                                "(ListenSequentialPacket=)")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise NvcError("input", "LISTEN_FDS: the socket from systemd is not listening")
    bound = sock.getsockname()
    if bound != path:
        raise NvcError("input", f"LISTEN_FDS: the socket from systemd is bound to {escape(str(bound))}, "
                                f"not --socket {escape(path)}")
    directory = os.path.dirname(path)
    st, dst = os.lstat(path), os.lstat(directory)
    if not stat.S_ISDIR(dst.st_mode) or dst.st_uid != os.geteuid() or dst.st_mode & 0o022:
        raise NvcError("input", f"{escape(directory)} must be a directory of uid {os.geteuid()} "
                                f"that nobody else may write to")
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise NvcError("input", f"{escape(path)}: the socket from systemd must be ours")
    if st.st_mode & 0o077:   # SocketMode= says 0600; another activator may leave it looser
        os.chmod(path, 0o600)


def listen(path: str) -> socket.socket:
    """Bind ``path`` in a directory only root may enter. A stale socket (nobody answers) is
    replaced; a live one means another server runs, which is an error."""
    if not path.startswith("/"):
        raise NvcError("input", f"--socket must be an absolute path: {escape(path)}")
    directory = os.path.dirname(path)
    _private_dir(directory)
    try:
        state = socket_state(path)
    except OSError as exc:
        raise NvcError("input", f"cannot look at {escape(path)}: {exc.strerror}") from None
    if state == "not a socket":
        raise NvcError("input", f"{escape(path)} exists and is not a socket")
    if state == "listening":
        raise NvcError("input", f"another nvcontainer serve is listening on {escape(path)}")
    if state == "stale":
        os.unlink(path)   # left by a server that did not stop cleanly
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise NvcError("input", f"cannot listen on {escape(path)}: {exc.strerror}") from None
    finally:
        os.umask(old)
    sock.listen(BACKLOG)
    return sock


def socket_state(path: str) -> str:
    """What is at ``path``: ``absent``, ``not a socket``, a socket a server answers on
    (``listening``: connecting is enough, the server declines the empty request) or one nobody
    answers (``stale``). Other lstat errors are raised."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    if not stat.S_ISSOCK(st.st_mode):
        return "not a socket"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        probe.connect(path)
        return "listening"
    except OSError:
        return "stale"
    finally:
        probe.close()


def _private_dir(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise NvcError("input", f"cannot create {escape(path)}: {exc.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise NvcError("input", f"{escape(path)} must be a directory of uid {os.geteuid()} "
                                f"that nobody else may write to")
