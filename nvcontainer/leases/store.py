"""The one lease file, ``/run/nvcontainer/leases.json``: read bounded, written atomically under a
lock, shared by ``nvcontainer serve`` and the in-process hook.

Why one file and one lock: deciding which GPUs are free and recording the choice must be one step,
or two containers starting together take the same GPU. Every writer holds ``flock`` on
``leases.lock`` from its read to its rename; readers that only look (``ps``, ``doctor``) take no
lock, since a rename never shows them half a file. The file is root's in a root-only directory,
yet it is still read as if hostile: no symlink followed, no FIFO opened for a blocking read,
nothing larger than :data:`MAX_FILE`, every entry typed (:func:`.model.problem`).

Why fail closed: a lease that cannot be read may be a GPU a running container holds, so it is
never taken as free. An entry that is not a lease is kept as it was, beside the others, and holds
what could be salvaged of it (every GPU, when its indexes cannot be read) until what it says of
its init shows that init gone (:class:`.model.Unreadable`). A file that cannot be read at all
(not JSON, too large, a symlink, an older or a newer version's) is left where it is and no GPU
is leased until an operator moves it aside: each request is refused with one line that says so.
The writer checks every entry against the reader's own bounds before it writes, so it never
records what it could not read back.
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
from . import liveness
from .model import Lease, Unreadable, from_json, problem, salvage

VERSION = 1
NAME = "leases.json"
LOCK = "leases.lock"
MAX_FILE = 4 << 20
DEFAULT_DIR = "/run/nvcontainer"


def path_in(directory: str) -> str:
    """The lease file of a cache directory (the config's ``cache-dir``)."""
    return os.path.join(directory, NAME)


DEFAULT = path_in(DEFAULT_DIR)


class Closed(NvcError):
    """The file cannot be read: left where it is, and no GPU is leased until it is moved aside."""


CLOSED = "no GPU is leased while it cannot be read (move it aside once the containers it names have ended)"


def dumps(leases: tuple[Lease, ...] | list[Lease], unreadable: tuple[Unreadable, ...] = ()) -> bytes:
    items = [lease.to_json() for lease in leases] + [json.loads(u.raw) for u in unreadable]
    return json.dumps({"version": VERSION, "leases": items}, separators=(",", ":")).encode()


def parse(data: bytes, where: str) -> tuple[tuple[Lease, ...], tuple[Unreadable, ...]]:
    """The leases of a file's bytes and its entries that are not leases; one line naming
    ``where`` and the fault when the file as a whole cannot be read. Pure."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise Closed("leases", f"{escape(where)}: truncated or not JSON ({len(data)} bytes); {CLOSED}") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if type(version) is not int or version < VERSION:
        raise Closed("leases", f"{escape(where)}: written by an older version of nvcontainer "
                               f"(version {escape(repr(version), 20)}, this one reads {VERSION}); {CLOSED}")
    if version > VERSION:
        raise Closed("leases", f"{escape(where)}: written by a newer version of nvcontainer "
                               f"(version {version}, this one reads {VERSION}); {CLOSED}")
    items = doc.get("leases")
    if not isinstance(items, list):
        raise Closed("leases", f"{escape(where)}: no list of leases; {CLOSED}")
    leases, unreadable = [], []
    for n, item in enumerate(items):
        why = problem(item)
        if why is None:
            leases.append(from_json(item))
            continue
        try:
            raw = json.dumps(item, separators=(",", ":"))
        except (ValueError, RecursionError):
            raise Closed("leases", f"{escape(where)}: entry {n} cannot be kept; {CLOSED}") from None
        unreadable.append(salvage(n, item, why, raw))
    return tuple(leases), tuple(unreadable)


def _read(dfd: int | None, path: str) -> tuple[tuple[Lease, ...], tuple[Unreadable, ...]]:
    """The file at ``path`` (relative to ``dfd`` when given); nothing when there is none."""
    name = os.path.basename(path) if dfd is not None else path
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return (), ()
    except OSError as exc:
        why = "a symlink" if exc.errno == errno.ELOOP else exc.strerror   # ELOOP: O_NOFOLLOW met a link
        raise Closed("leases", f"{escape(path)}: not read: {why}; {CLOSED}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Closed("leases", f"{escape(path)}: not a regular file; {CLOSED}")
        if st.st_size > MAX_FILE:
            raise Closed("leases", f"{escape(path)}: {st.st_size} bytes, more than {MAX_FILE}; {CLOSED}")
        data, more = read_at_most(fd, MAX_FILE)
    finally:
        os.close(fd)
    if more:
        raise Closed("leases", f"{escape(path)}: more than {MAX_FILE} bytes; {CLOSED}")
    return parse(data, path)


def load(path: str = DEFAULT) -> tuple[Lease, ...]:
    """Every lease recorded (live or not: :mod:`.liveness` tells), for readers that only look;
    () when there is no file; one-line :class:`NvcError` when the file cannot be trusted. The
    entries that are not leases are left out: :func:`load_all` has them."""
    return _read(None, path)[0]


def load_all(path: str = DEFAULT) -> tuple[tuple[Lease, ...], tuple[Unreadable, ...]]:
    """The leases and the entries that are not leases (each holds GPUs: see the module's doc)."""
    return _read(None, path)


class Held:
    """The lease file under its lock: :meth:`read`, then :meth:`write` at most once."""

    def __init__(self, path: str, deadline: float):
        self.path, self.deadline = path, deadline
        self.dfd = open_private_dir(os.path.dirname(path) or ".", "leases", create=True)
        self.name = os.path.basename(path)
        self.unreadable: tuple[Unreadable, ...] = ()

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
        """The recorded leases; the entries that are not leases in :attr:`unreadable`, kept by
        :meth:`write`. A file that cannot be read raises (see the module's doc: fail closed)."""
        leases, self.unreadable = _read(self.dfd, self.name)
        return leases

    def write(self, leases: tuple[Lease, ...] | list[Lease]) -> None:
        """Replace the file atomically: a reader sees the old leases or the new, never half. Every
        lease is checked against the reader's bounds first: nothing written that cannot be read."""
        for lease in leases:
            why = problem(lease.to_json())
            if why is not None:
                raise NvcError("leases", f"container {escape(lease.container, 64)}: not recorded: {why}")
        data = dumps(leases, self.unreadable)
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


def update(path: str, change, deadline: float = 10.0, *, unreadable: bool = False):
    """``change(leases) -> (new leases, result)`` applied under the lock (``change(leases,
    unreadable)`` with ``unreadable``: a grant must count what those hold); the file is
    rewritten only when something changed. The entries that are not leases are kept, except
    those whose container is known to have ended. Returns ``result``."""
    with Held(path, deadline) as held:
        leases = held.read()
        before = held.unreadable
        held.unreadable = tuple(u for u in before if liveness.may_run(u))
        for gone in set(before) - set(held.unreadable):
            log.info(f"leases: {gone.holder()} ended: dropped")
        new, result = change(leases, held.unreadable) if unreadable else change(leases)
        if tuple(new) != leases or held.unreadable != before:
            held.write(new)
        return result
