"""Which low-level runtime the shim runs: the first of ``runtimes`` (config) found, by absolute
path or on a fixed PATH.

Why a fixed PATH: the shim runs as root from an engine, and the engine's PATH is whatever the
engine was started with; a root program should not run whatever a variable of its caller
points at first. Names are looked up in :data:`SAFE_PATH` only; ``native/runtime.c`` searches
the same directories in the same order (a test holds them together). A runtime that would be
the shim itself is skipped, or every command would call itself until the node gave out.
"""

from __future__ import annotations

import os
import stat

from ..errors import NvcError, escape
from ..inventory.catalog import DEFAULT_PATH as SAFE_PATH

SHIM_NAMES = ("nvidia-container-runtime", "nvcontainer-runtime")


def _runnable(path: str, own: tuple[int, int] | None) -> bool:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(st.st_mode) and os.access(path, os.X_OK) and (st.st_dev, st.st_ino) != own


def find(names: tuple[str, ...], search: str = SAFE_PATH, own: tuple[int, int] | None = None) -> str:
    """The absolute path of the first of ``names`` that is an executable file. ``own``: the
    (st_dev, st_ino) of the shim's program, never chosen."""
    for name in names:
        if os.path.basename(name) in SHIM_NAMES:
            continue
        candidates = [name] if name.startswith("/") else [os.path.join(d, name) for d in search.split(":") if d]
        for path in candidates:
            if _runnable(path, own):
                return path
    raise NvcError("runtime", f"no low-level runtime found: none of {escape(', '.join(names))} is an executable "
                              f"file (names are looked up in {SAFE_PATH}; set runtimes in [nvidia-container-runtime])")
