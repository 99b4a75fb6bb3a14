"""YAML for CDI specs, without a YAML library.

CDI specs are YAML by convention, and the YAML libraries for Python are either large (PyYAML,
with a C extension) or slow to import; a spec needs only mappings, sequences and scalars. So:

* :func:`dump` writes block-style YAML that every YAML 1.1 and 1.2 reader reads back as the
  same data: a string is written plain only when no reader could take it for anything else
  (no leading digit, no ``yes``/``on``/``null``..., no ``: `` or `` #``), otherwise double-quoted
  with JSON escapes, which YAML's double-quoted style accepts;
* :func:`load` reads the block-style subset that CDI spec writers produce (ours, and
  nvidia-ctk's: compact ``- `` sequences, quoted and plain scalars, comments, simple flow
  collections). What it does not support (anchors, tags, block scalars, multi-line scalars,
  several documents) is an error naming the line, never a guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from ..errors import NvcError, escape
from ..records import record

MAX_DEPTH = 64

_PLAIN = re.compile(r"(?:[A-Za-z_/]|--?[A-Za-z_])[A-Za-z0-9_./=+@%~-]*(?::+[A-Za-z0-9_./=+@%~-]+)*")
_RESERVED = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})
_INT = re.compile(r"[-+]?[0-9]+")
_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")
_ESCAPES = {"0": "\0", "a": "\a", "b": "\b", "t": "\t", "\t": "\t", "n": "\n", "v": "\v", "f": "\f", "r": "\r",
            "e": "\x1b", " ": " ", '"': '"', "/": "/", "\\": "\\", "N": "\x85", "_": "\xa0", "L": "\u2028",
            "P": "\u2029"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_UNSUPPORTED = "&*!|>%@`"


# --- writing -----------------------------------------------------------------------------------


def dump(value: object, comments: Sequence[str] = ()) -> str:
    """``value`` (dicts, lists, str, int, bool, None) as a YAML document, after ``comments``."""
    lines = [f"# {c}".rstrip() for c in comments]
    if _is_block(value):
        _block(value, 0, lines)
    else:
        lines.append(scalar_text(value))
    return "\n".join(lines) + "\n"


def _is_block(value: object) -> bool:
    return isinstance(value, (dict, list)) and bool(value)


def _block(value, indent: int, lines: list[str]) -> None:
    if isinstance(value, dict):
        pad = " " * indent
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError("mapping keys must be strings")
            if _is_block(item):
                lines.append(f"{pad}{scalar_text(key)}:")
                _block(item, indent + 2, lines)
            else:
                lines.append(f"{pad}{scalar_text(key)}: {scalar_text(item)}")
        return
    pad = " " * indent
    for item in value:
        if _is_block(item):
            nested: list[str] = []
            _block(item, indent + 2, nested)
            nested[0] = pad + "- " + nested[0][indent + 2:]
            lines += nested
        else:
            lines.append(f"{pad}- {scalar_text(item)}")


def scalar_text(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict) and not value:
        return "{}"
    if isinstance(value, list) and not value:
        return "[]"
    if not isinstance(value, str):
        raise TypeError(f"cannot write {type(value).__name__} as YAML")
    if _PLAIN.fullmatch(value) and value.lower() not in _RESERVED:
        return value
    # JSON's escapes are YAML's, except that YAML has no surrogate pairs: \U for those.
    return _PAIR.sub(lambda m: f"{m.group(1)}\\U{_code_point(m.group(2), m.group(3)):08x}", json.dumps(value))


# A \uD8xx\uDCxx escape pair in JSON text, whose backslash is not itself escaped.
_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def _code_point(high: str, low: str) -> int:
    return 0x10000 + ((int(high, 16) - 0xD800) << 10) + (int(low, 16) - 0xDC00)


# --- reading -----------------------------------------------------------------------------------


@record(mutable=True)
class _Line:
    no: int
    indent: int
    text: str


def load(text: str, where: str) -> object:
    """Parse one YAML document of the supported subset; errors name ``where`` and the line."""
    lines = _lines(text, where)
    if not lines:
        return None
    parser = _Parser(lines, where)
    first = lines[0]
    if len(lines) == 1 and not _is_item(first.text) and parser.entry(first.text, first) is None:
        return parser.scalar(first.text, first)
    value = parser.block(first.indent, 0)
    if parser.pos < len(lines):
        parser.fail(lines[parser.pos], "unexpected indentation")
    return value


def _lines(text: str, where: str) -> list[_Line]:
    out: list[_Line] = []
    started = False
    for no, raw in enumerate(text.split("\n"), 1):
        raw = raw.removesuffix("\r")
        body = _strip_comment(raw).rstrip()
        content = body.lstrip(" ")
        if not content:
            continue
        if body[: len(body) - len(content)].count("\t") or content.startswith("\t"):
            raise NvcError("cdi", f"{where}: line {no}: tab in indentation")
        if content in ("---", "...") or content.startswith("--- "):
            if content == "---" and not started and not out:
                started = True
                continue
            if content == "...":
                break
            raise NvcError("cdi", f"{where}: line {no}: more than one YAML document")
        out.append(_Line(no, len(body) - len(content), content))
    return out


def _strip_comment(line: str) -> str:
    """``line`` without a trailing comment: a ``#`` at the start or after a blank, outside quotes."""
    quote = ""
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'" and (i == 0 or line[i - 1] in " \t-[{,:"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
        i += 1
    return line


