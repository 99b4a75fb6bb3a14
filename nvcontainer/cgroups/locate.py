"""Which devices cgroup a container process lives in, and where that cgroup is mounted.

The answer combines two kernel files: ``/proc/PID/cgroup`` gives the cgroup path inside each
hierarchy, the runtime's ``mountinfo`` gives where that hierarchy is mounted and which part of
it (the mount's root) is visible there. A host with a v1 ``devices`` controller is handled as
v1 even when a cgroup2 hierarchy exists next to it, as upstream does: that controller is the one
runtimes configure there.

Both files are parsed by pure functions; the readers around them only bound what is read.
"""

from __future__ import annotations

import errno
import os

from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from ..records import record

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:   # annotations only: collections.abc imports collections, a start's 1 ms
    from collections.abc import Callable, Iterable, Iterator

MAX_CGROUP_FILE = 64 * 1024        # one line per hierarchy; a few hundred bytes in practice
MAX_MOUNTINFO = 64 * 1024 * 1024   # hosts with many containers have tens of thousands of mounts
MAX_MOUNTINFO_LINE = 1024 * 1024   # overlay mounts with long lowerdir lists
MAX_UID_MAP = 64 * 1024

EXITED = "container exited during configuration"


@record
class CgroupTarget:
    version: int   # 1 or 2
    path: str      # the cgroup directory, e.g. /sys/fs/cgroup/devices/docker/<id>


@record
class CgroupMount:
    root: str        # part of the hierarchy the mount shows, "/" for the whole of it
    mountpoint: str


# --- pure parsing ----------------------------------------------------------------------------


def parse_proc_cgroup(text: str) -> tuple[int, str]:
    """(version, cgroup path) from the text of ``/proc/PID/cgroup``.

    More than one matching line means the file cannot be read unambiguously (a cgroup name with
    a newline in it could forge a line), so it is refused rather than guessed.
    """
    v1: list[str] = []
    v2: list[str] = []
    for line in text.split("\n"):
        if not line:
            continue
        parts = line.split(":", 2)
        if len(parts) != 3:
            raise NvcError("cgroup", f"malformed /proc/PID/cgroup line: {escape(line)}")
        hier_id, controllers, path = parts
        if "devices" in controllers.split(","):
            v1.append(path)
        elif hier_id == "0" and controllers == "":
            v2.append(path)
    if v1:
        version, paths = 1, v1
    elif v2:
        version, paths = 2, v2
    else:
        raise NvcError("cgroup", "no devices or unified cgroup entries found")
    if len(paths) > 1:
        raise NvcError("cgroup", f"ambiguous /proc/PID/cgroup: {len(paths)} cgroup v{version} device entries")
    return version, _checked_cgroup_path(paths[0])


def _checked_cgroup_path(path: str) -> str:
    if path.endswith(" (deleted)"):
        raise NvcError("cgroup", EXITED)
    if path == "/.." or path.startswith("/../"):
        raise NvcError("cgroup", f"container cgroup is outside this cgroup namespace: {escape(path)}")
    if not path.startswith("/") or any(part in (".", "..") for part in path.split("/")):
        raise NvcError("cgroup", f"invalid cgroup path: {escape(path)}")
    return path


_OCTAL = r"\\([0-7]{3})"   # compiled by re on first use
# what nvcontainer serve compiles before it forks (serve/server.py preload), so no request does
PATTERNS = (_OCTAL,)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as ``\\ooo``."""
    if "\\" not in field:   # nearly every field: no re (its import costs a start milliseconds)
        return field
    import re

    return re.sub(_OCTAL, lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo_line(line: str) -> tuple[str, str, str, list[str]] | None:
    """(root, mount point, fs type, super options) of one mountinfo line, None if malformed."""
    fields = line.split(" ")
    try:
        sep = fields.index("-", 6)
    except ValueError:
        return None
    if len(fields) < sep + 4:
        return None
    return _unescape(fields[3]), _unescape(fields[4]), fields[sep + 1], fields[sep + 3].split(",")


def find_cgroup_mount(lines: Iterable[str], version: int, cgroup_path: str,
                      visible: Callable[[str], bool] | None = None) -> CgroupMount:
    """The first mount of the right hierarchy that shows ``cgroup_path``.

    v1: a ``cgroup`` mount whose super options include ``devices``; v2: a ``cgroup2`` mount.
    A root starting with ``/..`` lies outside the reader's cgroup namespace: paths cannot be
    mapped onto it, so it is an error, as upstream. ``visible(line)``, if given, is asked
    about those mounts only, in order, and one it says no to counts as absent (the same
    answer as leaving its line out, for a fraction of the system calls: a v1 host lists a
    dozen hierarchies, and only the devices one is looked at).
    """
    seen = 0
    for line in lines:
        entry = parse_mountinfo_line(line)
        if entry is None:
            continue
        root, mountpoint, fstype, superopts = entry
        if version == 1 and (fstype != "cgroup" or "devices" not in superopts):
            continue
        if version == 2 and fstype != "cgroup2":
            continue
        if visible is not None and not visible(line):
            continue
        seen += 1
        if root == "/.." or root.startswith("/../"):
            raise NvcError("cgroup", f"cgroup mount {escape(mountpoint)} has a root outside this cgroup namespace")
        if root == "/" or cgroup_path == root or cgroup_path.startswith(root.rstrip("/") + "/"):
            return CgroupMount(root, mountpoint)
    what = "devices cgroup (v1)" if version == 1 else "cgroup2"
    if seen:
        raise NvcError("cgroup", f"no {what} mount shows the container cgroup {escape(cgroup_path)}")
    raise NvcError("cgroup", f"no {what} mount found")


def cgroup_dir(cgroup_path: str, mount: CgroupMount) -> str:
    """Directory of ``cgroup_path`` below ``mount``, with the mount's root stripped."""
    rel = cgroup_path if mount.root == "/" else cgroup_path[len(mount.root.rstrip("/")):]
    rel = rel.strip("/")
    return os.path.join(mount.mountpoint, rel) if rel else mount.mountpoint


