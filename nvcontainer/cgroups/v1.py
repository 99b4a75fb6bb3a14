"""cgroup v1: allow devices by writing rules to the cgroup's ``devices.allow``.

The directory is opened once without following a final symlink and checked to be on a
cgroupfs; ``devices.allow`` is then opened relative to that fd and never created. So the rules
can only land in a real cgroup's control file, never in some ordinary file a path mix-up (or a
directory swapped in by someone else) would point at.
"""

from __future__ import annotations

import errno
import os

from ..errors import NvcError, escape
from ..fs.syscalls import CGROUP_SUPER_MAGIC, fstatfs_type
from .locate import EXITED
from .rules import Rule

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:   # annotations only: collections.abc imports collections, a start's 1 ms
    from collections.abc import Sequence

_GONE = (errno.ENOENT, errno.ENODEV)


def allow(cgroup_dir: str, rules: Sequence[Rule]) -> str:
    """Append each rule to ``devices.allow``, one write per rule as the kernel parses them."""
    try:
        dirfd = os.open(cgroup_dir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _GONE:
            raise NvcError("cgroup", EXITED) from None
        raise NvcError("cgroup", f"cannot open {escape(cgroup_dir)}: {exc.strerror.lower()}") from None
    try:
        if fstatfs_type(dirfd) != CGROUP_SUPER_MAGIC:
            raise NvcError("cgroup", f"{escape(cgroup_dir)} is not a cgroup v1 directory")
        try:
            fd = os.open("devices.allow", os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        except OSError as exc:
            if exc.errno in _GONE:
                raise NvcError("cgroup", EXITED) from None
            raise NvcError(
                "cgroup", f"cannot open {escape(cgroup_dir)}/devices.allow: {exc.strerror.lower()}"
            ) from None
    finally:
        os.close(dirfd)
    try:
        for rule in rules:
            data = rule.text.encode()
            try:
                written = os.write(fd, data)
            except OSError as exc:
                if exc.errno in _GONE:
                    raise NvcError("cgroup", EXITED) from None
                raise NvcError(
                    "cgroup",
                    f"cannot add rule '{rule.text}' to {escape(cgroup_dir)}/devices.allow: {exc.strerror.lower()}",
                ) from None
            if written != len(data):
                raise NvcError("cgroup", f"short write of rule '{rule.text}' to {escape(cgroup_dir)}/devices.allow")
    finally:
        os.close(fd)
    return f"cgroup v1 {escape(cgroup_dir)}: allowed {len(rules)} device(s)"
