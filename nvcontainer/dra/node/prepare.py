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

from ...cdi import generate, store
from ... import log
from ...errors import NvcError, escape
from ...mps import control as mpscontrol
from . import checkpoint, claims, claimspec, exclusive, mpsclaim, sharing
from .prepared import PreparedClaim, PreparedDevice

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
        self.busy: dict[str, PreparedClaim] = {}     # UID → entry of a prepare in progress (its devices held)
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

    async def prepare(self, namespace: str, name: str, uid: str,
                      deadline: float | None = None) -> tuple[PreparedDevice, ...]:
        """The claim's device records (with their CDI names); NvcError naming the claim."""
        claimspec.check_uid(uid)
        deadline = deadline or time.monotonic() + KUBELET_TIMEOUT
        async with self._lock(uid):
            entry = self.claims.get(uid)
            path = os.path.join(self.cdi_root, claimspec.file_name(uid))
            if entry is not None and (not entry.devices or os.path.exists(path)):
                await asyncio.to_thread(self._mps_start, entry)       # each kept when it answers
                return entry.devices        # prepared before (a claim of no device here has no spec)
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
            entry = PreparedClaim.of(resolved)
            # checked and taken with no await in between: the event loop runs one prepare at a time here
            why = exclusive.conflict(entry.devices, {**self.claims, **self.busy}, self._parents(), uid)
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
            return entry.devices

    def _parents(self) -> dict[str, str]:
        return {m.uuid: g.uuid for g in self.inv.gpus for m in g.migs}

    def _write(self, claim: claims.Claim, entry: PreparedClaim) -> None:
        daemons = self._mps_start(entry)
        try:
            self._time_slices(sharing.wanted(claim.units), claim.label)
            if claim.units:
                spec = claimspec.build(self.inv, claim, self.opts)
                if daemons:
                    spec = mpsclaim.reaching(spec, claim.uid, daemons)
                text = claimspec.render(spec, entry.to_json(), self.inv.driver_version)
                store.write_atomic(os.path.join(self.cdi_root, entry.spec), text)
        except BaseException:
            if daemons:
                self._mps_stop(entry)
            raise

    def _mps_start(self, entry: PreparedClaim) -> list:
        """The claim's MPS daemons running, one per configuration group that asks MPS (each kept
        when it answers); [] when none asks it."""
        label = entry.label
        daemons = mpsclaim.plans(self.state_dir, entry.uid, entry.devices, label)
        if not daemons:
            return []
        try:
            binary = mpscontrol.control_binary(self.inv)
        except NvcError as exc:
            raise NvcError("device", f"claim {escape(label, 200)}: MPS asked: {exc.detail}") from None
        try:
            smi = sharing.smi_path(self.inv, "MPS sets the GPUs' compute mode with it")
        except NvcError as exc:
            raise NvcError("device", f"claim {escape(label, 200)}: MPS asked: {exc.detail}") from None
        started = []
        try:
            for plan in daemons:
                for uuid in _whole_gpus(entry, plan.devices):
                    self._smi(sharing.mode_argv(smi, uuid, "EXCLUSIVE_PROCESS"), label)
                mpsclaim.start(plan, binary, self.mps_deadline, label)
                started.append(plan)
        except BaseException:
            if started:
                self._mps_stop(entry)
            else:
                self._reset_modes(entry)
            raise
        return daemons

    async def check_daemons(self) -> None:
        """Each prepared claim's MPS daemons asked whether they answer; one that died while its
        clients run is said in one line, naming the claim and group, and started again (its
        clients' CUDA contexts are lost with it: they must start again too). Under each claim's
        lock: an unprepare in progress is never undone by a restart."""
        for uid in list(self.claims):
            async with self._lock(uid):
                if uid in self.claims:
                    await asyncio.to_thread(self._check_daemons, uid, self.claims[uid])

    def _check_daemons(self, uid: str, entry: PreparedClaim) -> None:
        try:
            binary = mpscontrol.control_binary(self.inv)
        except NvcError:
            return                     # no MPS here at all: no claim of ours has a daemon
        label = entry.label
        for plan in mpsclaim.plans(self.state_dir, uid, entry.devices, label):
            daemon = mpsclaim.control(plan.directory, plan.uuids, binary, self.mps_deadline, label)
            if daemon.answers():
                try:
                    mpsclaim.start(plan, binary, self.mps_deadline, label)
                    why = "started again"
                except NvcError as exc:
                    why = f"not started again: {exc.detail}"
                self.say(f"MPS daemon of claim {escape(label, 200)} ({plan.group}) died while its clients "
                         f"ran; {why}: its clients must start again")

    def _smi(self, argv: list[str], label: str) -> None:
        try:
            self.run(argv)
        except NvcError as exc:
            raise NvcError("device", f"claim {escape(label, 200)}: {exc.detail}") from None
        log.info(f"nvidia-smi {' '.join(argv[1:])} for claim {label}")

    def _reset_modes(self, entry: PreparedClaim) -> None:
        """The claim's MPS GPUs back to the DEFAULT compute mode; a failure is said, not raised."""
        gpus = _whole_gpus(entry, [d.device for d in entry.devices if d.sharing.strategy == "MPS"])
        for uuid in gpus:
            try:
                self.run(sharing.mode_argv(sharing.smi_path(self.inv, "to reset the compute mode"), uuid, "DEFAULT"))
            except NvcError as exc:
                self.say(f"compute mode of {uuid} not reset: {exc.detail}")

    def _mps_stop(self, entry: PreparedClaim) -> None:
        """The claim's daemon told to quit and its directory removed; a failure is said."""
        try:
            binary = mpscontrol.control_binary(self.inv)
        except NvcError:
            binary = None
        label = entry.label
        why = mpsclaim.stop(self.state_dir, entry.uid, binary, self.mps_deadline, label)
        if why:
            self.say(f"MPS daemon of claim {escape(label, 200)}: {why}; its directory is removed")
        self._reset_modes(entry)

    def _time_slices(self, intervals: dict[str, str], label: str) -> None:
        """Set each GPU's time-slice (NvcError naming the GPU when nvidia-smi fails)."""
        if not intervals:
            return
        try:
            smi = sharing.smi_path(self.inv, "time-slicing is set with it")
        except NvcError as exc:
            raise NvcError("device", f"claim {escape(label, 200)}: {exc.detail}") from None
        for uuid, interval in intervals.items():
            self.run(sharing.mode_argv(smi, uuid, "DEFAULT"))
            self.run(sharing.timeslice_argv(smi, uuid, interval))
            log.info(f"time-slice of {uuid} set to {interval} for claim {label}")

    def _reset_time_slices(self, entry: PreparedClaim) -> None:
        """Back to the default for the GPUs the claim set, unless another prepared claim set
        them too; a failure is said, not raised (an unprepare that fails is retried for ever)."""
        def mine(e: PreparedClaim) -> set[str]:
            return {d.uuid for d in e.devices if d.sharing.strategy == "TimeSlicing" and d.sharing.kind == "gpu"}

        others = set().union(*(mine(e) for u, e in self.claims.items() if u != entry.uid))
        for uuid in sorted(mine(entry) - others):
            try:
                self.run(sharing.timeslice_argv(sharing.smi_path(self.inv, "to reset the time-slice"), uuid, "Default"))
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
            known = self.claims.get(uid) or PreparedClaim.nothing(namespace, name, uid)
            await asyncio.to_thread(self._mps_stop, known)
            if uid in self.claims:
                await asyncio.to_thread(self._reset_time_slices, self.claims[uid])
                async with self.saving:
                    del self.claims[uid]
                    await asyncio.to_thread(checkpoint.save, self.state_dir, dict(self.claims))


def _whole_gpus(entry: PreparedClaim, devices) -> list[str]:
    """The UUIDs of the whole GPUs among the entry's ``devices`` (DRA names): a compute mode is a
    GPU's (a MIG device has none of its own)."""
    wanted = set(devices)
    return list(dict.fromkeys(d.uuid for d in entry.devices if d.device in wanted and d.sharing.kind == "gpu"))
