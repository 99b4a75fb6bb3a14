"""Reading the running containers and the GPU processes from this host's procfs and cgroups.

A container is found as the kernel shows it, whatever started it: its init is a process whose
pid namespace differs from its parent's. For each, its device cgroup (``cgroups.locate``) and
what that cgroup allows of the GPU minors (``cgroups.access``), and the ``/dev/nvidiaN`` mounts
in its mount table that are the GPU's device node (checked in its root, in-root). A process that exits while it is read is skipped without a word: ``ps`` is
a snapshot, and a container that ended during it is simply not in it. Every file is a procfs or
cgroupfs file opened without following a symlink, read with a bound.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from contextlib import closing

from .. import log
from ..cgroups import access
from ..cgroups.locate import locate, mountinfo_lines, parse_mountinfo_line
from ..errors import NvcError, escape
from ..fs.inroot import open_in_root
from ..inventory.procfs import read_text
from ..leases.liveness import start_time
from .model import Container

MAX_STAT = 4096
_DEV_NODE = re.compile(r"/dev/nvidia([0-9]{1,3})")


def _read(path: str, limit: int) -> str | None:
    """A procfs file, None when its process is gone (or it cannot be read)."""
    try:
        return read_text(path, limit)
    except OSError:
        return None


def pidns(pid: int | str, proc: str = "/proc") -> str:
    try:
        return os.readlink(f"{proc}/{pid}/ns/pid")
    except OSError:
        return ""


def parent_of(stat_text: str) -> int | None:
    """The ppid field of ``/proc/PID/stat`` (after the command, which may hold anything)."""
    _, sep, rest = stat_text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 2 or not fields[1].isdigit():
        return None
    return int(fields[1])


def command(pid: int, proc: str = "/proc") -> str:
    return escape((_read(f"{proc}/{pid}/comm", 64) or "").strip())


MAX_CMDLINE = 4096   # read of /proc/PID/cmdline
SHOWN_CMDLINE = 200


def cmdline(pid: int, proc: str = "/proc") -> str:
    """The command line of ``pid``, arguments joined by spaces, cut to :data:`SHOWN_CMDLINE`
    characters and escaped (a container's process chooses it); "" when gone or empty."""
    text = (_read(f"{proc}/{pid}/cmdline", MAX_CMDLINE) or "").rstrip("\0").replace("\0", " ")
    return escape(text, SHOWN_CMDLINE) if text else ""


def container_inits(proc: str = "/proc") -> list[tuple[int, str]]:
    """(pid, pid namespace) of every process whose pid namespace is not its parent's."""
    mine = pidns("self", proc)
    found = []
    try:
        names = [n for n in os.listdir(proc) if n.isdigit()]
    except OSError as exc:
        raise NvcError("input", f"cannot list {escape(proc)}: {exc.strerror.lower()}") from None
    spaces: dict[int, str] = {}
    for name in names:
        spaces[int(name)] = pidns(name, proc)
    for pid, space in spaces.items():
        if not space or space == mine:
            continue
        ppid = parent_of(_read(f"{proc}/{pid}/stat", MAX_STAT) or "")
        if ppid is None:
            continue
        parent = spaces.get(ppid) or pidns(ppid, proc)
        if parent != space:
            found.append((pid, space))
    return sorted(found)


def mounted_minors(lines: Iterable[str]) -> tuple[int, ...]:
    """GPU minors of the ``/dev/nvidiaN`` mount points in a mount table (pure)."""
    minors = set()
    for line in lines:
        entry = parse_mountinfo_line(line)
        m = _DEV_NODE.fullmatch(entry[1]) if entry else None
        if m and int(m.group(1)) < 254:
            minors.add(int(m.group(1)))
    return tuple(sorted(minors))


def device_nodes(pid: int, minors: Iterable[int], major: int, proc: str = "/proc") -> tuple[int, ...]:
    """Those ``minors`` whose ``/dev/nvidiaN`` in the container is really ``c major:N``: a mount
    point alone could be anything the container mounted there. Resolved inside the container's
    root, never following a symbolic link out of it; () when the process is gone."""
    try:
        root = os.open(f"{proc}/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return ()
    found = []
    try:
        for minor in minors:
            try:
                fd = open_in_root(root, f"/dev/nvidia{minor}", os.O_PATH, follow_last=False)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor):
                found.append(minor)
    finally:
        os.close(root)
    return tuple(found)


def _vanished(exc: NvcError) -> bool:
    return "exited" in exc.detail or "went away" in exc.detail or "is outside this cgroup namespace" in exc.detail


def cgroup_of(pid: int, proc: str = "/proc") -> tuple[int, str] | None:
    """(cgroup version, device cgroup directory) of a process, None when it is gone."""
    try:
        target = locate(pid, proc=proc)
    except NvcError as exc:
        if not _vanished(exc):
            log.info(f"ps: process {pid}: {exc.detail}")
        return None
    return target.version, target.path


def read_container(pid: int, space: str, gpu_minors: Iterable[int], major: int, proc: str = "/proc") -> Container | None:
    """One container's facts, None when its init went away while it was read."""
    where = cgroup_of(pid, proc)
    if where is None:
        return None
    version, directory = where
    try:
        minors, everything = access.allowed_minors(version, directory, major, gpu_minors)
    except NvcError as exc:
        if _vanished(exc):
            return None
        log.warning(f"ps: container {pid}: {exc.detail}")
        minors, everything = frozenset(), False
    try:
        with closing(mountinfo_lines(f"{proc}/{pid}/mountinfo")) as lines:
            mounts = device_nodes(pid, mounted_minors(lines), major, proc)
    except NvcError as exc:
        if _vanished(exc):
            return None
        log.warning(f"ps: container {pid}: {exc.detail}")
        mounts = ()
    start = start_time(pid, proc)
    if start is None:
        return None
    return Container(pid=pid, start=start, cgroup=directory, pidns=space, cgroup_minors=tuple(sorted(minors)),
                     cgroup_all=everything, mount_minors=mounts)
