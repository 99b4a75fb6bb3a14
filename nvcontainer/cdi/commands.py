"""The imperative shell of ``nvcontainer cdi``: read the host, call the pure parts, write.

Kept out of ``cli.py`` so the command line stays a thin layer, and out of the pure modules so
they stay testable without a host.
"""

from __future__ import annotations

import os
import shutil
import sys

from ..errors import NvcError
from ..inventory.model import Inventory
from . import check, generate, store


def default_hook_path() -> str:
    """The ``nvcontainer-hook`` installed with this ``nvcontainer``: beside the interpreter
    (a virtualenv's bin/), else the first in PATH, as an absolute path (engines run hooks by
    path, not through PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), generate.HOOK_PROGRAM)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(generate.HOOK_PROGRAM)
    if found:
        return os.path.abspath(found)
    raise NvcError("input", f"{generate.HOOK_PROGRAM} is neither beside {sys.executable} nor in PATH: "
                            "give --hook-path")


def generate_spec(inv: Inventory, opts: generate.Options, fmt: str, output: str | None) -> str | None:
    """The spec text for standard output, or None once it is written to ``output``."""
    text = generate.render(generate.generate(inv, opts), fmt, inv.driver_version)
    if output is None:
        return text
    store.write_atomic(output, text)
    return None


def list_names(dirs) -> tuple[list[str], list[str]]:
    """Lines for standard output (one device name each) and warnings."""
    specs, problems = store.scan(dirs)
    lines = []
    for name in store.resolve_names(specs):
        if name.conflicts:
            lines.append(f"{name.name} (conflict: {' '.join([name.path, *name.conflicts])})")
        else:
            lines.append(name.name)
    return lines, problems


def check_specs(dirs, files) -> tuple[list[check.Verdict], list[str]]:
    """Verdicts for ``files``, or for every spec in ``dirs`` when no file is named."""
    if files:
        specs, problems = [], []
        for path in files:
            try:
                specs.append(store.read_spec(path))
            except NvcError as exc:
                problems.append(exc.detail)
    else:
        specs, problems = store.scan(dirs)
    now = check.running()
    return [check.evaluate(s, now, check.probe) for s in specs], problems
