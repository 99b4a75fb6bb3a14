"""Legacy mode: the prestart hook, and the container's GPU device nodes written into its spec.

Upstream's shim adds only the hook, which allows the devices in the container's cgroup behind
the runtime's back. systemd keeps its own copy of a container's device rules (from the spec,
with the systemd cgroup driver) and writes it back on ``systemctl daemon-reload``: the hook's
rules are gone and NVML in the container says "Unknown Error" (toolkit#48, the toolkit's most
reported problem). Here every device node the plan gives the container is also in
``linux.devices`` and ``linux.resources.devices``, so the rules are the runtime's own and survive
a reload; the hook still binds the host's nodes and the driver's files.

The nodes and rules are the plan's (:func:`..plan.build.build_plan` for the request, the one
decision the hook also makes), never worked out a second time. Pure: plain data in and out.
"""

from __future__ import annotations

import math
import os

from ..inventory.catalog import DEFAULT_PATH
from ..plan.model import Plan
from .specdict import items, table

# Hooks that already do the work: upstream's two names, ours, and the served client.
HOOK_NAMES = frozenset({"nvidia-container-runtime-hook", "nvidia-container-toolkit", "nvcontainer-hook",
                        "nvcontainer-hook-client"})
HOOK_ENV = (f"PATH={DEFAULT_PATH}",)
TIMEOUT_MARGIN = 30   # seconds beyond the hook's own deadline before the runtime kills it


def is_gpu_hook(entry: object) -> bool:
    """Whether a ``hooks.prestart`` entry runs NVIDIA's hook or ours (by program name, or the
    Python client run as a script)."""
    if not isinstance(entry, dict):
        return False
    args = entry.get("args") if isinstance(entry.get("args"), list) else []
    names = [entry.get("path"), *args[:1]]
    if any(isinstance(n, str) and os.path.basename(n) in HOOK_NAMES for n in names):
        return True
    return any(isinstance(a, str) and (a.endswith("/nvcontainer/hook/client.py") or a == "nvcontainer.hook")
               for a in args)


def hook_entry(path: str, config_file: str | None, deadline: float) -> dict:
    """The prestart entry the shim adds: an explicit environment (never the runtime's or the
    image's) and a timeout past the hook's own deadline, so the hook reports first."""
    args = [os.path.basename(path)] + (["--config", config_file] if config_file else []) + ["prestart"]
    return {"path": path, "args": args, "env": list(HOOK_ENV), "timeout": math.ceil(deadline) + TIMEOUT_MARGIN}


def _rule(rule: str) -> dict:
    kind, numbers, access = rule.split()
    major, minor = numbers.split(":")
    return {"allow": True, "type": kind, "major": int(major), "minor": int(minor), "access": access}


def add_hook(spec: dict, hook: dict) -> None:
    """Add the hook, unless a GPU hook is there already, in place."""
    prestart = items(table(spec, "hooks"), "prestart", "config.json: hooks")
    if not any(is_gpu_hook(h) for h in prestart):
        prestart.append(hook)


def add_prestart(spec: dict, hook: dict) -> None:
    """Add a prestart entry whatever is there (CDI mode's ``bind-lease``), in place."""
    items(table(spec, "hooks"), "prestart", "config.json: hooks").append(hook)


def apply(spec: dict, hook: dict, plan: Plan) -> None:
    """Add the hook (unless a GPU hook is there already) and the plan's nodes and rules, in place."""
    add_hook(spec, hook)
    if not plan.cgroups:
        return   # no-cgroups: the operator keeps every device rule out of our hands
    linux = table(spec, "linux")
    devices = items(linux, "devices", "config.json: linux")
    present = {d.get("path") for d in devices if isinstance(d, dict)}
    for d in plan.devices:
        if d.path not in present:
            devices.append({"path": d.path, "type": "c", "major": d.major, "minor": d.minor, "fileMode": 0o666,
                            "uid": 0, "gid": 0})
    rules = items(table(linux, "resources", "config.json: linux"), "devices", "config.json: linux.resources")
    for rule in map(_rule, plan.cgroup_rules):
        if rule not in rules:
            rules.append(rule)
