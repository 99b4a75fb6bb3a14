"""The inventory cache's directory and files: where entries live, and how they are read,
written and kept few.

Why apart from :mod:`.cache`: what an entry means (its key, its checks against the machine) is
one concern; keeping a root-only directory of files that a hostile process might race is
another. Every file is opened relative to the directory's fd without following symlinks, must
be a private regular file of ours with one link, is read bounded, and is replaced atomically
(temporary file, rename). A miss takes an exclusive lock, so 32 containers starting at once
after boot wait for one NVML initialisation, not 32.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from .. import jsontext, log
from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from ..fs.private import flock_within, write_new

MAX_FILE = 4 << 20
MAX_ENTRIES = 16          # cache files kept in the directory (one per configuration and program)
MAX_PROGRAMS = 4          # of them per configuration: the newest programs' (an upgrade's, a second install's)
STALE_TEMP_S = 60         # a temporary file this old was left by a killed writer
PREFIX = "inventory-"
LOCK = "lock"


def open_cache_dir(path: str) -> int | None:
    """An fd of the cache directory, created 0700 if missing; None when it cannot be trusted or
    used (someone else owns it, it is a symlink, we may not create or open it)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.info(f"no inventory cache: cannot create {escape(path)}: {exc.strerror}")
        return None
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError:
        log.info(f"no inventory cache: {escape(path)} is root's")
        return None
    except OSError as exc:
        log.warning(f"inventory cache {escape(path)} not used: {exc.strerror}")
        return None
    st = os.fstat(dfd)
    try:
        if st.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, f"owned by uid {st.st_uid}")
        if st.st_mode & 0o077:
            os.fchmod(dfd, 0o700)   # ours: tighten it; every entry in it is checked anyway
    except OSError as exc:
        os.close(dfd)
        log.warning(f"inventory cache {escape(path)} not used: {exc.strerror}")
        return None
    return dfd


def read_entry(dfd: int, name: str) -> dict | None:
    """The parsed entry, or None when it is missing or is not a file we wrote."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning(f"inventory cache entry {escape(name)} ignored: {exc.strerror}")
        return None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077
                and st.st_nlink == 1 and st.st_size <= MAX_FILE):
            log.warning(f"inventory cache entry {escape(name)} ignored: not a private regular file of ours")
            return None
        data, more = read_at_most(fd, MAX_FILE)
        if more:
            return None
    finally:
        os.close(fd)
    try:
        entry = jsontext.loads(data)
    except (ValueError, RecursionError):
        log.warning(f"inventory cache entry {escape(name)} ignored: not JSON")
        return None
    return entry if isinstance(entry, dict) else None


def write_entry(dfd: int, name: str, record: dict) -> bool:
    """Replace ``name`` atomically; a failure costs the next start a rebuild, nothing more."""
    data = jsontext.dumps(record, separators=(",", ":")).encode()
    tmp = f".{name}.{os.getpid()}.tmp"
    try:
        write_new(dfd, tmp, data)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as exc:
        log.warning(f"inventory cache not written: {exc.strerror}")
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        return False
    _prune(dfd, keep=name)
    return True


def configuration_of(name: str) -> str:
    """The configuration part of an entry's name (``inventory-<configuration>-<program>.json``;
    an older version's ``inventory-<configuration>.json`` counts under its configuration)."""
    return name[len(PREFIX):].split("-", 1)[0].split(".", 1)[0]


def _prune(dfd: int, keep: str) -> None:
    """Keep the directory bounded: the newest :data:`MAX_PROGRAMS` entries of ``keep``'s
    configuration, the newest :data:`MAX_ENTRIES` in all, no stale temporaries. Two programs
    that share the directory keep both their entries: neither rebuilds the other's."""
    entries, now = [], time.time()
    try:
        with os.scandir(dfd) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if e.name.endswith(".tmp") and now - st.st_mtime > STALE_TEMP_S:
                    os.unlink(e.name, dir_fd=dfd)
                elif e.name.startswith(PREFIX) and e.name != keep:
                    entries.append((st.st_mtime, e.name))
        entries.sort(reverse=True)
        mine = configuration_of(keep)
        same = [name for _, name in entries if configuration_of(name) == mine]
        drop = set(same[MAX_PROGRAMS - 1:])
        rest = [name for _, name in entries if name not in drop]
        drop.update(rest[MAX_ENTRIES - 1:])
        for old in drop:
            os.unlink(old, dir_fd=dfd)
    except OSError as exc:
        log.info(f"inventory cache: pruning stopped: {exc.strerror}")


class Lock:
    """``flock`` on the directory's lock file, waited for at most ``deadline`` seconds."""

    def __init__(self, dfd: int, deadline: float):
        self.deadline = deadline
        self.fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                          dir_fd=dfd)

    def __enter__(self):
        if flock_within(self.fd, self.deadline):
            return self
        os.close(self.fd)
        raise NvcError("timeout", f"waited {self.deadline:g}s for another nvcontainer to build the driver inventory")

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
