"""What a kubelet plugin (device plugin, DRA driver) tells its operator: one line on stderr per change of state.

Why stderr and so little: the plugin runs as a DaemonSet, whose log is its standard error, for
months. A line per retry or per request would bury the one that matters, so states (waiting for
the kubelet, registered, a GPU unhealthy, the driver not answering) are said once when they
begin, and requests only when refused. ``--debug FILE`` has the full trace. Every value from
outside is escaped by the caller (``errors.escape``); this module adds the prefix and writes
the line in one ``write``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from .. import log
from ..errors import escape


class Reporter:
    def __init__(self, command: str = "device-plugin", stream=None):
        self.prefix = f"nvcontainer {command}: "
        self.stream = stream or sys.stderr
        self._last: dict[str, str] = {}

    def say(self, line: str) -> None:
        log.info(line)
        try:
            os.write(self.stream.fileno(), (self.prefix + line + "\n").encode("utf-8", "backslashreplace"))
        except (OSError, ValueError):
            pass

    def take_over_logging(self) -> None:
        """grpcio reports through the logging module, with tracebacks; make each report one line
        (and a stream cancelled at shutdown, which it reports as an error, a line of the trace)."""
        logger = logging.getLogger("grpc")
        logger.handlers[:] = [_OneLine(self)]
        logger.propagate = False
        asyncio_logger = logging.getLogger("asyncio")
        asyncio_logger.handlers[:] = [_OneLine(self)]
        asyncio_logger.propagate = False

    def state(self, topic: str, line: str) -> None:
        """Say ``line`` unless it is already what was last said about ``topic``."""
        if self._last.get(topic) != line:
            self._last[topic] = line
            self.say(line)


class _OneLine(logging.Handler):
    def __init__(self, reporter: Reporter):
        super().__init__(logging.WARNING)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        text = record.getMessage() or (f"{type(error).__name__}: {error}" if error is not None else "")
        if isinstance(error, asyncio.CancelledError):
            log.info(f"{record.name}: a call cancelled ({escape(text, 200)})")
            return
        self.reporter.say(f"{record.name}: {escape(text, 300)}")
