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
