"""Applying a plan: the only place that changes anything, and only what the plan says.

Order: pin the container; prepare every source on the host (and the sealed ldconfig copy);
start one worker, which enters the container's mount namespace, places mounts, device nodes,
symlinks and files, and then runs ldconfig in its sandbox; once the worker says the mounts are
placed, this host process gives the devices cgroup the plan's rules (through the cgroup
filesystem or bpf(2)) while ldconfig runs. A failure at any step stops the run with one line
naming the step.

Why one worker for both container steps: each worker costs a fork, a ``setns`` and an exit,
and ldconfig needs the mounts placed first anyway, so the worker that placed them becomes the
sandbox and then ldconfig itself (it leaves for a private copy of the namespace, and it was
forked into the sandbox's other namespaces: ``worker.start(..., isolated=True)``). Why the
cgroup step beside ldconfig and not after it: it needs nothing from the container's namespace
and nothing ldconfig does, only ``/proc/PID`` reads in this process, which must stay in the
host's namespace. Why not beside the mounts too: placing them is also a
check (a target under a shared mount, i.e. a "container" that is in fact the host's namespace
where the pin cannot tell, is refused there), and no device may be granted before it passed.
If the cgroup step fails, the worker is killed and reaped before the error goes on, so nothing
keeps changing a container whose start is failing.

Only the pin step and the cgroup step look the container up by its PID; the others hold fds.
The cgroup step re-checks the pin after reading ``/proc/PID``: a container that died and whose
number went to a host process in between would otherwise hand that process its devices.
"""

from __future__ import annotations

import os
import time

from .. import log
from ..errors import NvcError
from ..plan.model import Plan
from . import cost, ldconfig, mounter, worker
from .pin import pin


def apply(plan: Plan, *, deadline: float = 30.0, mountinfo_pid: int | None = None) -> None:
    if not plan.gpu:
        return
    if plan.pid is None:
        raise NvcError("input", "applying a plan needs the container's --pid")
    end = time.monotonic() + deadline
    pinned = pin(plan.pid)
    fds: list[int] = []
    job = None
    try:
        if plan.ldconfig is not None:
            # Checked and opened before anything is mounted: a bad program fails the run early.
            job = ldconfig.prepare_run(
                plan.rootfs, list(plan.ldconfig.directories), ldconfig_host_path=plan.ldconfig.ldconfig.removeprefix("@"),
                uid=plan.owner[0], gid=plan.owner[1],
            )
        actions, fds = mounter.prepare(plan)
        log.info(f"prepared {len(fds)} detached mounts")
        started = time.monotonic()
        running = worker.start(
            place_then_ldconfig, pinned.mntns_fd, plan.rootfs, actions, list(plan.owner), fds, job, log.enabled(),
            deadline=_left(end, "mount"), name="mount worker", category="mount",
            keep_fds=[pinned.mntns_fd, *fds, *([job.exe] if job else [])], isolated=job is not None,
        )
        try:
            for fd in fds:
                os.close(fd)
            fds = []
            # The devices only after the mounts are in: see the module docstring.
            log_placed(running.wait() if job is None else running.next_stage(), plan.rootfs, started)
            if plan.cgroups:
                _cgroups(plan, pinned, mountinfo_pid)
        except BaseException:
            running.kill()
            raise
        if job is not None:
            ldconfig.report(running.wait(), job.program)
            log.info("ldconfig done")
        if not pinned.alive():
            raise NvcError("container", f"container process {plan.pid} exited during configuration")
    finally:
        for fd in fds:
            os.close(fd)
        if job is not None:
            job.close()
        pinned.close()


def log_placed(reply: dict, rootfs: str, started: float | None = None) -> None:
    for w in reply["warnings"]:
        log.warning(w)
    log.info(f"placed {reply['done']} actions in {rootfs}")
    if "usage" in reply and started is not None:
        log.info(cost.describe("placing, in the worker", reply["usage"], started))


def place_then_ldconfig(mntns_fd: int, rootfs: str, actions: list[dict], owner: list[int], held: list[int],
                        job: ldconfig.Job | None, measure: bool = False) -> dict:
    """Worker body: the plan's entries and mounts, then (if the plan has it) ldconfig, as a
    second stage of the same worker, so its failures still read as ldconfig's. With
    ``measure`` (a ``--debug`` run), the reply says what the placing cost the worker."""
    meter = cost.Meter() if measure else None
    try:
        before = meter.sample() if meter else None
        placed = mounter.place(mntns_fd, rootfs, actions, owner)
        if meter is not None:
            placed["usage"] = [before, meter.sample()]
    finally:
        if meter is not None:
            meter.close()
    if job is None:
        return placed
    worker.stage("ldconfig", "ldcache", placed)
    # The sandbox is this process, which holds every fd until it arranges its own: the
    # namespace and the detached mounts (attached now) go first.
    for fd in (mntns_fd, *held):
        os.close(fd)
    if tuple(owner) != (0, 0):
        # place() created entries as the owner; the sandbox opens and locks the rootfs by path
        # as root, as a worker of its own would (an owner's fsuid drops the file capabilities,
        # and a path to the rootfs through a root-only directory would then be refused).
        from .ns import set_fs_identity

        set_fs_identity(os.geteuid(), os.getegid())
    return ldconfig.sandbox(job)


def _left(end: float, step: str) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise NvcError("timeout", f"deadline passed before the {step} step")
    return left


def _cgroups(plan: Plan, pinned, mountinfo_pid: int | None) -> None:
    from ..cgroups import apply_rules, in_user_namespace, parse_rule

    userns = in_user_namespace(plan.pid)
    _still_there(pinned)
    if userns:
        log.warning("container runs in a user namespace: devices cgroup left alone (use --no-cgroups)")
        return
    result = apply_rules(plan.pid, [parse_rule(r) for r in plan.cgroup_rules], mountinfo_pid=mountinfo_pid,
                         still_ours=lambda: _still_there(pinned))
    log.info(f"devices cgroup: {result}")


def _still_there(pinned) -> None:
    """After a read of ``/proc/PID``: what was read belonged to the pinned process only if it is
    still alive now (its number cannot have been reused while it lives)."""
    if not pinned.alive():
        raise NvcError("container", f"container process {pinned.pid} exited during configuration")
