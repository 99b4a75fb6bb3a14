"""A lease: GPUs bound to one container until its init process exits.

Why the init's start time is kept beside its pid: pids are reused, and a lease must end when *its*
container ends, not stay alive because an unrelated process later got the same number. The
kernel's start time (field 22 of ``/proc/PID/stat``, clock ticks since boot) tells the two apart.
Plain data only: :mod:`.store` reads and writes it, :mod:`.liveness` checks it against /proc.
"""

from __future__ import annotations

from ..errors import escape
from ..records import record

# How a lease was asked for: ``free`` / ``free:N`` (the node chose the GPUs), or ``explicit``
# (the container named them, and exclusive-gpus made the names a lease).
HOW = ("free", "explicit")
PENDING_S = 60.0   # a pending lease whose init never came is released after this


@record
class Lease:
    """``gpus``: the GPUs' UUIDs, ``indexes``: their indexes, in the same order. ``container``:
    the OCI state's container id. ``pid`` and ``start``: the container's init and its start time
    (clock ticks since boot). ``since``: when the lease was taken (seconds since the epoch).
    ``how``: ``free`` or ``explicit``; ``asked``: the request, normalized (``free:2``, or the
    indexes an explicit request resolved to, ``0,3``), never the container's text as written.
    ``pid`` 0: *pending*, taken by the runtime shim in CDI mode at create, before the init
    exists; the shim's ``bind-lease`` hook fills in pid and start (:data:`PENDING_S` at most)."""

    gpus: tuple[str, ...]
    indexes: tuple[int, ...]
    container: str
    pid: int
    start: int
    bundle: str = ""
    since: float = 0.0
    how: str = "free"
    asked: str = ""

    def holder(self) -> str:
        """Who holds it, in one short phrase for refusals and ``ps``."""
        return f"container {self.container[:12]} ({f'pid {self.pid}' if self.pid else 'starting'})"

    def to_json(self) -> dict:
        return {"gpus": list(self.gpus), "indexes": list(self.indexes), "container": self.container,
                "pid": self.pid, "start": self.start, "bundle": self.bundle, "since": self.since,
                "how": self.how, "asked": self.asked}


_TYPES = {"gpus": list, "indexes": list, "container": str, "pid": int, "start": int, "bundle": str,
          "since": (int, float), "how": str, "asked": str}
# The one set of bounds: the reader refuses an entry past them, and the writer checks every
# entry against the same function before it writes, so it never records what it cannot read.
MAX_GPUS = 1024
MAX_TEXT = 4096
MAX_UUID = 128


def problem(item: object) -> str | None:
    """Why ``item`` is not a stored lease (the field and what is wrong, in a few words); None
    when it is one. Shared by the reader and the writer. Pure."""
    if not isinstance(item, dict):
        return f"a {type(item).__name__}, not an object"
    if set(item) != set(_TYPES):
        odd = sorted(set(item) ^ set(_TYPES))
        return f"field(s) {escape(', '.join(map(str, odd)), 80)} missing or unknown"
    for key, kind in _TYPES.items():
        value = item[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"field {key!r} is a {type(value).__name__}"
        if isinstance(value, str) and len(value) > MAX_TEXT:
            return f"field {key!r} is {len(value)} characters, more than {MAX_TEXT}"
    gpus, indexes = item["gpus"], item["indexes"]
    if not gpus or len(gpus) != len(indexes) or len(gpus) > MAX_GPUS:
        return f"{len(gpus)} GPUs for {len(indexes)} indexes (1 to {MAX_GPUS})"
    if not all(isinstance(u, str) and 0 < len(u) <= MAX_UUID for u in gpus):
        return f"field 'gpus' holds a value that is not a UUID of 1 to {MAX_UUID} characters"
    if not all(type(i) is int and 0 <= i < MAX_GPUS for i in indexes) or len(set(indexes)) != len(indexes):
        return f"field 'indexes' holds a value that is not a distinct index below {MAX_GPUS}"
    if item["pid"] < 0 or item["start"] < 0:
        return "a negative pid or start time"
    if not item["container"]:
        return "an empty container ID"
    if item["how"] not in HOW:
        return f"field 'how' is {escape(item['how'], 20)!r}"
    return None


def from_json(item: object) -> Lease | None:
    """A lease from its stored form, or None when it is not one (:func:`problem` says why)."""
    if problem(item) is not None:
        return None
    return Lease(gpus=tuple(item["gpus"]), indexes=tuple(item["indexes"]), container=item["container"],
                 pid=item["pid"], start=item["start"], bundle=item["bundle"], since=float(item["since"]),
                 how=item["how"], asked=item["asked"])


@record
class Unreadable:
    """An entry of the file that is not a lease (damaged, or written by something else): kept as
    it was (``raw``, its JSON text) and taken as holding GPUs until it is known to have ended.
    What could be read of it is salvaged, and only ever to hold more, never less: ``indexes``
    None holds every GPU; ``pid``/``start``/``since`` None leave its end unknown (it never ends
    by itself). ``number``: its place in the file, ``why``: :func:`problem`'s answer."""

    number: int
    why: str
    raw: str
    container: str = ""
    indexes: tuple[int, ...] | None = None
    pid: int | None = None
    start: int | None = None
    since: float | None = None

    def holder(self) -> str:
        who = f"container {escape(self.container[:12])}, " if self.container else ""
        pid = f"pid {self.pid}" if self.pid else "pid unknown" if self.pid is None else "starting"
        return f"unreadable lease entry {self.number} ({who}{pid}: {self.why})"


def salvage(number: int, item: object, why: str, raw: str) -> Unreadable:
    """What can be trusted of an entry that is not a lease. Pure."""
    if not isinstance(item, dict):
        return Unreadable(number, why, raw)

    def count(key):
        value = item.get(key)
        return value if type(value) is int and value >= 0 else None

    indexes = item.get("indexes")
    if not (isinstance(indexes, list) and indexes and len(indexes) <= MAX_GPUS
            and all(type(i) is int and 0 <= i < MAX_GPUS for i in indexes)):
        indexes = None
    since = item.get("since")
    container = item.get("container")
    return Unreadable(number, why, raw, container=container[:64] if isinstance(container, str) else "",
                      indexes=None if indexes is None else tuple(dict.fromkeys(indexes)), pid=count("pid"),
                      start=count("start"),
                      since=float(since) if type(since) in (int, float) and since == since else None)
