"""Applying a plan: the only place that changes anything, and only what the plan says.

Order: pin the container; prepare every source on the host; one worker in the container's
mount namespace places mounts, device nodes, symlinks and files; the devices cgroup gets the
plan's rules (from this host process, through the cgroup filesystem or bpf(2)); ldconfig runs
in its own sandbox. A failure at any step stops the run with one line naming the step.

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
from . import mounter, worker
from .pin import pin


def apply(plan: Plan, *, deadline: float = 30.0, mountinfo_pid: int | None = None) -> None:
    if not plan.gpu:
        return
    if plan.pid is None:
        raise NvcError("input", "applying a plan needs the container's --pid")
    end = time.monotonic() + deadline
    pinned = pin(plan.pid)
    fds: list[int] = []
    try:
        actions, fds = mounter.prepare(plan)
        log.info(f"prepared {len(fds)} detached mounts")
        reply = worker.run(
            mounter.place, pinned.mntns_fd, plan.rootfs, actions, list(plan.owner),
            deadline=_left(end, "mount"), name="mount worker", keep_fds=[pinned.mntns_fd, *fds], category="mount",
        )
        for w in reply["warnings"]:
            log.warning(w)
        log.info(f"placed {reply['done']} actions in {plan.rootfs}")
        for fd in fds:
            os.close(fd)
        fds = []
        if plan.cgroups:
            _cgroups(plan, pinned, mountinfo_pid)
        if plan.ldconfig is not None:
            from .ldconfig import run_ldconfig

            run_ldconfig(
                pinned.mntns_fd, plan.rootfs, list(plan.ldconfig.directories),
                ldconfig_host_path=plan.ldconfig.ldconfig.removeprefix("@"),
                uid=plan.owner[0], gid=plan.owner[1], deadline=_left(end, "ldconfig"),
            )
            log.info("ldconfig done")
        if not pinned.alive():
            raise NvcError("container", f"container process {plan.pid} exited during configuration")
    finally:
        for fd in fds:
            os.close(fd)
        pinned.close()


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
