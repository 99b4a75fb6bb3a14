"""Keeps this node's ResourceSlices equal to what the inventory, ``allowed-devices`` and the GPUs'
health say, through the API server; removes them on uninstall.

Why a reconciler and not "write on change": the API server may be down when a GPU turns
unhealthy, an operator may delete a slice by hand, another writer may have bumped a slice we
hold. So every change (a new inventory after a driver reload or a MIG reconfiguration, a health
verdict) only marks the node dirty, and :meth:`Publisher.sync` compares what should be published
(``slices.build``) with what the server lists for this node and driver, and writes the
difference: create, update (with the resourceVersion just read; a conflict is read again), and
delete the slices that should not be there. A write bumps the pool's generation, as the
scheduler expects of a pool that changed. :func:`keep_published` runs it: at once when dirty,
every ``resync`` seconds anyway, and after a failure again after a pause that doubles up to a
limit, one line per change of state. Nothing here waits past the deadline it was given.

The PCIe root of each GPU (``resource.kubernetes.io/pcieRoot``) is read where Kubernetes reads
it: the target of ``/sys/bus/pci/devices/<address>``.
"""

from __future__ import annotations

import asyncio
import os
import re
import time

from ... import log
from ...errors import NvcError, escape
from ...kubelet.backoff import Backoff
from . import slices
from ..names import DRIVER

BUDGET = 30.0            # one sync, at most
RESYNC = 300.0           # seconds between syncs when nothing changed
RETRY_FIRST = 1.0
RETRY_MAX = 60.0


def pcie_roots(sysfs: str, inv) -> dict[str, str]:
    """{inventory bus id: ``pci0000:00``} for the GPUs sysfs places under a root complex."""
    out = {}
    for gpu in inv.gpus:
        try:
            target = os.readlink(os.path.join(sysfs, "bus/pci/devices", slices.bus_id(gpu)))
        except (OSError, ValueError):
            continue
        root = slices.pcie_root(target)
        if root:
            out[gpu.bus_id] = root
    return out


class Publisher:
    """The desired slices and the calls that make the server hold them. Not thread-safe: one
    sync at a time (``keep_published`` runs them one after another)."""

    def __init__(self, api, node: str, *, allow=None, taint: bool = False, sysfs: str = "/sys",
                 say=log.info):
        self.api = api
        self.node = node
        self.allow = allow            # callable: inventory -> AllowList | None
        self.taint = taint
        self.sysfs = sysfs
        self.say = say
        self.inv = None
        self.bad: dict[str, str] = {}
        self.owner: list[dict] | None = None

    def desired(self, generation: int) -> list[dict]:
        allow = self.allow(self.inv) if self.allow else None
        out = slices.build(self.inv, self.node, allow=allow, unhealthy=self.bad, taint=self.taint,
                           roots=pcie_roots(self.sysfs, self.inv), generation=generation)
        for obj in out:
            obj["metadata"]["ownerReferences"] = self.owner
        return out

    def _owner(self, deadline: float) -> list[dict]:
        """The node owns its slices: deleting the Node deletes them (the garbage collector)."""
        if self.owner is None:
            node = self.api.get_node(self.node, deadline=deadline)
            uid = (node.get("metadata") or {}).get("uid")
            if not isinstance(uid, str) or not uid:
                raise NvcError("kubernetes", f"node {escape(self.node, 80)}: the API server gave no uid")
            self.owner = [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid, "controller": True}]
        return self.owner

    def sync(self, deadline: float | None = None) -> bool:
        """One reconciliation; True when it wrote something. NvcError (one line) on failure."""
        deadline = time.monotonic() + BUDGET if deadline is None else deadline
        for attempt in range(3):
            try:
                return self._sync(deadline)
            except NvcError as exc:
                if "answered 409" not in exc.detail or attempt == 2:
                    raise
                log.info(f"slices: {exc.detail}; reading them again")
        return False

    def _sync(self, deadline: float) -> bool:
        self._owner(deadline)
        have = {s["metadata"]["name"]: s for s in self.api.list_slices(self.node, DRIVER, deadline=deadline)}
        generation = max((_generation(s) for s in have.values()), default=0)
        want = self.desired(max(generation, 1))
        if have and all(_same(w, have.get(w["metadata"]["name"])) for w in want) and len(have) == len(want):
            return False
        want = self.desired(generation + 1)
        for obj in want:
            name = obj["metadata"]["name"]
            if name in have:
                obj["metadata"]["resourceVersion"] = have[name]["metadata"].get("resourceVersion")
                self.api.update_slice(obj, deadline=deadline)
            else:
                self.api.create_slice(obj, deadline=deadline)
        for name in set(have) - {w["metadata"]["name"] for w in want}:
            self.api.delete_slice(name, deadline=deadline)
        devices = sum(len(w["spec"]["devices"]) for w in want)
        log.info(f"slices: published {devices} device(s) in {len(want)} slice(s), generation {generation + 1}")
        return True

    def remove(self, deadline: float | None = None) -> int:
        """Delete every slice of this driver on this node (uninstall); how many there were."""
        deadline = time.monotonic() + BUDGET if deadline is None else deadline
        names = [s["metadata"]["name"] for s in self.api.list_slices(self.node, DRIVER, deadline=deadline)]
        for name in names:
            self.api.delete_slice(name, deadline=deadline)
        return len(names)


