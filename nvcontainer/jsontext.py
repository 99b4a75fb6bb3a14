"""JSON text to values and back, exactly as ``json`` does, without importing ``json``.

Why: the in-process hook reads three JSON documents on every container start (the state on
stdin, the bundle's ``config.json``, the inventory cache entry) and its workers answer in JSON,
and ``import json`` costs a start its modules *and* ``re``, which pulls in ``enum``,
``functools``, ``collections`` and more: several milliseconds of every container start before
a byte is parsed (issue 27). The parsing and the encoding are done in C by ``_json``, the
accelerator that ``json`` itself drives; the Python modules around it only set it up and skip
whitespace with regular expressions. This module drives the same C scanner and encoder with the
same settings, so every value and every text is ``json``'s own.

What is not done here goes to ``json`` itself (imported then): any failure (the error
``json`` raises, with its message and position, is the one the caller gets: the text is parsed
once more by ``json``, on a path no valid document takes), bytes in another encoding than UTF-8,
and interpreters without ``_json``.
"""

from __future__ import annotations

try:
    from _json import encode_basestring_ascii, make_encoder, make_scanner
except ImportError:   # not CPython: json's own pure-Python code, every time
    make_scanner = None

_WHITESPACE = " \t\n\r"   # json.decoder.WHITESPACE
_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}
_scanners: dict = {}


class _Context:
    """What ``make_scanner`` reads of a ``json.JSONDecoder``: its settings for ``json.loads``
    with these two arguments (everything else at json's default)."""

    __slots__ = ("strict", "object_hook", "object_pairs_hook", "parse_float", "parse_int", "parse_constant",
                 "memo")

    def __init__(self, object_pairs_hook, parse_constant) -> None:
        self.strict = True
        self.object_hook = None
        self.object_pairs_hook = object_pairs_hook
        self.parse_float = float
        self.parse_int = int
        self.parse_constant = parse_constant or _CONSTANTS.__getitem__
        self.memo = {}


def _scanner(object_pairs_hook, parse_constant):
    key = (object_pairs_hook, parse_constant)
    scan = _scanners.get(key)
    if scan is None:
        scan = _scanners[key] = make_scanner(_Context(object_pairs_hook, parse_constant))
    return scan


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WHITESPACE:
        i += 1
    return i


def _text(data) -> str | None:
    """``data`` as ``json.loads`` decodes it, when that is plain UTF-8 (no byte-order mark, no
    NUL in the first two bytes: ``json.detect_encoding``'s signs of UTF-16 and UTF-32); None
    for what only ``json`` decodes."""
    if isinstance(data, str):
        return data
    if not isinstance(data, (bytes, bytearray)) or not data or data[0] in (0, 0xEF, 0xFE, 0xFF) \
            or (len(data) > 1 and data[1] == 0):
        return None
    return bytes(data).decode("utf-8", "surrogatepass")


def loads(data, *, object_pairs_hook=None, parse_constant=None):
    """``json.loads(data, object_pairs_hook=..., parse_constant=...)``: the same value, or the
    same exception."""
    if make_scanner is not None:
        try:
            text = _text(data)
            if text is not None:
                value, end = _scanner(object_pairs_hook, parse_constant)(text, _skip(text, 0))
                if _skip(text, end) == len(text):
                    return value
        except Exception:   # noqa: BLE001 - json parses it again below and raises its own error
            pass
    import json

    return json.loads(data, object_pairs_hook=object_pairs_hook, parse_constant=parse_constant)


def raw_decode(text: str, index: int = 0):
    """``json.JSONDecoder().raw_decode(text, index)``: (value, end), or json's exception."""
    if make_scanner is not None:
        try:
            return _scanner(None, None)(text, index)
        except Exception:   # noqa: BLE001 - as in loads
            pass
    import json

    return json.JSONDecoder().raw_decode(text, index)


def _unencodable(o):
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def dumps(obj, *, sort_keys: bool = False, separators: tuple[str, str] | None = None, allow_nan: bool = True) -> str:
    """``json.dumps(obj, sort_keys=..., separators=..., allow_nan=...)`` (ASCII, no indent)."""
    if make_scanner is None:
        import json

        return json.dumps(obj, sort_keys=sort_keys, separators=separators, allow_nan=allow_nan)
    if isinstance(obj, str):
        return encode_basestring_ascii(obj)
    item_separator, key_separator = separators or (", ", ": ")
    encode = make_encoder({}, _unencodable, encode_basestring_ascii, None, key_separator, item_separator,
                            sort_keys, False, allow_nan)
    return "".join(encode(obj, 0))
