"""Preparing and unpreparing claims: the claim read from the API server, its spec written, the
checkpoint kept, one claim at a time.

Why the order: a claim's spec is written (atomically, into ``--cdi-root``) before the checkpoint
names it, and the checkpoint forgets a claim only after its spec is gone. A crash in between
leaves a spec the checkpoint does not know yet (rebuilt from the spec's own record at the next
start) or a checkpoint entry whose spec is missing (written again by the next prepare): never a
CDI name handed to the kubelet that does not resolve, never a file left that nobody will remove.

Why a lock per claim UID: the kubelet may call again for a claim while the first call still
waits on the API server (its own timeout passed, a second pod of a shared claim). The second
call waits for the first and then finds the claim prepared: one spec, one answer. Different
claims do not wait for each other. The API server is asked with a deadline a little short of
the kubelet's (the gRPC call's own deadline when it has one): a server that is down or slow
gives the claim an error naming it, in time for the kubelet to retry, never a prepare that
blocks for ever.

Why a device is held from prepare to the end of unprepare (:mod:`exclusive`): a second claim
given a GPU another prepared claim holds (a force-deleted claim's pod still running) is refused
with a line naming the holder, also while the holder's unprepare is still running and after a
plugin restart (the checkpoint names what is held).

Sharing settings are checked (:mod:`opaque`) and recorded with the claim; a time-slice interval
is set on the claim's GPUs before its spec is written, and reset when the last claim that set
it is unprepared (:mod:`sharing`). A claim that asks MPS gets its own MPS control daemon
(:mod:`mpsclaim`), started and told its limits before its spec (which mounts the daemon's pipe
directory) is written: a daemon that does not start fails the prepare with nothing left (no
daemon directory, no spec, no checkpoint entry). A repeated prepare keeps a daemon that answers
and starts one that does not (a plugin restarted after the daemon died); unprepare tells it to
quit and removes its directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from ..cdi import generate, store
from .. import log
from ..errors import NvcError, escape
from ..kubelet import mpscontrol
from . import checkpoint, claims, claimspec, exclusive, mpsclaim, sharing

KUBELET_TIMEOUT = 45.0      # the kubelet's default for a DRA call
MARGIN = 2.0                # answered this long before the caller's deadline
MPS_DEADLINE = 10.0         # for each call of nvidia-cuda-mps-control


class Preparer:
    """``inv``: the inventory; ``table``: DRA device name → (gpu, mig) of the devices this node
    offers; ``get_claim(namespace, name, deadline)``: a blocking call returning the claim dict
    (NvcError ending "not found" when there is none); ``unhealthy()``: UUID → reason (by
    default what :meth:`set_unhealthy` was last given)."""

    def __init__(self, inv, table: dict, node: str, cdi_root: str, state_dir: str, opts: generate.Options,
                 get_claim, say, unhealthy=None, run=None):
        self.inv = inv
        self.table = table
        self.node = node
        self.cdi_root = cdi_root
        self.state_dir = state_dir
        self.opts = opts
        self.get_claim = get_claim
        self.say = say
        self.bad: dict[str, str] = {}
        self.unhealthy = unhealthy or (lambda: self.bad)
        self.run = run or sharing.run            # one nvidia-smi call (the tests record them)
        self.mps_deadline = MPS_DEADLINE
        self.locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self.busy: dict[str, dict] = {}          # UID → entry of a prepare in progress (its devices held)
        self.saving = asyncio.Lock()
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        self.claims = checkpoint.load(state_dir, cdi_root, say)

    def set_unhealthy(self, bad: dict) -> None:
        """The health watcher's verdicts (UUID → why): such a device is refused at prepare."""
        if bad == self.bad:
            return
        self.bad = dict(bad)
        log.info(f"prepare refuses {len(self.bad)} unhealthy device(s): {', '.join(self.bad) or 'none'}")

    @contextlib.asynccontextmanager
    async def _lock(self, uid: str):
        """The claim's lock, dropped when no call holds or waits for it."""
        lock, users = self.locks.get(uid, (asyncio.Lock(), 0))
        self.locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self.locks[uid]
            if users == 1:
                del self.locks[uid]
            else:
                self.locks[uid] = (lock, users - 1)

    async def prepare(self, namespace: str, name: str, uid: str, deadline: float | None = None) -> list[dict]:
        """The claim's device records (with their CDI names); NvcError naming the claim."""
        claimspec.check_uid(uid)
        deadline = deadline or time.monotonic() + KUBELET_TIMEOUT
        async with self._lock(uid):
            entry = self.claims.get(uid)
            path = os.path.join(self.cdi_root, claimspec.file_name(uid))
            if entry is not None and (not entry["devices"] or os.path.exists(path)):
                await asyncio.to_thread(self._mps_start, entry)       # kept when it answers
                return entry["devices"]     # prepared before (a claim of no device here has no spec)
            label = f"{escape(namespace, 80)}/{escape(name, 120)}"
            try:
                obj = await asyncio.wait_for(
                    asyncio.to_thread(self.get_claim, namespace, name, deadline - MARGIN),
                    max(deadline - MARGIN - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                raise NvcError("kubernetes", f"claim {label}: the API server did not answer in time") from None
            except NvcError as exc:
                if exc.detail.endswith("not found"):
                    raise NvcError("input", f"claim {label}: deleted (not found in the API server)") from None
                raise
            resolved = claims.resolve(obj, namespace, name, uid, self.node, self.table, unhealthy=self.unhealthy())
            entry = record(resolved)
            # checked and taken with no await in between: the event loop runs one prepare at a time here
            why = exclusive.conflict(entry["devices"], {**self.claims, **self.busy}, self._parents(), uid)
            if why:
                raise NvcError("input", f"claim {label}: {why}")
            self.busy[uid] = entry
            try:
                await asyncio.to_thread(self._write, resolved, entry)
                async with self.saving:
                    self.claims[uid] = entry
                    await asyncio.to_thread(checkpoint.save, self.state_dir, dict(self.claims))
            finally:
                del self.busy[uid]
            return entry["devices"]

    def _parents(self) -> dict[str, str]:
        return {m.uuid: g.uuid for g in self.inv.gpus for m in g.migs}

    def _write(self, claim: claims.Claim, entry: dict) -> None:
        plan = self._mps_start(entry)
        try:
            self._time_slices(sharing.wanted(claim.units), claim.label)
            if claim.units:
                spec = claimspec.build(self.inv, claim, self.opts)
                if plan is not None:
                    spec = mpsclaim.reaching(spec, plan)
                text = claimspec.render(spec, entry, self.inv.driver_version)
                store.write_atomic(os.path.join(self.cdi_root, entry["spec"]), text)
        except BaseException:
            if plan is not None:
                self._mps_stop(entry)
            raise

    def _mps_start(self, entry: dict):
        """The claim's MPS daemon running (kept when it answers), or None when it asks no MPS."""
        label = f"{entry['namespace']}/{entry['name']}"
        plan = mpsclaim.plan(self.state_dir, entry["uid"], entry["devices"], label)
        if plan is None:
            return None
        try:
            binary = mpscontrol.control_binary(self.inv)
        except NvcError as exc:
            raise NvcError("device", f"claim {escape(label, 200)}: MPS asked: {exc.detail}") from None
        mpsclaim.start(plan, binary, self.mps_deadline, label)
        return plan

    def _mps_stop(self, entry: dict) -> None:
        """The claim's daemon told to quit and its directory removed; a failure is said."""
        try:
            binary = mpscontrol.control_binary(self.inv)
        except NvcError:
            binary = None
        label = f"{entry['namespace']}/{entry['name']}"
        why = mpsclaim.stop(self.state_dir, entry["uid"], binary, self.mps_deadline, label)
        if why:
            self.say(f"MPS daemon of claim {escape(label, 200)}: {why}; its directory is removed")

    def _time_slices(self, intervals: dict[str, str], label: str) -> None:
        """Set each GPU's time-slice (NvcError naming the GPU when nvidia-smi fails)."""
        if not intervals:
            return
        smi = sharing.smi_path(self.inv)
        if smi is None:
            raise NvcError("device", f"claim {escape(label, 200)}: time-slicing asked, and the driver has no "
                                     "nvidia-smi to set it")
        for uuid, interval in intervals.items():
            self.run(sharing.timeslice_argv(smi, uuid, interval))
            log.info(f"time-slice of {uuid} set to {interval} for claim {label}")

    def _reset_time_slices(self, entry: dict) -> None:
        """Back to the default for the GPUs the claim set, unless another prepared claim set
        them too; a failure is said, not raised (an unprepare that fails is retried for ever)."""
        def mine(e):
            return {d["uuid"] for d in e["devices"] if (d["sharing"] or {}).get("strategy") == "TimeSlicing"
                    and (d["sharing"] or {}).get("kind") == "gpu"}

        others = set().union(*(mine(e) for u, e in self.claims.items() if u != entry["uid"]))
        smi = sharing.smi_path(self.inv)
        for uuid in sorted(mine(entry) - others):
            try:
                if smi is None:
                    raise NvcError("device", "the driver has no nvidia-smi")
                self.run(sharing.timeslice_argv(smi, uuid, "Default"))
            except NvcError as exc:
                self.say(f"time-slice of {uuid} not reset: {exc.detail}")

    async def unprepare(self, namespace: str, name: str, uid: str) -> None:
        """Remove what :meth:`prepare` made for the claim; nothing known is not an error (a
        repeated unprepare, or a claim this node never prepared)."""
        claimspec.check_uid(uid)
        async with self._lock(uid):
            path = os.path.join(self.cdi_root, claimspec.file_name(uid))
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise NvcError("cdi", f"cannot remove {escape(path)}: {exc.strerror.lower()}") from None
            known = self.claims.get(uid) or {"namespace": namespace, "name": name, "uid": uid}
            await asyncio.to_thread(self._mps_stop, known)
            if uid in self.claims:
                await asyncio.to_thread(self._reset_time_slices, self.claims[uid])
                async with self.saving:
                    del self.claims[uid]
                    await asyncio.to_thread(checkpoint.save, self.state_dir, dict(self.claims))


def record(claim: claims.Claim) -> dict:
    """The checkpoint's entry of a resolved claim (what its spec's comment also carries)."""
    devices = []
    for u in claim.units:
        device = {"request": u.request, "pool": claim.pool, "device": u.device, "uuid": u.uuid,
                  "cdi": [claimspec.cdi_name(claim.uid, u.device)], "sharing": u.sharing.to_dict(), "shareID": u.share_id}
        if u.admin:
            device["adminAccess"] = True
        devices.append(device)
    return {"namespace": claim.namespace, "name": claim.name, "uid": claim.uid, "devices": devices,
            "spec": claimspec.file_name(claim.uid)}
