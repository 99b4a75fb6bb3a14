"""The DRA kubelet plugin's life: its service socket, its registration socket, and both again
whenever they are wiped, until SIGTERM.

Two sockets, as the kubelet's plugin watcher wants them: the DRAPlugin service on
``<plugins>/gpu.nvidia.com/dra.sock`` and the Registration service on
``<plugins_registry>/gpu.nvidia.com-reg.sock``. The watcher notices a new socket in
``plugins_registry``, calls ``GetInfo`` on it, connects to the endpoint it names and answers
with ``NotifyRegistrationStatus``. So registering again is re-creating the registration socket:
when either socket is gone or replaced (a kubelet restart that cleans its directories, an
operator), the service socket is served again first and the registration socket after it, so
the kubelet is never pointed at a socket that is not there yet. The check is an ``lstat`` of
each once a second, as the device plugin's (see ``deviceplugin/agent.py`` for why polling).

Everything runs on one asyncio loop (grpc.aio); blocking work (the API server, writing specs)
runs in threads so one slow claim does not hold the others.
"""

from __future__ import annotations

import asyncio
import os
import signal

from ...errors import escape
from ...kubelet import sockets
from ...kubelet.endpoint import Endpoint
from .service import VERSIONS, DraService, Registration

DRA_SOCKET = "dra.sock"
POLL = 1.0


def registration_socket(driver: str) -> str:
    return f"{driver}-reg.sock"


async def serve(preparer, driver: str, registrar_dir: str, plugins_dir: str, reporter, poll: float = POLL) -> None:
    """Serve until SIGTERM or SIGINT; then stop, and remove only the sockets we created."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    plugin_dir = os.path.join(plugins_dir, driver)
    service_fd = sockets.open_dir(plugin_dir)
    try:
        registrar_fd = sockets.open_dir(registrar_dir)
    except BaseException:
        os.close(service_fd)
        raise
    registration = Registration(driver, os.path.join(plugin_dir, DRA_SOCKET), reporter.say)
    service = Endpoint(service_fd, DRA_SOCKET,
                       lambda: [DraService(preparer, pb, reporter.say).handler() for pb in VERSIONS.values()],
                       reporter.say)
    register = Endpoint(registrar_fd, registration_socket(driver), lambda: [registration.handler()], reporter.say)
    try:
        await service.start()
        await register.start()
        reporter.say(f"serving {driver} ({', '.join(VERSIONS)}) on {escape(registration.endpoint)}; registration "
                     f"socket in {escape(registrar_dir)}")
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), poll)
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                break
            if not service.intact() or not register.intact():
                reporter.say("a socket of ours was removed (kubelet restart?): serving and registering again")
                registration.registered = None
                await register.stop()
                await service.restart()
                await register.start()
    finally:
        await register.stop()
        await service.stop()
        os.close(service_fd)
        os.close(registrar_fd)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    reporter.say("stopped")
