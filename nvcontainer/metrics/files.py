"""The operator's files the exporter reads at start (counters CSV, web config): bounded, never a
FIFO (opened non-blocking and checked to be a regular file), text, one error line naming them."""

from __future__ import annotations

import os
import stat

from ..errors import NvcError, escape
from ..fs.bounded import read_at_most


def read_text(path: str, limit: int, what: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise NvcError("input", f"{what} {escape(path)}: {escape(exc.strerror or exc)}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NvcError("input", f"{what} {escape(path)}: not a regular file")
        data, more = read_at_most(fd, limit)
    except OSError as exc:
        raise NvcError("input", f"{what} {escape(path)}: {escape(exc.strerror or exc)}") from None
    finally:
        os.close(fd)
    if more:
        raise NvcError("input", f"{what} {escape(path)}: larger than {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise NvcError("input", f"{what} {escape(path)}: not UTF-8") from None
