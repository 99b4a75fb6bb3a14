"""Is a CDI spec stale for the running driver?

A spec is a snapshot: after a driver upgrade its library paths name the old version and the
engine fails the container start on a missing mount source (toolkit#146, #1853); after a GPU
change its device numbers or its device list are wrong. The deciding part here is pure: it
takes the spec, the running driver's facts and a ``probe`` function standing in for ``stat``;
:func:`running` and :func:`probe` are the readers.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable

from ..errors import escape
from ..inventory import procfs
from ..records import record
from .generate import DRIVER_ANNOTATION, DRIVER_COMMENT
from .store import SpecFile

MAX_SHOWN = 12
_COMMENT = re.compile(rf"^#\s*{re.escape(DRIVER_COMMENT)}\s*(\S+)\s*$", re.M)
_LIBRARY_VERSION = re.compile(r"/lib(?:cuda|nvidia-ml)\.so\.([0-9]+\.[0-9]+(?:\.[0-9]+)?)\Z")
_GPU_NODE = re.compile(r"/dev/nvidia(\d+)")
# Specs that hold some of the node's GPUs by design, so a GPU missing from them is no sign of
# age: the DRA driver's one spec per prepared claim (its vendor and class are NVIDIA's).
PARTIAL_KINDS = ("k8s.gpu.nvidia.com/claim",)

# What a path is, as far as staleness goes: ("c", major, minor) for a character device, ("b", ...)
# for a block device, or a type letter with zeros ("d", "f", "s", "p"); None when missing.
Probe = Callable[[str], "tuple[str, int, int] | None"]


@record
class Running:
    driver_version: str | None                  # None: no driver loaded
    gpus: tuple[tuple[int, str], ...] = ()      # (device minor, bus id) from /proc/driver/nvidia/gpus


@record
class Verdict:
    path: str
    recorded_version: str | None
    devices: int
    problems: tuple[str, ...]

    @property
    def stale(self) -> bool:
        return bool(self.problems)

    def lines(self) -> list[str]:
        """The verdict as ``check`` prints it: one line, then the problems and a fix."""
        made = f"driver {self.recorded_version}" if self.recorded_version else "driver version not recorded"
        if not self.stale:
            return [f"{escape(self.path)}: ok ({made}, {self.devices} devices)"]
        out = [f"{escape(self.path)}: stale ({made})"]
        out += [f"  {p}" for p in self.problems[:MAX_SHOWN]]
        if len(self.problems) > MAX_SHOWN:
            out.append(f"  ... and {len(self.problems) - MAX_SHOWN} more")
        out.append(f"  fix: nvcontainer cdi generate --output {escape(self.path)} (with the options used before)")
        return out


def recorded_version(spec_file: SpecFile) -> str | None:
    """The driver version the spec was made for: our annotation (JSON) or header comment
    (YAML), else the version in the name of the libcuda or NVML library it mounts."""
    annotations = spec_file.spec.get("annotations")
    if isinstance(annotations, dict) and isinstance(annotations.get(DRIVER_ANNOTATION), str):
        return annotations[DRIVER_ANNOTATION]
    match = _COMMENT.search(spec_file.text[:4096])
    if match:
        return match.group(1)
    for edits in _edits(spec_file.spec):
        for mount in edits.get("mounts") or ():
            found = _LIBRARY_VERSION.search(str(mount.get("hostPath") or ""))
            if found:
                return found.group(1)
    return None


def _edits(spec: dict) -> list[dict]:
    out = [spec.get("containerEdits") or {}]
    out += [d.get("containerEdits") or {} for d in spec["devices"]]
    return out


def evaluate(spec_file: SpecFile, now: Running, probe: Probe) -> Verdict:
    spec = spec_file.spec
    version = recorded_version(spec_file)
    problems: list[str] = []
    if version and now.driver_version is None:
        problems.append("no NVIDIA driver is loaded")
    elif version and version != now.driver_version:
        problems.append(f"made for driver {escape(version, 40)}, the running driver is {now.driver_version}")
    nodes: dict[str, dict] = {}
    mounts: dict[str, None] = {}
    hooks: dict[str, None] = {}
    for edits in _edits(spec):
        for node in edits.get("deviceNodes") or ():
            nodes.setdefault(str(node.get("hostPath") or node.get("path")), node)
        for mount in edits.get("mounts") or ():
            mounts[str(mount.get("hostPath"))] = None
        for hook in edits.get("hooks") or ():
            hooks[str(hook.get("path"))] = None
    for host, node in nodes.items():
        problems += _node_problems(host, node, probe(host))
    problems += [f"missing {escape(path)}" for path in mounts if probe(path) is None]
    problems += [f"missing hook program {escape(path)}" for path in hooks if probe(path) is None]
    listed = {int(m.group(1)) for n in nodes.values() if (m := _GPU_NODE.fullmatch(str(n.get("path"))))}
    if listed and spec.get("kind") not in PARTIAL_KINDS:
        problems += [f"GPU {escape(bus)} (/dev/nvidia{minor}) is not in the spec"
                     for minor, bus in now.gpus if minor not in listed]
    return Verdict(spec_file.path, version, len(spec["devices"]), tuple(problems))


def _node_problems(host: str, node: dict, found) -> list[str]:
    if found is None:
        return [f"missing device node {escape(host)}"]
    kind, major, minor = found
    wanted = node.get("type") or "c"
    if kind != wanted:
        return [f"{escape(host)} is not a {'character' if wanted == 'c' else escape(wanted)} device"]
    if node.get("major") is not None and (major, minor) != (node.get("major"), node.get("minor")):
        return [f"{escape(host)} is {major}:{minor}, the spec says {node.get('major')}:{node.get('minor')}"]
    return []


# --- readers -----------------------------------------------------------------------------------


def running(proc: str = "/proc") -> Running:
    gpus = []
    for bus in procfs.gpu_bus_dirs(proc):
        minor = procfs.gpu_information(proc, bus).get("Device Minor", "")
        if minor.isascii() and minor.isdigit():
            gpus.append((int(minor), bus))
    return Running(procfs.driver_version(proc), tuple(sorted(gpus)))


_TYPES = ((stat.S_ISCHR, "c"), (stat.S_ISBLK, "b"), (stat.S_ISDIR, "d"), (stat.S_ISREG, "f"),
          (stat.S_ISSOCK, "s"), (stat.S_ISFIFO, "p"))


def probe(path: str) -> tuple[str, int, int] | None:
    """``stat`` (following symlinks, as the engine's bind mount does), reduced to a type letter
    and the device numbers."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    kind = next((letter for test, letter in _TYPES if test(st.st_mode)), "?")
    if kind in ("c", "b"):
        return kind, os.major(st.st_rdev), os.minor(st.st_rdev)
    return kind, 0, 0
