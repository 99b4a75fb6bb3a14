"""Key-level edits of an operator's JSON file (Docker's ``daemon.json``): set some keys, keep every
other key, their order and the file's indentation, and take exactly those keys back on undo.

Pure: text in, text out. A file that is not a JSON object is one line naming the file and the
fault, and nothing is written.
"""

from __future__ import annotations

import copy
import json
import re

from ..documents import json_value
from ..errors import NvcError, escape

MAX_DOCUMENT = 16 << 20     # an engine's JSON configuration: far less

ABSENT = {"nvcontainer-setup": "absent"}   # in an undo record: the key was not there


def parse(text: str | None, where: str) -> dict:
    if text is None or not text.strip():
        return {}
    doc = json_value(text, escape(where), cap=MAX_DOCUMENT, category="setup")
    if not isinstance(doc, dict):
        raise NvcError("setup", f"{escape(where)}: not a JSON object")
    return doc


def _indent(text: str | None) -> str | int:
    m = re.search(r'^([ \t]+)"', text or "", re.M)
    if not m:
        return 2
    return m.group(1) if "\t" in m.group(1) else len(m.group(1))


def dumps(doc: dict, like: str | None) -> str:
    return json.dumps(doc, indent=_indent(like), ensure_ascii=False) + "\n"


def _parent(doc: dict, key: tuple[str, ...], where: str, make: bool) -> dict | None:
    node = doc
    for i, part in enumerate(key[:-1]):
        nxt = node.get(part)
        if nxt is None and make:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            if nxt is None:
                return None
            raise NvcError("setup", f"{escape(where)}: {escape('.'.join(key[:i + 1]))} is not a JSON object")
        node = nxt
    return node


def get(doc: dict, key: tuple[str, ...]) -> object:
    node: object = doc
    for part in key:
        if not isinstance(node, dict) or part not in node:
            return ABSENT
        node = node[part]
    return node


def set_keys(text: str | None, where: str, wanted: list[tuple[tuple[str, ...], object]]) -> tuple[str, tuple]:
    """The new text, and ((key, value set, value before), ...) for each key that changes."""
    doc = parse(text, where)
    new = copy.deepcopy(doc)
    changed = []
    for key, value in wanted:
        before = get(new, key)
        if before == value:
            continue
        _parent(new, key, where, make=True)[key[-1]] = value
        changed.append((key, value, before))
    if not changed:
        return (text or ""), ()
    return dumps(new, text), tuple(changed)


def unset_keys(text: str | None, where: str, recorded: list) -> tuple[str, list[str]]:
    """The text with each recorded key put back as it was, where it still holds what setup set;
    and the keys left alone because they changed since."""
    doc = parse(text, where)
    left = []
    for key, ours, before in recorded:
        key = tuple(key)
        if get(doc, key) != ours:
            left.append(".".join(key))
            continue
        if before == ABSENT:
            parents = [(_parent(doc, key[:i + 1], where, make=False), key[i]) for i in range(len(key))]
            del parents[-1][0][key[-1]]
            for node, part in reversed(parents[:-1]):   # tables that only held our key
                if node is not None and node.get(part) == {}:
                    del node[part]
        else:
            _parent(doc, key, where, make=True)[key[-1]] = before
    return dumps(doc, text), left
