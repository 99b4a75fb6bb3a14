"""Where the driver's files are read, and what the host calls that place: NVIDIA's two flags.

Why two: the plugin runs in a pod and sees the host only where its DaemonSet mounts it, but the
CDI specs it writes are read by the node's runtime, for which only host paths exist. NVIDIA's
kubelet plugin takes the driver root as a *host* path (``--nvidia-driver-root``,
``NVIDIA_DRIVER_ROOT`` or ``HOST_DRIVER_ROOT``, default ``/``) and reads it where it is mounted
(``--container-driver-root``, ``DRIVER_ROOT_CTR_PATH``, default ``/driver-root``); a DaemonSet
written for NVIDIA's plugin therefore works with only its image and command changed.

Run on the host itself (no ``/driver-root``, no container root given) the two are one path:
the host root given, or the global ``--root`` (config ``root``).
"""

from __future__ import annotations

import os

from ..errors import NvcError, escape

CONTAINER_DEFAULT = "/driver-root"


def roots(host: str | None, container: str | None, config_root: str, isdir=os.path.isdir) -> tuple[str, str]:
    """(where we read the driver root, what the host calls it)."""
    for flag, value in (("--nvidia-driver-root", host), ("--container-driver-root", container)):
        if value is not None and not value.startswith("/"):
            raise NvcError("input", f"{flag} {escape(value)}: must be an absolute path")
    if container is None and isdir(CONTAINER_DEFAULT):
        container = CONTAINER_DEFAULT
    if container is not None:
        return container, host or "/"
    view = host or config_root
    return view, view
