"""The node agent's life: serve each resource on its socket, register with the kubelet, and do
it again whenever the kubelet restarts, until SIGTERM.

Why polling and not inotify: the kubelet signals its restart only by deleting every socket in
its directory (ours too) and creating a new ``kubelet.sock``. Looking at two inodes once a
second (``lstat``, no descriptor kept on anything the kubelet owns) notices both, costs nothing,
and cannot miss an event the way a watch set up a moment too late can. When our socket is gone
or replaced, that resource's server is started again on a fresh socket; when ``kubelet.sock``
is new (or was absent), every resource registers again. A kubelet that is absent or refuses is
retried with a pause that doubles up to 30 s. The device table, health and topology live in
:class:`state.PluginState`, outside the servers, and survive all of this.

Everything runs on one asyncio loop (grpc.aio): request handlers, the ``ListAndWatch`` streams
(which wait on the state's change event rather than holding a thread each), the health monitor
and this loop. The only other threads are gRPC's own.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc

from .. import log
from ..errors import escape
from ..kubelet import sockets
from ..kubelet.backoff import Backoff
from ..kubelet.endpoint import Endpoint as Served
from .service import DevicePluginService
from .state import PluginState
from .v1beta1 import api_pb2 as pb
from .v1beta1 import api_pb2_grpc as pb_grpc

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
POLL = 1.0
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0
REGISTER_TIMEOUT = 5.0


class Endpoint(Served):
    """One resource's gRPC server on its socket."""

    def __init__(self, state: PluginState, resource, dirfd: int, reporter):
        super().__init__(dirfd, resource.socket, lambda: (DevicePluginService(state, resource, reporter.say).handler(),),
                         reporter.say)
        self.resource = resource

    async def start(self) -> None:
        await super().start()
        log.info(f"serving {self.resource.name} on {self.name} ({len(self.resource.devices)} devices)")


class RegistrationFailed(Exception):
    pass


async def register(dirfd: int, endpoint: Endpoint) -> None:
    request = pb.RegisterRequest(
        version=API_VERSION, endpoint=endpoint.name, resource_name=endpoint.resource.name,
        options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True))
    try:
        async with grpc.aio.insecure_channel(sockets.address(dirfd, KUBELET_SOCKET)) as channel:
            await pb_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT)
    except grpc.aio.AioRpcError as exc:
        raise RegistrationFailed(f"{exc.code().name}: {escape(exc.details(), 200)}") from None


async def serve(state: PluginState, socket_dir: str, reporter, monitor=None) -> None:
    """Serve until SIGTERM or SIGINT; then stop, and remove only the sockets we created."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    dirfd = sockets.open_dir(socket_dir)
    endpoints = [Endpoint(state, r, dirfd, reporter) for r in state.resources]
    watch = asyncio.create_task(monitor.run()) if monitor is not None else None
    try:
        for endpoint in endpoints:
            await endpoint.start()
        reporter.say(f"serving {', '.join(f'{e.resource.name} ({len(e.resource.devices)})' for e in endpoints)} "
                     f"in {escape(socket_dir)}")
        await _keep_registered(dirfd, endpoints, reporter, stop, escape(socket_dir))
    finally:
        state.stop()
        if watch is not None:
            await monitor.close(watch)
        for endpoint in endpoints:
            await endpoint.stop()
        os.close(dirfd)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    reporter.say("stopped")


async def _keep_registered(dirfd: int, endpoints: list[Endpoint], reporter, stop: asyncio.Event, where: str):
    registered = None                 # identity of the kubelet.sock we registered with
    backoff, next_try = Backoff(BACKOFF_FIRST, BACKOFF_MAX), 0.0
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        for endpoint in endpoints:
            if not endpoint.intact():
                reporter.say(f"socket {escape(endpoint.name)} was removed (kubelet restart?): serving it again")
                await endpoint.restart()
                registered = None
        kubelet = sockets.identity(dirfd, KUBELET_SOCKET)
        if kubelet is None:
            registered = None
            reporter.state("kubelet", f"waiting for the kubelet: no {KUBELET_SOCKET} in {where}")
        elif kubelet != registered and loop.time() >= next_try:
            try:
                for endpoint in endpoints:
                    await register(dirfd, endpoint)
            except RegistrationFailed as exc:
                reporter.state("kubelet", f"registration with the kubelet failed ({exc}); retrying, at most "
                                          f"every {BACKOFF_MAX:g} s")
                next_try = loop.time() + backoff.next()
            else:
                registered = kubelet
                backoff.reset()
                reporter.state("kubelet", "registered " + ", ".join(e.resource.name for e in endpoints)
                               + " with the kubelet")
        try:
            await asyncio.wait_for(stop.wait(), POLL)
        except asyncio.TimeoutError:
            pass
