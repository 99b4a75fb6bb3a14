"""Which version of an engine this node runs, and which routes need a newer one.

Routes differ by version: containerd reads ``enable_cdi`` in its CRI plugin from 1.7 only (1.6
ignores the key without a word), Docker reads ``features.cdi`` from 25, and containerd 2 has a
new configuration layout. ``setup`` asks the engine (``PROGRAM --version``: an absolute path
found on a fixed PATH, a fixed environment, ``/`` as working directory, a time limit), and says
plainly when a route needs a newer one rather than writing a key the engine would skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from ..inventory.catalog import DEFAULT_PATH

PROGRAMS = {"docker": "dockerd", "containerd": "containerd", "crio": "crio", "podman": "podman"}
TIMEOUT = 10.0
# (engine, route) -> the first version that has it, and what the route is called in messages
NEEDS = {
    ("containerd", "cdi"): ((1, 7), "CDI in containerd's CRI plugin (enable_cdi)"),
    ("docker", "cdi"): ((25, 0), "CDI devices in Docker (features.cdi)"),
    ("podman", "cdi"): ((4, 1), "CDI devices in podman"),
}


def parse(text: str) -> tuple[int, ...] | None:
    """The first dotted version number in ``text`` (``containerd github.com/containerd/containerd
    1.6.20~ds1 ...`` → (1, 6, 20); ``Docker version 20.10.24+dfsg1, build ...`` → (20, 10, 24))."""
    m = re.search(r"(?<![\w.])v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def of(engine: str) -> tuple[int, ...] | None:
    """The engine's version, asked of its program; None when it is not installed or does not say."""
    program = shutil.which(PROGRAMS.get(engine, engine), path=DEFAULT_PATH)
    if program is None:
        return None
    try:
        res = subprocess.run([program, "--version"], capture_output=True, text=True, errors="replace", cwd="/",
                             env={"PATH": DEFAULT_PATH}, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse(res.stdout[:4096]) if res.returncode == 0 else None


def shown(version: tuple[int, ...] | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))


def lacks(engine: str, route: str, version: tuple[int, ...] | None) -> str | None:
    """Why ``route`` cannot work on this version (None: it can, or the version is unknown)."""
    need = NEEDS.get((engine, route))
    if need is None or version is None or version[:2] >= need[0]:
        return None
    return f"{need[1]} needs {engine} {shown(need[0])} or later; this node has {shown(version)}"
