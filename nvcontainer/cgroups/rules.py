"""Device cgroup rules as plain values, shared by the v1 and the eBPF back ends.

A rule names exactly one device: no ``a`` type and no ``*`` wildcard can be expressed, so a
bug or a hostile input can widen a container's device access by one node at most. Rules are
meant to be built from the ``st_rdev`` of verified host nodes; :func:`parse_rule` exists for
configuration and tests and accepts only the same strict form.
"""

from __future__ import annotations

from ..errors import NvcError, escape
from ..records import record

# Linux dev_t: 12-bit major, 20-bit minor (include/linux/kdev_t.h).
MAX_MAJOR = (1 << 12) - 1
MAX_MINOR = (1 << 20) - 1

TYPES = ("c", "b")
ACCESS_ORDER = "rwm"


def _number(text: str) -> bool:
    """``[0-9]{1,7}``."""
    return 0 < len(text) <= 7 and text.isascii() and text.isdigit()


def _split(text: str) -> tuple[str, str, str, str] | None:
    """The groups of ``([cb]) ([0-9]{1,7}):([0-9]{1,7}) ([rwm]{1,3})`` matching all of ``text``,
    else None: without re, whose import costs every container start milliseconds."""
    parts = text.split(" ")
    if len(parts) != 3:
        return None
    kind, numbers, access = parts
    major, colon, minor = numbers.partition(":")
    if kind not in TYPES or not colon or not _number(major) or not _number(minor):
        return None
    if not 0 < len(access) <= 3 or access.strip(ACCESS_ORDER):
        return None
    return kind, major, minor, access


@record
class Rule:
    type: str     # 'c' (character) or 'b' (block)
    major: int
    minor: int
    access: str   # non-empty subset of "rwm", in that order

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise NvcError("cgroup", f"invalid device rule type: {escape(self.type)}")
        for name, value, top in (("major", self.major, MAX_MAJOR), ("minor", self.minor, MAX_MINOR)):
            if type(value) is not int or not 0 <= value <= top:
                raise NvcError("cgroup", f"invalid device {name} in rule: {escape(value)}")
        if (
            not isinstance(self.access, str)
            or not self.access
            or "".join(c for c in ACCESS_ORDER if c in self.access) != self.access
        ):
            raise NvcError("cgroup", f"invalid device access in rule: {escape(self.access)}")

    @property
    def text(self) -> str:
        """The line the kernel's v1 ``devices.allow`` understands."""
        return f"{self.type} {self.major}:{self.minor} {self.access}"


def parse_rule(text: str) -> Rule:
    """``"c 195:0 rw"`` → Rule; access letters may come in any order but not repeat."""
    groups = _split(text)
    if groups is None:
        raise NvcError("cgroup", f"invalid device rule: {escape(text)}")
    kind, major, minor, access = groups
    if len(set(access)) != len(access):
        raise NvcError("cgroup", f"invalid device rule: {escape(text)}")
    return Rule(kind, int(major), int(minor), "".join(c for c in ACCESS_ORDER if c in access))
