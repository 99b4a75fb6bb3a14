"""The requirement language of ``--require`` and the images' ``NVIDIA_REQUIRE_*`` variables.

An expression is alternatives separated by spaces (any one may hold), each a comma-separated list
of terms (all must hold), each term ``<name><op><value>``::

    cuda>=12.4 brand=tesla,driver>=470,driver<471

``cuda`` and ``driver`` are the host's versions; ``arch`` (compute capability) and ``brand`` are
properties of each selected GPU. Versions are digits and dots, compared number by number with
missing trailing numbers read as 0 (``12.4`` equals ``12.4.0``). Brands compare without case and
only with ``=`` or ``!=``.

Upstream's failure message names only the first alternative; the usual reader is someone whose new
CUDA image will not start on an old driver, so ours also says which term failed, the host's CUDA
and driver versions and the GPU it failed on.
"""

from __future__ import annotations

from ..errors import NvcError, escape
from ..records import record

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:   # annotations only: collections.abc imports collections, a start's 1 ms
    from collections.abc import Iterable, Sequence

MAX_LENGTH = 4096
MAX_EXPRESSIONS = 32

# Patterns are strings, compiled by re on first use (and cached there): the hook imports this
# module on every start and most starts match none of them.
_TERM = r"(?s)([A-Za-z]+)(<=|>=|!=|=|<|>)(.*)"
_VERSION = r"[0-9]+(?:\.[0-9]+)*"
_BRAND = r"[A-Za-z0-9_-]+"
# what nvcontainer serve compiles before it forks (serve/server.py preload), so no request does
PATTERNS = (_TERM, _VERSION, _BRAND)
_NAMES = ("cuda", "driver", "arch", "brand")
_UPDATE_HINT = ", please update your driver to a newer version, or use an earlier cuda container"


@record
class Term:
    name: str            # lower case: cuda, driver, arch or brand
    op: str
    value: str
    text: str            # as written, for messages

    def holds(self, cuda: str, driver: str, gpu: tuple[str, str] | None) -> bool:
        """``gpu`` is ``(arch, brand)``; without one, GPU terms hold (nothing to check)."""
        if self.name == "brand":
            if gpu is None:
                return True
            return (gpu[1].lower() == self.value.lower()) == (self.op == "=")
        if self.name == "arch":
            if gpu is None:
                return True
            have = gpu[0]
        else:
            have = cuda if self.name == "cuda" else driver
        return _compare(_version(have, self.name), self.op, _version(self.value, self.name))


@record
class Expression:
    text: str
    alternatives: tuple[tuple[Term, ...], ...]


def _version(text: str, what: str) -> tuple[int, ...]:
    import re   # here: only images with requirements (NVIDIA_REQUIRE_*) pay its import

    if not re.fullmatch(_VERSION, text):
        raise NvcError("requirement", f"cannot compare versions: the {what} version is '{escape(text, 60)}'")
    return tuple(int(p) for p in text.split("."))


def _compare(have: tuple[int, ...], op: str, want: tuple[int, ...]) -> bool:
    width = max(len(have), len(want))
    a = have + (0,) * (width - len(have))
    b = want + (0,) * (width - len(want))
    return {"=": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]


def _invalid(expr: str, term: str, why: str) -> NvcError:
    return NvcError("requirement", f"invalid expression: {escape(expr)} (term '{escape(term, 60)}': {why})")


def _term(expr: str, text: str) -> Term:
    import re

    m = re.fullmatch(_TERM, text)
    if not m:
        raise _invalid(expr, text, "expected <name><op><value> with op one of = != < <= > >=")
    name, op, value = m.group(1).lower(), m.group(2), m.group(3)
    if name not in _NAMES:
        raise _invalid(expr, text, "the name must be cuda, driver, arch or brand")
    if name == "brand":
        if op not in ("=", "!="):
            raise _invalid(expr, text, "brand takes only = or !=")
        if not re.fullmatch(_BRAND, value):
            raise _invalid(expr, text, "a brand is letters, digits, '-' and '_'")
    elif not re.fullmatch(_VERSION, value):
        raise _invalid(expr, text, "a version is digits separated by dots")
    return Term(name, op, value, text)


def parse(expr: str) -> Expression:
    if not isinstance(expr, str):
        raise NvcError("requirement", "invalid expression: not a string")
    if len(expr) > MAX_LENGTH:
        raise NvcError("requirement", f"invalid expression: longer than {MAX_LENGTH} characters: {escape(expr)}")
    alternatives = []
    for alt in expr.split(" "):
        if alt:
            alternatives.append(tuple(_term(expr, t) for t in alt.split(",") if t))
    alternatives = [a for a in alternatives if a]
    if not alternatives:
        raise NvcError("requirement", f"invalid expression: {escape(expr)} (no condition in it)")
    return Expression(expr, tuple(alternatives))


def parse_all(exprs: Iterable[str]) -> tuple[Expression, ...]:
    exprs = list(exprs)
    if len(exprs) > MAX_EXPRESSIONS:
        raise NvcError("requirement", f"too many requirements: {len(exprs)} (at most {MAX_EXPRESSIONS})")
    return tuple(parse(e) for e in exprs)


def _failure(expr: Expression, cuda: str, driver: str, gpu: tuple[str, str, str] | None) -> NvcError:
    first = expr.alternatives[0]
    state = None if gpu is None else (gpu[0], gpu[1])
    failed = next(t for t in first if not t.holds(cuda, driver, state))
    head = ",".join(t.text for t in first)
    detail = f"unsatisfied condition: {escape(head)}"
    if head.startswith("cuda>="):
        detail += _UPDATE_HINT
    detail += f" (failed term: {escape(failed.text, 60)}; host CUDA {escape(cuda, 40)}, driver {escape(driver, 40)}"
    if gpu is not None:
        detail += f"; GPU {escape(gpu[2], 80)}, arch {escape(gpu[0], 20)}, brand {escape(gpu[1], 40)}"
    others = len(expr.alternatives) - 1
    if others:
        detail += f"; the {others} other alternative{'s' if others > 1 else ''} failed too"
    return NvcError("requirement", detail + ")")


def evaluate(exprs: Iterable[str], cuda: str, driver: str, gpus: Sequence[tuple[str, str, str]]) -> None:
    """Raise unless every expression holds for every selected GPU.

    ``gpus`` holds ``(arch, brand, label)`` per selected GPU (a MIG device counts as its parent);
    ``label`` names it in the message and should carry the index and UUID, e.g.
    ``0 (GPU-5f8e...)``. With no GPU selected each expression is checked once and its arch and
    brand terms hold, as upstream does. All expressions are parsed before any is evaluated, so a
    malformed one is reported even when an earlier one fails.
    """
    each: Sequence[tuple[str, str, str] | None] = gpus or [None]
    for expr in parse_all(exprs):
        for gpu in each:
            state = None if gpu is None else (gpu[0], gpu[1])
            if not any(all(t.holds(cuda, driver, state) for t in alt) for alt in expr.alternatives):
                raise _failure(expr, cuda, driver, gpu)
