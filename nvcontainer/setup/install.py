"""Where this installation's programs are, and which of them an engine should be given.

The package puts everything under ``/usr/lib/nvcontainer`` (an interpreter environment of its
own) with the native programs prebuilt there; an installation from source has the console
scripts in its virtual environment's ``bin`` and builds the native programs when set-up runs,
with the node's C compiler. Either way the registration an engine gets is the served one by
default: the native hook client (about a millisecond to hand the run to ``nvcontainer serve``,
the in-process hook when no server answers), or, where it can be neither found nor built, the
client module run by this installation's interpreter without ``site``.
"""

from __future__ import annotations

import math
import os

from ..inventory.catalog import DEFAULT_PATH
from ..records import record

HOOK = "nvcontainer-hook"
CLIENT = "nvcontainer-hook-client"
RUNTIME = "nvidia-container-runtime"
TIMEOUT_MARGIN = 30   # seconds a hooks.d timeout gives beyond the hook's own deadline


@record
class Install:
    bin_dir: str                    # nvcontainer, nvcontainer-hook, the drop-in names
    python: str                     # this installation's interpreter
    client_module: str              # .../nvcontainer/hook/client.py
    client_ready: bool = False      # the native client is there (the package ships it)
    runtime_ready: bool = False     # the runtime shim's front is there
    can_build: bool = False         # a C compiler is here to build the missing ones
    can_build_runtime: bool = False

    def program(self, name: str) -> str:
        return os.path.join(self.bin_dir, name)

    @property
    def native_client(self) -> str | None:
        return self.program(CLIENT) if self.client_ready or self.can_build else None

    @property
    def runtime(self) -> str | None:
        return self.program(RUNTIME) if self.runtime_ready or self.can_build_runtime else None


def hook_entry(inst: Install, *, served: bool, deadline: float) -> dict:
    """An OCI hook entry (``hooks.prestart`` of a bundle, ``hook`` of a hooks.d file), always
    with an explicit environment (never the runtime's) and a timeout clearly longer than the
    hook's own deadline, so the hook reports its failure before the runtime kills it."""
    native = inst.native_client
    if served and native:
        entry = {"path": native, "args": [native, "prestart"]}
    elif served:
        entry = {"path": inst.python, "args": [inst.python, "-I", "-S", inst.client_module, "prestart"]}
    else:
        entry = {"path": inst.program(HOOK), "args": [HOOK, "prestart"]}
    return {**entry, "env": [f"PATH={DEFAULT_PATH}"], "timeout": math.ceil(deadline) + TIMEOUT_MARGIN}


def locate(bin_dir: str, python: str, client_module: str, prefix: str = "/") -> Install:
    """This installation, as found on disk (its native programs under ``prefix``, where set-up
    builds them)."""
    from ..native import build as native

    def ready(name: str) -> bool:
        paths = {os.path.join(bin_dir, name), os.path.join(prefix, bin_dir.lstrip("/"), name)}
        return any(os.path.isfile(p) and os.access(p, os.X_OK) for p in paths)

    cc = native.compiler() is not None
    return Install(bin_dir=bin_dir, python=python, client_module=client_module, client_ready=ready(CLIENT),
                   runtime_ready=ready(RUNTIME), can_build=cc,
                   can_build_runtime=cc and hasattr(native, "build_runtime"))
