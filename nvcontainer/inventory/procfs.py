"""Readers for the driver's procfs files and ``/proc/devices``.

The kernel module is the authority on what is loaded right now, so the driver version, device
majors and MIG capability minors come from here rather than from files under the driver root.
``proc`` is a parameter (default ``/proc``) only so tests can point the readers at a fake tree;
the commands always read the real procfs. Reads are bounded and never follow symlinks.
"""

from __future__ import annotations

import os
import stat

from ..fs.bounded import read_at_most

MAX_FILE = 1 << 20       # procfs text files are a few KiB; anything bigger is not the driver's
MAX_ENTRIES = 4096       # bound on directory listings (gpus/*)

DRIVER_DIR = "driver/nvidia"


def read_text(path: str, limit: int = MAX_FILE) -> str | None:
    """Contents of a small text file, or None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return read_at_most(fd, limit)[0].decode("utf-8", "replace")
    finally:
        os.close(fd)


# Compiled by re on first use: a hook's start reads neither file (its inventory is cached), and
# importing re costs it milliseconds.
_VERSION = r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)"
_MINOR = r"^DeviceFileMinor:\s*(\d+)\s*$"


def driver_version(proc: str = "/proc") -> str | None:
    """NVRM version of the loaded kernel module, None when no driver is loaded."""
    text = read_text(os.path.join(proc, DRIVER_DIR, "version"))
    if text is None:
        return None
    import re

    m = re.search(_VERSION, text)
    return m.group(1) if m else None


def char_majors(proc: str = "/proc") -> dict[str, int]:
    """Character-device majors by driver name, from ``/proc/devices``."""
    text = read_text(os.path.join(proc, "devices")) or ""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices:"):
            in_char = True
            continue
        if line.startswith("Block devices:"):
            break
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isascii() and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def gpu_bus_dirs(proc: str = "/proc") -> list[str]:
    """Bus ids listed under ``/proc/driver/nvidia/gpus``."""
    try:
        names = []
        with os.scandir(os.path.join(proc, DRIVER_DIR, "gpus")) as it:
            for entry in it:
                if len(names) >= MAX_ENTRIES:
                    break
                names.append(entry.name)
        return sorted(names)
    except OSError:
        return []


def gpu_information(proc: str, bus_id: str) -> dict[str, str]:
    """``gpus/<bus>/information`` as a key → value map (``Device Minor``, ``GPU UUID``, ...)."""
    text = read_text(os.path.join(proc, DRIVER_DIR, "gpus", bus_id, "information")) or ""
    info = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    return info


def cap_minor(proc: str, cap_path: str) -> int | None:
    """``DeviceFileMinor`` of a capability file such as ``.../mig/gi1/access``."""
    rel = cap_path[len("/proc/"):] if cap_path.startswith("/proc/") else cap_path.lstrip("/")
    text = read_text(os.path.join(proc, rel))
    if text is None:
        return None
    import re

    m = re.search(_MINOR, text, re.M)
    return int(m.group(1)) if m else None


def mig_minors(proc: str = "/proc") -> tuple[tuple[str, int], ...]:
    """Lines of ``/proc/driver/nvidia-caps/mig-minors``: ``config 1``, ``gpu0/gi1/access 12``..."""
    text = read_text(os.path.join(proc, "driver/nvidia-caps/mig-minors")) or ""
    out = []
    for line in text.splitlines()[:MAX_ENTRIES * 4]:
        parts = line.split()
        if len(parts) == 2 and parts[1].isascii() and parts[1].isdigit():
            out.append((parts[0], int(parts[1])))
    return tuple(out)