def _generation(obj: dict) -> int:
    value = ((obj.get("spec") or {}).get("pool") or {}).get("generation")
    return value if type(value) is int else 0


def _same(want: dict, have: dict | None) -> bool:
    """Does the server hold ``want`` (its devices, node and pool size; the generation aside)?"""
    if have is None or want["metadata"].get("ownerReferences") != (have.get("metadata") or {}).get("ownerReferences"):
        return False
    a, b = want["spec"], have.get("spec") or {}
    return (a["devices"] == (b.get("devices") or []) and a["nodeName"] == b.get("nodeName")
            and a["pool"]["name"] == (b.get("pool") or {}).get("name")
            and a["pool"]["resourceSliceCount"] == (b.get("pool") or {}).get("resourceSliceCount"))


class Loop:
    """What :func:`keep_published` reacts to: call :meth:`inventory` with a new inventory and
    :meth:`health` with {UUID: why} (the device plugin's monitor's ``publish``)."""

    def __init__(self, publisher: Publisher, *, resync: float = RESYNC, budget: float = BUDGET,
                 retry_first: float = RETRY_FIRST, retry_max: float = RETRY_MAX):
        self.publisher = publisher
        self.resync, self.budget = resync, budget
        self.retry_first, self.retry_max = retry_first, retry_max
        self.dirty = asyncio.Event()
        self.failing = ""
        self.syncs = 0

    def inventory(self, inv) -> None:
        if inv != self.publisher.inv:
            self.publisher.inv = inv
            self.dirty.set()

    def health(self, bad: dict) -> None:
        bad = dict(bad)
        if bad != self.publisher.bad:
            self.publisher.bad = bad
            self.dirty.set()

    async def run(self) -> None:
        """Sync whenever dirty, every ``resync`` seconds, and after a failure again after a
        pause that doubles up to ``retry_max`` (a new change retries at once)."""
        backoff = Backoff(self.retry_first, self.retry_max)
        while True:
            try:
                await asyncio.wait_for(self.dirty.wait(), backoff.pause if self.failing else self.resync)
            except asyncio.TimeoutError:
                pass
            self.dirty.clear()
            if self.publisher.inv is None:
                continue
            self.syncs += 1
            try:
                await asyncio.to_thread(self.publisher.sync, time.monotonic() + self.budget)
            except NvcError as exc:
                reason = re.sub(r" \(\d+ attempt\(s\)\)$", "", exc.detail)   # the state, not the try
                line = f"slices not published: {reason} (retrying, at most every {self.retry_max:g} s)"
                if line != self.failing:
                    self.publisher.say(line)
                if self.failing:
                    backoff.next()
                else:
                    backoff.reset()
                self.failing = line
                continue
            if self.failing:
                self.publisher.say("slices published again")
            self.failing = ""
            backoff.reset()


def remove_slices(api, node: str, deadline: float | None = None) -> str:
    """The uninstall path (``dra-driver --remove-slices``, the DaemonSet's preStop): the line to
    print. NvcError when the server cannot be reached by ``deadline``."""
    count = Publisher(api, node).remove(deadline)
    return f"removed {count} ResourceSlice(s) of {DRIVER} on node {escape(node, 80)}"
