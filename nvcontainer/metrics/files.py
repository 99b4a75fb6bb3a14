"""The operator's files the exporter reads at start (counters CSV, web config): bounded, never a
FIFO (opened non-blocking and checked to be a regular file), text, one error line naming them."""

from __future__ import annotations

from ..errors import NvcError, escape
from ..fs.bounded import Refused, read_regular


def read_text(path: str, limit: int, what: str) -> str:
    try:
        data = read_regular(path, limit)[0]
    except Refused as exc:
        raise NvcError("input", f"{what} {escape(path)}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise NvcError("input", f"{what} {escape(path)}: {escape(getattr(exc, 'strerror', None) or exc)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise NvcError("input", f"{what} {escape(path)}: not UTF-8") from None
