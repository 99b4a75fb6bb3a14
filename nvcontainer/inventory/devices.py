"""Device nodes of the driver, verified by ``st_rdev``.

The numbers come from the kernel (fixed 195 for the NVIDIA major, ``/proc/devices`` for the
dynamic uvm, caps and IMEX majors); the node files under the driver root must carry exactly
those numbers. A node with other numbers is refused rather than trusted: bind-mounting it would
give a container some other device, and its cgroup rule would not match what it opens.
"""

from __future__ import annotations

import os
import stat

from .. import log
from ..errors import NvcError
from .model import CTL_MINOR, MODESET_MINOR, NVIDIA_MAJOR, DeviceNode


def check_node(root: str, node: DeviceNode) -> bool:
    """True when the node exists with the right numbers, False when it is absent."""
    path = os.path.join(root, node.path.lstrip("/")) if root != "/" else node.path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise NvcError("detection", f"stat failed: {node.path}: {exc.strerror.lower()}") from None
    if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) != node.major or os.minor(st.st_rdev) != node.minor:
        found = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if stat.S_ISCHR(st.st_mode) else "not a character device"
        raise NvcError(
            "detection",
            f"invalid device node: {node.path}: expected {node.major}:{node.minor}, found {found}",
        )
    return True


def control_nodes(root: str, majors: dict[str, int]) -> list[DeviceNode]:
    """nvidiactl, nvidia-uvm, nvidia-uvm-tools and nvidia-modeset, those that exist."""
    wanted = [DeviceNode("/dev/nvidiactl", NVIDIA_MAJOR, CTL_MINOR)]
    uvm = majors.get("nvidia-uvm")
    if uvm is not None:
        wanted += [DeviceNode("/dev/nvidia-uvm", uvm, 0), DeviceNode("/dev/nvidia-uvm-tools", uvm, 1)]
    else:
        log.warning("nvidia-uvm is not in /proc/devices")
    wanted.append(DeviceNode("/dev/nvidia-modeset", NVIDIA_MAJOR, MODESET_MINOR))
    present = []
    for node in wanted:
        if check_node(root, node):
            present.append(node)
        else:
            log.warning(f"missing device {node.path}")
    return present


def cap_node(root: str, caps_major: int | None, minor: int | None) -> DeviceNode | None:
    if caps_major is None or minor is None:
        return None
    node = DeviceNode(f"/dev/nvidia-caps/nvidia-cap{minor}", caps_major, minor)
    return node if check_node(root, node) else None
