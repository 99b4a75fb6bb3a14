"""Let a container's device cgroup open the device nodes injected into it.

One rule model (:class:`Rule`: one exact device, no wildcards), two back ends: cgroup v1 takes
the rules as lines in ``devices.allow``; cgroup v2 has no such file and needs them spliced into
the eBPF program the runtime attached. The back ends (ctypes, bpf(2)) are imported only when
used, since this runs on the OCI hook's start-up path.
"""

from __future__ import annotations


from ..errors import NvcError, escape
from .locate import CgroupTarget, in_user_namespace, locate
from .rules import Rule, parse_rule

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:   # annotations only: collections.abc imports collections, a start's 1 ms
    from collections.abc import Callable, Iterable

__all__ = ["CgroupTarget", "Rule", "apply_rules", "in_user_namespace", "locate", "parse_rule"]


def apply_rules(pid: int, rules: Iterable[Rule], *, mountinfo_pid: int | None = None,
                still_ours: Callable[[], object] | None = None) -> str:
    """Allow ``rules`` in the devices cgroup of ``pid``; returns a line for the debug log.

    ``mountinfo_pid`` is the process whose mount table says where cgroups are mounted (the
    runtime, in hook mode); by default this process's own. ``still_ours`` is called after
    ``/proc/PID/cgroup`` was read and before anything is written; it raises if ``pid`` may no
    longer be the container (a pinned pidfd that saw the process exit), so a reused PID can
    never lead the rules into another process's cgroup.
    """
    if type(pid) is not int or pid <= 0:
        raise NvcError("cgroup", f"invalid container pid: {escape(pid)}")
    wanted = tuple(dict.fromkeys(rules))
    if any(not isinstance(rule, Rule) for rule in wanted):
        raise TypeError("apply_rules takes Rule values")
    if not wanted:
        return "no device rules to add"
    target = locate(pid, mountinfo_pid)
    if still_ours is not None:
        still_ours()
    if target.version == 1:
        from . import v1

        return v1.allow(target.path, wanted)
    from . import v2

    return v2.allow(target.path, wanted)