def _is_item(text: str) -> bool:
    return text == "-" or text.startswith("- ")


class _Parser:
    def __init__(self, lines: list[_Line], where: str):
        self.lines = lines
        self.pos = 0
        self.where = where

    def fail(self, line: _Line, what: str):
        raise NvcError("cdi", f"{self.where}: line {line.no}: {what}")

    def block(self, indent: int, depth: int):
        if depth > MAX_DEPTH:
            self.fail(self.lines[self.pos], "nested too deeply")
        if _is_item(self.lines[self.pos].text):
            return self.sequence(indent, depth)
        return self.mapping(indent, depth)

    def sequence(self, indent: int, depth: int) -> list:
        items = []
        while self.pos < len(self.lines) and self.lines[self.pos].indent == indent and _is_item(self.lines[self.pos].text):
            line = self.lines[self.pos]
            rest = line.text[1:]
            body = rest.lstrip(" ")
            if not body:
                self.pos += 1
                items.append(self._nested(indent, depth, allow_same=False))
                continue
            column = indent + 1 + len(rest) - len(body)
            if _is_item(body) or self.entry(body, line) is not None:
                self.lines[self.pos] = _Line(line.no, column, body)
                items.append(self.block(column, depth + 1))
            else:
                items.append(self.scalar(body, line))
                self.pos += 1
        return items

    def mapping(self, indent: int, depth: int) -> dict:
        out: dict = {}
        while self.pos < len(self.lines) and self.lines[self.pos].indent == indent:
            line = self.lines[self.pos]
            if _is_item(line.text):
                self.fail(line, "a sequence item where a mapping key was expected")
            entry = self.entry(line.text, line)
            if entry is None:
                self.fail(line, f"expected 'key: value', got {escape(line.text, 60)}")
            key, value = entry
            if key in out:
                self.fail(line, f"duplicate key {escape(key, 60)}")
            self.pos += 1
            out[key] = self.scalar(value, line) if value else self._nested(indent, depth, allow_same=True)
        return out

    def _nested(self, indent: int, depth: int, *, allow_same: bool):
        """The block under a ``key:`` or ``-`` with nothing after it, or None if there is none.
        A sequence may sit at the key's own indentation (``key:`` then ``- item``)."""
        if self.pos >= len(self.lines):
            return None
        nxt = self.lines[self.pos]
        if nxt.indent > indent or (allow_same and nxt.indent == indent and _is_item(nxt.text)):
            return self.block(nxt.indent, depth + 1)
        return None

    def entry(self, text: str, line: _Line) -> tuple[str, str] | None:
        """(key, value text) when ``text`` is a mapping entry, else None."""
        if text[0] in "\"'":
            key, end = self._quoted(text, 0, line)
            if text[end:end + 1] != ":" or text[end + 1:end + 2] not in ("", " "):
                return None
            return key, text[end + 1:].strip()
        if text[0] in "[{" + _UNSUPPORTED + "?":
            return None
        match = re.search(r":(?: |$)", text)
        if match is None:
            return None
        return text[: match.start()].rstrip(), text[match.end():].strip()

    def scalar(self, text: str, line: _Line):
        if text[0] in "\"'":
            value, end = self._quoted(text, 0, line)
            if text[end:].strip():
                self.fail(line, "text after a quoted scalar")
            return value
        if text[0] in "[{":
            value, end = self._flow(text, 0, line, 0)
            if text[end:].strip():
                self.fail(line, "text after a flow collection")
            return value
        if text[0] in _UNSUPPORTED:
            self.fail(line, f"unsupported YAML ({escape(text[0])}: anchors, aliases, tags, block scalars)")
        return resolve_plain(text)

    def _quoted(self, text: str, start: int, line: _Line) -> tuple[str, int]:
        quote = text[start]
        out = []
        i = start + 1
        while i < len(text):
            ch = text[i]
            if quote == "'" and ch == "'":
                if text[i + 1:i + 2] == "'":
                    out.append("'")
                    i += 2
                    continue
                return "".join(out), i + 1
            if quote == '"' and ch == '"':
                return "".join(out), i + 1
            if quote == '"' and ch == "\\":
                code = text[i + 1:i + 2]
                if code in _ESCAPES:
                    out.append(_ESCAPES[code])
                    i += 2
                    continue
                width = _HEX_ESCAPES.get(code)
                digits = text[i + 2:i + 2 + width] if width else ""
                if not width or len(digits) != width or not re.fullmatch(r"[0-9a-fA-F]+", digits):
                    self.fail(line, "invalid escape in a double-quoted scalar")
                if int(digits, 16) > 0x10FFFF:
                    self.fail(line, "invalid code point in a double-quoted scalar")
                out.append(chr(int(digits, 16)))
                i += 2 + width
                continue
            out.append(ch)
            i += 1
        self.fail(line, "unterminated quoted scalar (multi-line scalars are not supported)")

    def _flow(self, text: str, i: int, line: _Line, depth: int):
        if depth > MAX_DEPTH:
            self.fail(line, "nested too deeply")
        closing = "]" if text[i] == "[" else "}"
        items: list = []
        entries: dict = {}
        i += 1
        while True:
            i = _skip_blanks(text, i)
            if i >= len(text):
                self.fail(line, "unterminated flow collection")
            if text[i] == closing:
                return (items if closing == "]" else entries), i + 1
            if closing == "}":
                key, i = self._flow_value(text, i, line, depth, stop=":,}")
                i = _skip_blanks(text, i)
                if text[i:i + 1] != ":" or not isinstance(key, str):
                    self.fail(line, "expected 'key: value' in a flow mapping")
                value, i = self._flow_value(text, i + 1, line, depth, stop=",}")
                if key in entries:
                    self.fail(line, f"duplicate key {escape(key, 60)}")
                entries[key] = value
            else:
                value, i = self._flow_value(text, i, line, depth, stop=",]")
                items.append(value)
            i = _skip_blanks(text, i)
            if text[i:i + 1] == ",":
                i += 1
            elif text[i:i + 1] != closing:
                self.fail(line, "expected ',' or the end of a flow collection")

    def _flow_value(self, text: str, i: int, line: _Line, depth: int, stop: str):
        i = _skip_blanks(text, i)
        if i >= len(text):
            self.fail(line, "unterminated flow collection")
        if text[i] in "[{":
            return self._flow(text, i, line, depth + 1)
        if text[i] in "\"'":
            return self._quoted(text, i, line)
        if text[i] in _UNSUPPORTED:
            self.fail(line, f"unsupported YAML ({escape(text[i])}: anchors, aliases, tags)")
        end = i
        while end < len(text) and text[end] not in stop and text[end] not in "[]{}":
            end += 1
        plain = text[i:end].strip()
        if not plain:
            self.fail(line, "empty value in a flow collection")
        return resolve_plain(plain), end


def _skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i] == " ":
        i += 1
    return i


def resolve_plain(text: str):
    """A plain scalar's value under YAML 1.2's core schema."""
    if text in ("null", "Null", "NULL", "~"):
        return None
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if _INT.fullmatch(text):
        return int(text)
    if re.fullmatch(r"0o[0-7]+", text):
        return int(text[2:], 8)
    if re.fullmatch(r"0x[0-9a-fA-F]+", text):
        return int(text[2:], 16)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text
