"""A lease: GPUs bound to one container until its init process exits.

Why the init's start time is kept beside its pid: pids are reused, and a lease must end when *its*
container ends, not stay alive because an unrelated process later got the same number. The
kernel's start time (field 22 of ``/proc/PID/stat``, clock ticks since boot) tells the two apart.
Plain data only: :mod:`.store` reads and writes it, :mod:`.liveness` checks it against /proc.
"""

from __future__ import annotations

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
    ``how``: ``free`` or ``explicit``; ``asked``: the request as written (``free:2``).
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
MAX_GPUS = 1024
MAX_TEXT = 4096


def from_json(item: object) -> Lease | None:
    """A lease from its stored form, or None when it is not one (every field typed and bounded)."""
    if not isinstance(item, dict) or set(item) != set(_TYPES):
        return None
    for key, kind in _TYPES.items():
        value = item[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            return None
        if isinstance(value, str) and len(value) > MAX_TEXT:
            return None
    gpus, indexes = item["gpus"], item["indexes"]
    if (not gpus or len(gpus) != len(indexes) or len(gpus) > MAX_GPUS
            or not all(isinstance(u, str) and 0 < len(u) <= 128 for u in gpus)
            or not all(type(i) is int and 0 <= i < MAX_GPUS for i in indexes)):
        return None
    if item["pid"] < 0 or item["start"] < 0 or not item["container"] or item["how"] not in HOW:
        return None
    return Lease(gpus=tuple(gpus), indexes=tuple(indexes), container=item["container"], pid=item["pid"],
                 start=item["start"], bundle=item["bundle"], since=float(item["since"]), how=item["how"],
                 asked=item["asked"])
