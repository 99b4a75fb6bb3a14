"""The one lease file, ``/run/nvcontainer/leases.json``: read bounded, written atomically under a
lock, shared by ``nvcontainer serve`` and the in-process hook.

Why one file and one lock: deciding which GPUs are free and recording the choice must be one step,
or two containers starting together take the same GPU. Every writer holds ``flock`` on
``leases.lock`` from its read to its rename; readers that only look (``ps``, ``doctor``) take no
lock, since a rename never shows them half a file. The file is root's in a root-only directory,
yet it is still read as if hostile: no symlink followed, no FIFO opened for a blocking read,
nothing larger than :data:`MAX_FILE`, every entry typed. A file that fails those checks (or one an
older version wrote) is set aside as ``leases.json.bad`` by the next writer, with one warning, and
the node starts again from no leases; one a newer version wrote is refused, never overwritten.
"""

from __future__ import annotations

import errno
import json
import os
import stat

from .. import log
from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from ..fs.private import flock_within, open_private_dir, write_new
from .model import Lease, from_json

VERSION = 1
NAME = "leases.json"
LOCK = "leases.lock"
ASIDE = NAME + ".bad"
MAX_FILE = 4 << 20
DEFAULT_DIR = "/run/nvcontainer"


def path_in(directory: str) -> str:
    """The lease file of a cache directory (the config's ``cache-dir``)."""
    return os.path.join(directory, NAME)


DEFAULT = path_in(DEFAULT_DIR)


class Newer(NvcError):
    """The file was written by a newer nvcontainer: left alone."""


def dumps(leases: tuple[Lease, ...] | list[Lease]) -> bytes:
    return json.dumps({"version": VERSION, "leases": [lease.to_json() for lease in leases]},
                      separators=(",", ":")).encode()


def parse(data: bytes, where: str) -> tuple[Lease, ...]:
    """The leases of a file's bytes; one line naming ``where`` and the fault otherwise. Pure."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise NvcError("leases", f"{escape(where)}: truncated or not JSON ({len(data)} bytes)") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if type(version) is not int or version < VERSION:
        raise NvcError("leases", f"{escape(where)}: written by an older version of nvcontainer "
                                 f"(version {escape(repr(version), 20)}, this one reads {VERSION})")
    if version > VERSION:
        raise Newer("leases", f"{escape(where)}: written by a newer version of nvcontainer "
                              f"(version {version}, this one reads {VERSION}); left as it is")
    items = doc.get("leases")
    if not isinstance(items, list):
        raise NvcError("leases", f"{escape(where)}: no list of leases")
    leases = []
    for n, item in enumerate(items):
        lease = from_json(item)
        if lease is None:
            raise NvcError("leases", f"{escape(where)}: entry {n} is not a lease")
        leases.append(lease)
    return tuple(leases)


def _read(dfd: int | None, path: str) -> tuple[Lease, ...]:
    """The file at ``path`` (relative to ``dfd`` when given); () when there is none."""
    name = os.path.basename(path) if dfd is not None else path
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return ()
    except OSError as exc:
        why = "a symlink" if exc.errno == errno.ELOOP else exc.strerror   # ELOOP: O_NOFOLLOW met a link
        raise NvcError("leases", f"{escape(path)}: not read: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NvcError("leases", f"{escape(path)}: not a regular file")
        if st.st_size > MAX_FILE:
            raise NvcError("leases", f"{escape(path)}: {st.st_size} bytes, more than {MAX_FILE}")
        data, more = read_at_most(fd, MAX_FILE)
    finally:
        os.close(fd)
    if more:
        raise NvcError("leases", f"{escape(path)}: more than {MAX_FILE} bytes")
    return parse(data, path)


def load(path: str = DEFAULT) -> tuple[Lease, ...]:
    """Every lease recorded (live or not: :mod:`.liveness` tells), for readers that only look;
    () when there is no file; one-line :class:`NvcError` when the file cannot be trusted."""
    return _read(None, path)


class Held:
    """The lease file under its lock: :meth:`read`, then :meth:`write` at most once."""

    def __init__(self, path: str, deadline: float):
        self.path, self.deadline = path, deadline
        self.dfd = open_private_dir(os.path.dirname(path) or ".", "leases", create=True)
        self.name = os.path.basename(path)

    def __enter__(self) -> "Held":
        try:
            self.lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                0o600, dir_fd=self.dfd)
        except OSError as exc:
            os.close(self.dfd)
            raise NvcError("leases", f"{escape(self.path)}: no lock: {exc.strerror}") from None
        if flock_within(self.lock, self.deadline, 0.0005, 0.01):
            return self
        self.__exit__()
        raise NvcError("timeout", f"waited {self.deadline:g}s for the lock of {escape(self.path)}")

    def __exit__(self, *exc) -> None:
        os.close(self.lock)
        os.close(self.dfd)

    def read(self) -> tuple[Lease, ...]:
        """The recorded leases; a file that cannot be trusted is set aside (one warning) and read
        as none, except one from a newer version, which is refused."""
        try:
            return _read(self.dfd, self.name)
        except Newer:
            raise
        except NvcError as exc:
            try:
                os.rename(self.name, ASIDE, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
            except OSError as err:
                raise NvcError("leases", f"{exc.detail}; not set aside: {err.strerror}") from None
            log.warning(f"{exc.detail}; set aside as {ASIDE}, leases start again from none")
            return ()

    def write(self, leases: tuple[Lease, ...] | list[Lease]) -> None:
        """Replace the file atomically: a reader sees the old leases or the new, never half."""
        data = dumps(leases)
        if len(data) > MAX_FILE:
            raise NvcError("leases", f"{escape(self.path)}: {len(leases)} leases do not fit in {MAX_FILE} bytes")
        tmp = f".{self.name}.{os.getpid()}.tmp"
        try:
            # no fsync: the file lives on /run (tmpfs) and is meant to end with the boot, as do
            # the containers it names; rename alone is atomic against any process dying
            write_new(self.dfd, tmp, data)
            os.rename(tmp, self.name, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
        except OSError as exc:
            try:
                os.unlink(tmp, dir_fd=self.dfd)
            except OSError:
                pass
            raise NvcError("leases", f"{escape(self.path)}: not written: {exc.strerror}") from None


def update(path: str, change, deadline: float = 10.0):
    """``change(leases) -> (new leases, result)`` applied under the lock; the file is rewritten
    only when the leases changed. Returns ``result``."""
    with Held(path, deadline) as held:
        leases = held.read()
        new, result = change(leases)
        if tuple(new) != leases:
            held.write(new)
        return result
