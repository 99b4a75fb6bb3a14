"""Taking a lease at a container's start: ``free:N`` resolved to GPUs no live lease holds, or
(with ``exclusive-gpus``) an explicit request checked against the leases and recorded as one.

Why decide and record in one step under the file's lock: two containers starting together would
otherwise both see GPU 2 free and both take it. :func:`decide` is the pure choice over the live
leases; :func:`acquire` is the shell around it: liveness from /proc, the lock, the wait.
"""

from __future__ import annotations

import time

from .. import log
from ..errors import NvcError, escape
from ..inventory.model import Inventory
from ..inventory.topology import Topology, numa_nodes
from ..records import replace
from ..request import free
from ..request.placement import choose_gpus
from ..request.selection import AllowList, allow_list, select
from . import liveness, store
from .model import Lease

SYSFS = "/sys"


def leasable(inv: Inventory, allow: AllowList | None) -> list[int]:
    """The GPUs the node may lease: every one ``allowed-devices`` permits whole."""
    return [g.index for g in inv.gpus if allow is None or allow.permits(g)]


def holders(live: tuple[Lease, ...] | list[Lease]) -> dict[int, Lease]:
    return {i: lease for lease in live for i in lease.indexes}


def decide_free(live, inv: Inventory, allow: AllowList | None, count: int, topology: Topology,
                asked: str) -> list[int] | None:
    """``count`` free GPUs, best placed; None when fewer are free now; an error when the node
    could never give that many."""
    allowed = leasable(inv, allow)
    if count > len(allowed):
        where = " allowed (allowed-devices)" if allow is not None else ""
        raise NvcError("device", f"{escape(asked, 80)}: this node has {len(allowed)} GPU(s){where}")
    held = holders(live)
    candidates = [i for i in allowed if i not in held]
    if len(candidates) < count:
        return None
    return candidates[:1] if count == 1 else choose_gpus(candidates, count, topology)


def conflicts(live, indexes) -> list[tuple[int, Lease]]:
    held = holders(live)
    return [(i, held[i]) for i in indexes if i in held]


def occupants(live, unreadable, inv: Inventory) -> list:
    """The live leases and the unreadable entries that may still run, each holding its GPUs:
    an entry whose indexes could not be read holds every GPU (fail closed)."""
    every = tuple(g.index for g in inv.gpus)
    return [*live, *(u if u.indexes is not None else replace(u, indexes=every) for u in unreadable)]


def who_holds(live, indexes=None) -> str:
    """``GPU 0, 1 held by container 3f2a… (pid 812); GPU 3 by …`` for a refusal's one line."""
    by: dict[Lease, list[int]] = {}
    for i, lease in sorted(holders(live).items()):
        if indexes is None or i in indexes:
            by.setdefault(lease, []).append(i)
    parts = [f"GPU {', '.join(map(str, gpus))} held by {lease.holder()}" for lease, gpus in by.items()]
    return "; ".join(parts) or "none held"


def acquire(request, inv: Inventory, cfg, container: str, pid: int, bundle: str):
    """The request with ``free:N`` replaced by the leased GPUs' UUIDs (or unchanged when it takes
    no lease). Waits up to ``lease-wait-seconds`` for GPUs to come free, then refuses in one line
    naming who holds what."""
    count = free.asked(request.devices)
    explicit = count is None and cfg.exclusive_gpus and request.devices != ()
    if count is None and not explicit:
        return request
    if explicit:
        tokens = ["all"] if request.devices == "all" else list(request.devices)
        indexes = tuple(g.index for g in select(inv, tokens, allow_list(inv, cfg.allowed_devices)).gpus)
        if not indexes:
            return request
        take(inv, cfg, container, pid, bundle, asked=",".join(tokens), indexes=indexes)
        return request
    lease = take(inv, cfg, container, pid, bundle, asked=request.devices[0], count=count)
    return replace(request, devices=lease.gpus)


