"""What a request child tells the server, on a datagram socket only the server and its children
hold (:data:`REPORT_TO`, made by the server's loop): the pages it wrote, which the next spares
warm (:mod:`..apply.prewarm`), or that the container whose spec it edited asks for its hook next
(:data:`HOOK_FOLLOWS`), so that the server forks that hook's spare at once.

Best effort both ways: a lost or malformed message costs a later request only its warm pages or
its spare, never an answer.
"""

from __future__ import annotations

import socket

from .. import log

REPORT_TO: socket.socket | None = None   # the children's end; None outside a server
# From a served runtime create: its container's prestart hook asks next, within runc's create,
# sooner than the server forks a spare on its own. One byte: a page report is whole 16-byte
# ranges, so never this.
HOOK_FOLLOWS = b"h"

_forks = 0   # spares and request children forked so far (see will_report)


def tell(message: bytes) -> None:
    """In a request child: ``message`` to the server."""
    if REPORT_TO is not None:
        try:
            REPORT_TO.send(message)
        except OSError:
            pass


def report_pages() -> None:
    """In a request child, after its client has its answer: the pages it wrote, if this child
    was asked to report them (:func:`will_report`)."""
    from ..apply import prewarm

    if prewarm.REPORT:
        tell(prewarm.written_ranges())


def will_report() -> None:
    """In the server, before a fork: whether that child reports the pages it writes (the first
    ones, until one did, then one in prewarm.REPORT_EVERY)."""
    from ..apply import prewarm

    global _forks
    _forks += 1
    prewarm.REPORT = prewarm.LEARNED is None or _forks % prewarm.REPORT_EVERY == 0


def learn(learn_r: socket.socket) -> bool:
    """In the server: one child's message taken. Pages reported become what the next spares
    warm; True when a hook follows."""
    from ..apply import prewarm

    try:
        data = learn_r.recv(prewarm.MAX_REPORT + 1)
        if data == HOOK_FOLLOWS:
            log.info("a runtime create was served: its hook's spare is forked at once")
            return True
        ranges = prewarm.unpack(data)
    except (BlockingIOError, InterruptedError, ValueError):
        return False
    prewarm.LEARNED = data
    log.info(f"spares warm {sum(end - start for start, end in ranges) >> 10} KiB from now on, "
             f"in {len(ranges)} ranges a request wrote")
    return False
