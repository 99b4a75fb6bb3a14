"""The plugin's side of MPS health: a GPU's replicas are Healthy only while its control daemon
is ready, as ``nvcontainer mps-daemon`` says by its ``.ready`` marker and the daemon's control
pipe.

Why files and not a question to the daemon: asking means running the driver's control program
from the plugin's (multi-threaded) process, and the plugin neither forks without exec nor runs
vendor code; the mps-daemon already asks every few seconds and removes the marker the moment
its daemon stops answering. So the plugin only looks, once a second, with bounded reads that
never follow a link; the verdict is :func:`mps.not_ready`'s.
"""

from __future__ import annotations

import asyncio
import os

from ..errors import escape
from ..fs.bounded import read_at_most
from ..mps.control import is_pipe
from . import mps

POLL = 1.0


def read_marker(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data, more = read_at_most(fd, mps.MARKER_LIMIT)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if more else data.decode("utf-8", "replace")


def look(shares) -> dict[str, str]:
    """GPU UUID → why its replicas are unhealthy, for every share whose daemon is not ready."""
    out = {}
    for share in shares:
        why = mps.not_ready(share, read_marker(share.ready), is_pipe(share.control))
        if why:
            out[share.uuid] = why
    return out


async def watch(state, shares, reporter, poll: float = POLL) -> None:
    """Keep ``state``'s "mps" marks current until cancelled; say each change in one line."""
    said: dict[str, str] = {}
    while True:
        bad = look(shares)
        for share in shares:
            why = bad.get(share.uuid)
            if why and said.get(share.uuid) != why:
                reporter.say(f"{share.name} replicas unhealthy: {escape(why, 200)}")
            elif not why and share.uuid in said:
                reporter.say(f"{share.name} replicas healthy: its MPS daemon is ready")
        said = bad
        state.set_bad(bad, source="mps")
        await asyncio.sleep(poll)
