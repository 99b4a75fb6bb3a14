"""The consolidated driver volume: one versioned directory holding the driver's user-space files.

Orchestrators from before per-file injection (Mesos' ``gpu/nvidia`` isolator, nvidia-docker 1)
give a container the whole driver as one directory, ``nvidia_<driver version>/`` with ``bin/``,
``lib/`` and ``lib64/``, bound read-only at ``/usr/local/nvidia``; CUDA images of that era point
their loader at ``/usr/local/nvidia/lib`` and ``/usr/local/nvidia/lib64``. As there, ``lib64/``
holds the 64-bit libraries and ``lib/`` the 32-bit ones, so the old images' search order finds
the right word size either way.

:func:`entries` decides the contents from the inventory (pure); :mod:`nvcontainer.apply.volume`
builds them on the host for ``nvcontainer volume create``, and the plan mounts the one of the
running driver's version into containers that ask for it.
"""

from __future__ import annotations

import os

from ..errors import NvcError, escape
from ..inventory.model import Inventory
from ..records import record

CONTAINER_PATH = "/usr/local/nvidia"
PREFIX = "nvidia_"
LABEL = "com.nvidia.volumes.needed"
LABEL_VALUE = "nvidia_driver"
# Compiled by re on first use: the hook imports this module on every start, and only
# nvidia-docker 1 images (the volume label) match either.
_VERSION = r"[0-9]{1,6}(?:\.[0-9]{1,6}){0,3}"
NAME = PREFIX + r"([0-9]{1,6}(?:\.[0-9]{1,6}){0,3})"
# what nvcontainer serve compiles before it forks (serve/server.py preload), so no request does
PATTERNS = (_VERSION, NAME)
MAX_ENTRIES = 4096


@record
class Entry:
    """``path`` inside the version directory (``lib64/libcuda.so.1``); a copy of the host file
    ``source``, or a symlink to ``target`` (a name in the same directory)."""

    path: str
    source: str = ""
    target: str = ""


def version_dir(base: str, version: str) -> str:
    return os.path.join(base, PREFIX + check_version(version))


def check_version(version: str) -> str:
    import re

    if not re.fullmatch(_VERSION, version or ""):
        raise NvcError("input", f"invalid driver version '{escape(version, 40)}' (expected digits and dots)")
    return version


def entries(inv: Inventory, groups: frozenset[str], compat32: bool) -> list[Entry]:
    """The volume's files: binaries of ``groups``, their libraries (32-bit ones only with
    ``compat32``) and the SONAME/``.so`` links the host keeps beside each library."""
    out: dict[str, Entry] = {}
    root = inv.root.rstrip("/")
    for b in inv.binaries:
        if b.group in groups:
            out.setdefault(f"bin/{os.path.basename(b.path)}", Entry(f"bin/{os.path.basename(b.path)}", root + b.path))
    libsets = [("lib64", inv.libraries)] + ([("lib", inv.libraries32)] if compat32 else [])
    for directory, libs in libsets:
        chosen = [lib for lib in libs if lib.group in groups]
        for lib in chosen:
            name = os.path.basename(lib.path)
            out.setdefault(f"{directory}/{name}", Entry(f"{directory}/{name}", root + lib.path))
        for lib in chosen:
            for link, target in lib.links:
                path = f"{directory}/{link}"
                if "/" not in link and path not in out:
                    out[path] = Entry(path, target=os.path.basename(target))
    return sorted(out.values(), key=lambda e: e.path)