def is_identity_map(text: str) -> bool:
    """Whether a ``uid_map`` is the initial namespace's ``0 0 4294967295``."""
    return [line.split() for line in text.splitlines() if line.strip()] == [["0", "0", "4294967295"]]


# --- readers ---------------------------------------------------------------------------------


def _open_proc(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except (FileNotFoundError, ProcessLookupError):
        raise NvcError("cgroup", EXITED) from None
    except OSError as exc:
        raise NvcError("cgroup", f"cannot open {escape(path)}: {exc.strerror.lower()}") from None


def _read_small(path: str, limit: int) -> str:
    fd = _open_proc(path)
    try:
        data, more = read_at_most(fd, limit)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise NvcError("cgroup", EXITED) from None
        raise NvcError("cgroup", f"cannot read {escape(path)}: {exc.strerror.lower()}") from None
    finally:
        os.close(fd)
    if more:
        raise NvcError("cgroup", f"{escape(path)} is larger than {limit} bytes")
    return os.fsdecode(data)


def mountinfo_lines(path: str) -> Iterator[str]:
    """Lines of a mountinfo file, streamed so the search can stop at the first match."""
    fd = _open_proc(path)
    total = 0
    try:
        with os.fdopen(fd, "rb", closefd=False) as stream:
            while True:
                line = stream.readline(MAX_MOUNTINFO_LINE + 1)
                if not line:
                    return
                total += len(line)
                if len(line) > MAX_MOUNTINFO_LINE or total > MAX_MOUNTINFO:
                    raise NvcError("cgroup", f"{escape(path)} is too large")
                yield os.fsdecode(line.rstrip(b"\n"))
    except OSError as exc:
        raise NvcError("cgroup", f"cannot read {escape(path)}: {exc.strerror.lower()}") from None
    finally:
        os.close(fd)


def locate(pid: int, mountinfo_pid: int | None = None, proc: str = "/proc") -> CgroupTarget:
    """The devices cgroup of ``pid``, as a directory in the mount namespace of ``mountinfo_pid``
    (the runtime; default: this process).

    A v1 devices line wins, as upstream, but only where that hierarchy is mounted: a runtime
    running in a mount namespace that shows only cgroup2 at /sys/fs/cgroup (while the kernel
    still has a v1 devices hierarchy elsewhere) uses cgroup v2, and so must we.
    """
    text = _read_small(f"{proc}/{pid}/cgroup", MAX_CGROUP_FILE)
    version, path = parse_proc_cgroup(text)
    mi_pid = "self" if mountinfo_pid is None else str(mountinfo_pid)
    lines = mountinfo_lines(f"{proc}/{mi_pid}/mountinfo")
    try:
        mountinfo = list(lines)
    finally:   # contextlib.closing, without contextlib's import
        lines.close()
    visible = _visible if mountinfo_pid is None and proc == "/proc" else None
    if version == 1:
        unified = [line for line in text.split("\n") if line.startswith("0::")]
        try:
            return CgroupTarget(1, cgroup_dir(path, find_cgroup_mount(mountinfo, 1, path, visible)))
        except NvcError:
            if len(unified) != 1:
                raise
            version, path = 2, _checked_cgroup_path(unified[0][3:])
    return CgroupTarget(version, cgroup_dir(path, find_cgroup_mount(mountinfo, version, path, visible)))


def _visible(line: str) -> bool:
    """Whether a cgroup mount listed in our mountinfo is the one its mount point shows.

    A mount covered by a later one (cgroup2 mounted over /sys/fs/cgroup) is still listed; its
    path then leads into the covering filesystem. Only cgroup lines are checked (cheap).
    """
    entry = parse_mountinfo_line(line)
    if entry is None or entry[2] not in ("cgroup", "cgroup2"):
        return True
    try:
        fd = os.open(entry[1], os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for info in f:
                if info.startswith("mnt_id:"):
                    return info.split()[1] == line.split(" ", 1)[0]
    finally:
        os.close(fd)
    return True


def in_user_namespace(pid: int, proc: str = "/proc") -> bool:
    """Whether ``pid`` runs in a user namespace with a non-identity uid map (rootless
    containers): its devices must already be allowed, and writing rules there would fail."""
    return not is_identity_map(_read_small(f"{proc}/{pid}/uid_map", MAX_UID_MAP))
