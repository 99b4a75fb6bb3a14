"""JSON and TOML documents from outside, parsed within bounds: the one place every reader of an
API server's answer, a claim's record, a kubelet's reply or an operator's file goes through.

Why one helper: each parser has its own ways to fail besides a syntax error, and each was met
in the wild as a traceback rather than a line: nesting deep enough to exhaust the stack
(``RecursionError``; JSON nested 100,000 deep from an API server), an integer of more than
4300 digits (``ValueError`` from ``int``), bytes that are not UTF-8, and a size nobody bounded.
So: the size is checked before a byte is parsed, and so is a JSON text's nesting (in C-speed
passes, linear on any text, and only when it has more brackets than the bound: no value of a
million lists is built to be refused); a TOML value's nesting after (``[a.b.c...]`` headers nest
without brackets); and every failure is one :class:`NvcError` line naming ``what`` was read.
The callers keep their own policy: the bound, the error category, what shape the value must
have.
"""

from __future__ import annotations

from . import jsontext
from .errors import NvcError, escape

MAX_DEPTH = 64             # no document we read nests deeper than a dozen levels
# A string to its closing quote or to the end: it cannot fail, so it never backtracks, and the
# pass is linear on any text, valid or not. (re compiles these on first use: the hook's start
# never imports re.)
_STRING = r'"[^"\\]*(?:\\(?:.|\Z)[^"\\]*)*(?:"|\Z)'
_NOT_BRACKET = r"[^\[\]{}]+"
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")   # openers +1, closers -1 as signed bytes


def json_value(data, what: str, *, cap: int, depth: int | None = MAX_DEPTH, category: str = "input", **hooks):
    """``data`` (bytes or str) as JSON; ``hooks``: ``object_pairs_hook``/``parse_constant`` as
    ``json.loads`` takes them. One line naming ``what`` for anything but a value within bounds.
    ``depth`` None: only the parser's own bound (the interpreter's recursion limit), for the
    hook's start, where a depth pass over a runtime's seccomp-laden spec would cost a
    millisecond of every container start."""
    if not isinstance(data, (bytes, bytearray, str)):
        raise NvcError(category, f"{what}: expected bytes")
    if len(data) > cap:
        raise NvcError(category, f"{what}: larger than {cap} bytes")
    try:
        text = bytes(data).decode("utf-8") if not isinstance(data, str) else data
        if depth is not None and _too_deep(text, depth):      # before a million lists are built
            raise NvcError(category, f"{what}: JSON nested deeper than {depth} levels")
        value = jsontext.loads(text, **hooks)
    except RecursionError:
        bound = f"deeper than {depth} levels" if depth is not None else "too deeply"
        raise NvcError(category, f"{what}: JSON nested {bound}") from None
    except UnicodeError:
        raise NvcError(category, f"{what}: invalid JSON: not UTF-8") from None
    except ValueError as exc:     # JSONDecodeError, and int()'s digit limit
        raise NvcError(category, f"{what}: invalid JSON: {escape(exc, 120)}") from None
    return value


def toml_value(text: str, what: str, *, cap: int, depth: int = MAX_DEPTH, category: str = "input") -> dict:
    """``text`` as TOML (tomllib), with the same bounds and one line for every failure."""
    import tomllib

    if len(text) > cap:
        raise NvcError(category, f"{what}: larger than {cap} bytes")
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise NvcError(category, f"{what}: nested deeper than {depth} levels") from None
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise NvcError(category, f"{what}: {escape(exc, 200)}") from None
    if _value_deeper(value, depth):      # [a.b.c...] headers nest without brackets
        raise NvcError(category, f"{what}: nested deeper than {depth} levels")
    return value


def _too_deep(text: str, limit: int) -> bool:
    """Whether JSON ``text`` nests deeper than ``limit``, before it is parsed. A text with no
    more openers than the bound cannot; otherwise, strings taken out, the brackets become +1
    and -1 and the deepest point is the largest running sum, all of it in C (a pass per level
    was seconds on 8 MiB of brackets)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    import itertools
    import re

    brackets = re.sub(_NOT_BRACKET, "", re.sub(_STRING, "", text, flags=re.S)).encode("ascii").translate(_STEPS)
    return max(itertools.accumulate(memoryview(brackets).cast("b")), default=0) > limit


def _value_deeper(value, limit: int) -> bool:
    """Whether a parsed value's containers nest deeper than ``limit`` (iteratively: the check
    must not be what exhausts the stack)."""
    level = [value]
    for _ in range(limit):
        level = [v for c in level if isinstance(c, (dict, list))
                 for v in (c.values() if isinstance(c, dict) else c)]
        if not any(isinstance(v, (dict, list)) for v in level):
            return False
    return True
