"""TOML for the engines' files: writing our own drop-ins, and the one-line edit of an operator's.

Why not a TOML library for the operator's file: ``tomllib`` only reads, and the writers that
exist rebuild a file from its data, losing every comment and the operator's layout. The only
change ``setup`` makes to containerd's own ``config.toml`` is one entry of ``imports``; that is
done here as a textual edit, and every edit is checked by reading the result back with
``tomllib``: the new document must equal the old one plus exactly that entry, or nothing is
written. Our drop-ins are whole files of ours, written from plain data by :func:`dumps` (strings,
integers, booleans, lists of those, nested tables), which is all containerd's and CRI-O's
runtime tables need.
"""

from __future__ import annotations

import json
import re
import tomllib

from ..documents import toml_value
from ..errors import NvcError, escape

_BARE = re.compile(r"[A-Za-z0-9_-]+")
MAX_DOCUMENT = 16 << 20     # an engine's TOML configuration: far less


def parse(text: str, where: str) -> dict:
    """The document, or one line naming the file and the fault."""
    return toml_value(text, f"{escape(where)}: not valid TOML", cap=MAX_DOCUMENT, category="setup")


def _key(key: str) -> str:
    return key if _BARE.fullmatch(key) else json.dumps(key)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)   # a JSON string is a valid TOML basic string for our values
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):   # inline table: only inside lists
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise NvcError("setup", f"cannot write {type(value).__name__} values to TOML")


def dumps(doc: dict, header: str = "") -> str:
    """``doc`` as TOML: plain keys first, then one ``[table]`` section per nested table."""
    out = [header] if header else []

    def table(path: tuple[str, ...], data: dict) -> None:
        plain = [(k, v) for k, v in data.items() if not isinstance(v, dict)]
        nested = [(k, v) for k, v in data.items() if isinstance(v, dict)]
        if path and (plain or not nested):
            out.append("\n[" + ".".join(_key(p) for p in path) + "]\n")
        out.extend(f"{_key(k)} = {_value(v)}\n" for k, v in plain)
        for k, v in nested:
            table((*path, k), v)

    table((), doc)
    text = "".join(out)
    if tomllib.loads(text) != doc:   # our own writer, checked against the standard reader
        raise NvcError("setup", "internal error: the TOML written does not read back as the data")
    return text


# --- the one edit of an operator's file: an entry of the top-level `imports` ---------------------


def _top_region(text: str) -> int:
    """Where the top-level keys end: the offset of the first table header (or the end)."""
    m = re.search(r"^[ \t]*\[", text, re.M)
    return m.start() if m else len(text)


def _imports_span(text: str) -> tuple[int, int] | None:
    """(start of the ``[`` of the imports array, offset after its ``]``), top level only."""
    region = text[:_top_region(text)]
    m = re.search(r"^[ \t]*imports[ \t]*=[ \t]*\[", region, re.M)
    if not m:
        return None
    i, depth, quote = m.end(), 1, None
    while i < len(text) and depth:
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            i = text.find("\n", i)
            if i < 0:
                return None
            continue
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        i += 1
    return (m.end() - 1, i) if not depth else None


def _checked(old_doc: dict, text: str, imports: list, where: str, what: str) -> str:
    new = parse(text, where)
    expect = dict(old_doc)
    if imports:
        expect["imports"] = imports
    else:
        expect.pop("imports", None)
    if new != expect:
        raise NvcError("setup", f"{escape(where)}: cannot {what} by a one-line edit (an unusual layout); "
                                "make that change by hand and run setup again")
    return text


def add_import(text: str, entry: str, where: str) -> str:
    """``text`` with ``entry`` appended to its top-level ``imports`` (made if absent)."""
    doc = parse(text, where)
    current = doc.get("imports", [])
    if not isinstance(current, list):
        raise NvcError("setup", f"{escape(where)}: imports is not a list")
    if entry in current:
        return text
    quoted = json.dumps(entry)
    span = _imports_span(text)
    if span is None:
        version = re.search(r"^[ \t]*version[ \t]*=.*\n", text[:_top_region(text)], re.M)
        at = version.end() if version else 0
        new = f"{text[:at]}imports = [{quoted}]\n{text[at:]}"
    else:
        start, end = span
        inner = text[start + 1:end - 1]
        body = inner.rstrip()
        if not body.strip():
            new = f"{text[:start]}[{quoted}]{text[end:]}"
        elif "#" in body.splitlines()[-1] or "\n" in inner.strip():
            # a list over several lines: one more line before the closing bracket
            comma = "" if body.rstrip().endswith(",") else ","
            indent = re.match(r"\s*", inner.lstrip("\n")).group(0) if "\n" in inner else "  "
            new = f"{text[:start + 1]}{body}{comma}\n{indent}{quoted},\n{text[end - 1:]}"
        else:
            comma = "" if body.endswith(",") else ","
            new = f"{text[:start + 1]}{body}{comma} {quoted}{inner[len(body):]}{text[end - 1:]}"
    return _checked(doc, new, [*current, entry], where, f'add "{escape(entry)}" to its imports')


def remove_import(text: str, entry: str, where: str) -> str:
    """``text`` without ``entry`` in its ``imports``; the key goes too when that leaves it empty
    and it is a line of its own."""
    doc = parse(text, where)
    current = doc.get("imports", [])
    if not isinstance(current, list) or entry not in current:
        return text
    left = [i for i in current if i != entry]
    quoted = re.escape(json.dumps(entry))
    if not left:
        new = re.sub(r"^[ \t]*imports[ \t]*=[ \t]*\[\s*" + quoted + r"\s*,?\s*\][ \t]*\n?", "", text, count=1,
                     flags=re.M)
    else:
        # after another entry: the comma before it goes; first: the comma after it
        new = re.sub(r",[ \t]*\n?[ \t]*" + quoted + r"(?=[ \t]*(,|#|\n|\]))", "", text, count=1)
        if new == text:
            new = re.sub(quoted + r"[ \t]*,[ \t]*\n?[ \t]*", "", text, count=1)
    return _checked(doc, new, left, where, f'remove "{escape(entry)}" from its imports')
