"""The unprivileged identity that loads NVML (``--user``), as upstream defines it."""

from __future__ import annotations

import os
import pwd
import grp

from ..errors import NvcError, escape


def overflow_ids() -> tuple[int, int]:
    ids = []
    for name in ("overflowuid", "overflowgid"):
        try:
            with open(f"/proc/sys/kernel/{name}") as f:
                ids.append(int(f.read(32).strip()))
        except (OSError, ValueError):
            ids.append(65534)
    return ids[0], ids[1]


def parse_user(value: str | None) -> tuple[int, int]:
    """``UID[:GID]`` by number or name; ``""`` means the caller's own ids.

    A UID without a GID takes the GID of its passwd entry, as nvidia-container-cli does.
    """
    if value is None:
        return overflow_ids()
    if value == "":
        return os.geteuid(), os.getegid()
    user, sep, group = value.partition(":")
    uid, default_gid = _uid(user, value)
    if not sep:
        if default_gid is None:
            raise NvcError("input", f"invalid user: {escape(value)}: no group for uid {uid}")
        return uid, default_gid
    return uid, _gid(group, value)


def _uid(token: str, whole: str) -> tuple[int, int | None]:
    if token.isascii() and token.isdigit():
        uid = int(token)
        try:
            return uid, pwd.getpwuid(uid).pw_gid
        except (KeyError, OverflowError):
            return uid, None
    try:
        entry = pwd.getpwnam(token)
    except KeyError:
        raise NvcError("input", f"invalid user: {escape(whole)}: unknown user") from None
    return entry.pw_uid, entry.pw_gid


def _gid(token: str, whole: str) -> int:
    if token.isascii() and token.isdigit():
        return int(token)
    try:
        return grp.getgrnam(token).gr_gid
    except KeyError:
        raise NvcError("input", f"invalid user: {escape(whole)}: unknown group") from None