def take(inv: Inventory, cfg, container: str, pid: int, bundle: str, *, asked: str, count: int | None = None,
         indexes: tuple[int, ...] = ()) -> Lease:
    """A lease on ``count`` free GPUs, or on exactly ``indexes`` (exclusive-gpus), for ``pid``
    (0: pending, bound at the init's start by ``bind-lease``). ``asked`` (the request as the
    container wrote it) is only shown, escaped and cut, in refusals: the lease records the
    normalized request (``free:N``, or the indexes), so a request's spelling never reaches the
    file."""
    allow = allow_list(inv, cfg.allowed_devices)
    start = 0
    if pid:
        start = liveness.start_time(pid)
        if start is None:
            raise NvcError("device", f"container {escape(container, 64)}: its init (pid {pid}) exited "
                                     "before its GPUs were leased")
    topology = Topology(numa=numa_nodes(SYSFS, inv)) if count and count > 1 else Topology()
    busy: list[str] = []

    recorded = f"{free.WORD}:{count}" if count is not None else ",".join(map(str, indexes))

    def change(leases, unreadable):
        live = [x for x in leases if x.container != container and liveness.alive(x)]
        others = occupants(live, unreadable, inv)
        if count is None:
            clash = conflicts(others, indexes)
            if clash:
                busy[:] = [f"{escape(asked, 80)}: exclusive-gpus: {who_holds(others, {i for i, _ in clash})}"]
                return live, None
            chosen = list(indexes)
        else:
            chosen = decide_free(others, inv, allow, count, topology, asked)
            if chosen is None:
                busy[:] = [f"{escape(asked, 80)}: no {count} GPU(s) free; {who_holds(others)}"]
                return live, None
        lease = Lease(gpus=tuple(inv.gpus[i].uuid for i in chosen), indexes=tuple(chosen),
                      container=container, pid=pid, start=start, bundle=bundle, since=time.time(),
                      how="free" if count is not None else "explicit", asked=recorded)
        return [*live, lease], lease

    path = store.path_in(cfg.cache_dir)
    end, pause = time.monotonic() + cfg.lease_wait_seconds, 0.01
    while True:
        lease = store.update(path, change, deadline=max(cfg.deadline, 1), unreadable=True)
        if lease is not None:
            break
        left = end - time.monotonic()
        if left <= 0:
            raise NvcError("device", busy[0])
        if pid and liveness.start_time(pid) != start:
            raise NvcError("device", f"container {escape(container, 64)}: its init (pid {pid}) exited "
                                     "while waiting for GPUs")
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.1)
    log.info(f"lease: {lease.asked} → GPU {', '.join(map(str, lease.indexes))} for {lease.holder()}")
    return lease


def preview(request, inv: Inventory, cfg):
    """``--dry-run``: the request with ``free:N`` replaced by the GPUs a lease would get now;
    nothing is recorded."""
    count = free.asked(request.devices)
    if count is None:
        return request
    leases, unreadable = store.load_all(store.path_in(cfg.cache_dir))   # unreadable: refused, as a start would be
    live = occupants([x for x in leases if liveness.alive(x)], [u for u in unreadable if liveness.may_run(u)], inv)
    topology = Topology(numa=numa_nodes(SYSFS, inv)) if count > 1 else Topology()
    chosen = decide_free(live, inv, allow_list(inv, cfg.allowed_devices), count, topology, request.devices[0])
    if chosen is None:
        raise NvcError("device", f"{escape(request.devices[0], 80)}: no {count} GPU(s) free; {who_holds(live)}")
    return replace(request, devices=tuple(inv.gpus[i].uuid for i in chosen))


def rehearse(path: str, inv: Inventory | None = None) -> None:
    """The read-only half of a lease, done ahead by ``nvcontainer serve``'s spare child: the
    pages it writes on the way (the allocator's, the modules') are then the spare's own, and the
    request that takes a lease does not pay their copy-on-write faults (about 200 of them, most
    of a lease's cost in a fresh child). Best effort: nothing is locked or written."""
    try:
        live = [x for x in store.load(path) if liveness.alive(x)]
    except NvcError:
        return
    store.dumps(live)
    if inv is not None and inv.gpus:
        decide_free(live, inv, None, 1, Topology(), "free")
        who_holds(live)


def bind(cfg, container: str, pid: int) -> Lease | None:
    """The pending lease of ``container`` bound to its init (``bind-lease``, at its start);
    None when it has none. An init already gone gives its GPUs back at once."""
    start = liveness.start_time(pid) if pid else None

    def change(leases):
        found = next((x for x in leases if x.container == container and x.pid == 0), None)
        if found is None:
            return leases, None
        rest = [x for x in leases if x is not found]
        if start is None:
            return rest, None
        bound = replace(found, pid=pid, start=start)
        return [*rest, bound], bound

    return store.update(store.path_in(cfg.cache_dir), change, deadline=max(cfg.deadline, 1))


def release(cfg, container: str) -> None:
    """Give back what ``container`` holds (its start failed after the lease was taken)."""
    def drop(leases):
        return [x for x in leases if x.container != container], None
    store.update(store.path_in(cfg.cache_dir), drop, deadline=max(cfg.deadline, 1))


def reconcile(path: str, deadline: float = 10.0) -> tuple[int, int]:
    """Drop the leases whose container is gone; (kept, released)."""
    def prune(leases):
        live = [x for x in leases if liveness.alive(x)]
        return live, (len(live), len(leases) - len(live))
    return store.update(path, prune, deadline)
