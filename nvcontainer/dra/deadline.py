"""One deadline for a whole HTTP call, down to each socket operation.

Why: httpx (and httpcore below it) time each connect, write and read on its own: a server that
sends one byte just inside the read timeout, again and again, keeps a call going for ever. The
API server is not ours to trust that far (a proxy in front of it, a compromised one, a network
that drops to a trickle), and a DRA plugin's worker held by one claim is a worker no other claim
gets. So the connection pool is given a network backend that caps every operation's timeout by
what is left of the calling thread's deadline (:func:`until`): a call ends by its deadline
whatever the server does, the read in progress included.

The backend and stream interfaces are httpcore's public ones; the one private reach is into the
httpx client for its pools (:func:`install` refuses, naming it, if they are not where expected,
so a library update that moves them fails the tests, not a node).
"""

from __future__ import annotations

import contextlib
import threading
import time

from ..errors import NvcError

# What a call says when its deadline, not a try's own timeout, ended it: the same words whatever
# was left, so a line said once until it changes is said once (kubeapi, execplugin).
LATE = "no answer within the call's deadline"

_local = threading.local()


@contextlib.contextmanager
def until(deadline: float):
    """Every socket operation of this thread, meanwhile, ends by ``deadline`` (monotonic)."""
    before = getattr(_local, "deadline", None)
    _local.deadline = deadline
    try:
        yield
    finally:
        _local.deadline = before


def left() -> float | None:
    """Seconds left of this thread's deadline (negative once passed), or None outside a call."""
    deadline = getattr(_local, "deadline", None)
    return None if deadline is None else deadline - time.monotonic()


def _cap(timeout: float | None, error) -> float | None:
    seconds = left()
    if seconds is None:
        return timeout
    if seconds <= 0:
        raise error("the call's deadline has passed")
    return seconds if timeout is None else min(timeout, seconds)


def install(client) -> None:
    """Give every connection pool of an ``httpx2.Client`` the bounded backend."""
    transports = [getattr(client, "_transport", None), *(getattr(client, "_mounts", None) or {}).values()]
    pools = [getattr(t, "_pool", None) for t in transports if t is not None]
    if not pools or not all(hasattr(p, "_network_backend") for p in pools):
        raise NvcError("internal", "the HTTP client's connection pools are not where nvcontainer expects them "
                                   "(httpx2 changed?): refusing to talk to the API server without a deadline")
    for pool in pools:
        if not isinstance(pool._network_backend, _Backend):
            pool._network_backend = _Backend(pool._network_backend)


class _Backend:
    """httpcore's ``NetworkBackend``, each operation within the thread's deadline."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        import httpcore2

        return _Stream(self._inner.connect_tcp(host, port, _cap(timeout, httpcore2.ConnectTimeout),
                                               local_address=local_address, socket_options=socket_options))

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        import httpcore2

        return _Stream(self._inner.connect_unix_socket(path, _cap(timeout, httpcore2.ConnectTimeout),
                                                       socket_options=socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _Stream:
    """httpcore's ``NetworkStream``, each read and write within the thread's deadline."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        import httpcore2

        return self._inner.read(max_bytes, _cap(timeout, httpcore2.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        import httpcore2

        self._inner.write(buffer, _cap(timeout, httpcore2.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        import httpcore2

        return _Stream(self._inner.start_tls(ssl_context, server_hostname, _cap(timeout, httpcore2.ConnectTimeout)))

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)
