"""One gRPC server (grpc.aio) on one socket in a kubelet directory, started, checked and
stopped so that a kubelet restart that wipes the directory is noticed and repaired.

Why shared: the device plugin serves one socket per resource in ``device-plugins/``, the DRA
plugin a registration socket in ``plugins_registry/`` and its service socket in
``plugins/<driver>/``; every one of them must be bound under a hidden name and renamed into
place (:mod:`sockets`), must be recognised as still ours by identity, and must be removed on
exit only if it is still ours. ``handlers`` are what ``grpc.aio.server`` takes; the caller
builds them afresh for each start (a restarted server gets new ones).

Why handlers are built with :func:`unary` rather than by subclassing a generated servicer: the
generated code deserializes requests itself, and a request that is not valid protobuf then ends
in grpcio's own logging with a traceback. :func:`unary`'s deserializer turns it into a
:class:`Malformed` the handler refuses with one line and ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from ..errors import NvcError, escape
from . import sockets

STOP_GRACE = 1.0
MAX_MESSAGE = 1 << 20
SERVER_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE),)


class Endpoint:
    """``make_handlers()`` → the generic handlers to serve; ``name``: the socket's file name in
    the directory ``dirfd`` (see :func:`sockets.open_dir`); ``warn(line)`` for what was cleared."""

    def __init__(self, dirfd: int, name: str, make_handlers, warn):
        self.dirfd = dirfd
        self.name = name
        self.make_handlers = make_handlers
        self.warn = warn
        self.server = None
        self.ours = None

    async def start(self) -> None:
        sockets.clear(self.dirfd, self.name, self.warn)
        sockets.clear_staged(self.dirfd, self.name)
        staged = sockets.staging_name(self.name)
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers(tuple(self.make_handlers()))
        try:
            server.add_insecure_port(sockets.address(self.dirfd, staged))
        except RuntimeError as exc:
            raise NvcError("input", f"cannot listen on {escape(self.name)}: {escape(exc)}") from None
        await server.start()
        try:
            sockets.publish(self.dirfd, staged, self.name)
        except NvcError:
            await server.stop(0)
            raise
        self.server = server
        self.ours = sockets.identity(self.dirfd, self.name)

    def intact(self) -> bool:
        return self.ours is not None and sockets.identity(self.dirfd, self.name) == self.ours

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(STOP_GRACE)
            self.server = None
        sockets.remove_if_ours(self.dirfd, self.name, self.ours)
        self.ours = None


class Malformed:
    """A request that was not a valid message: what the handler gets instead of one."""

    def __init__(self, why: str):
        self.why = why


def parser(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except (DecodeError, RuntimeError, ValueError) as exc:
            return Malformed(str(exc) or "not a valid message")
    return parse


def unary(fn, request_type, response_type):
    """A unary method handler whose deserializer never raises (see :class:`Malformed`)."""
    return grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=parser(request_type), response_serializer=response_type.SerializeToString)
