"""The ``nvcontainer-hook`` program: which hook a run is, and whether a resident server does it.

Why a module of its own: one program carries the prestart hook and the CDI hooks, and its
first step on a container start is to offer the run to ``nvcontainer serve``
(:mod:`.client`); only when nobody takes it is the hook's own code imported here. Neither hook
imports the other, and the server's request child calls :func:`run` directly, never offering
the run back to itself.
"""

from __future__ import annotations

import gc
import sys

from .client import forward

# The CDI hooks a spec from ``nvcontainer cdi generate`` names (:data:`.cdi.SUBCOMMANDS`);
# spelt out so the prestart path does not import that module to tell them apart.
CDI_HOOKS = ("create-symlinks", "update-ldcache", "disable-device-node-modification")


def run(argv: list[str]) -> int:
    """One hook run in this process."""
    # A hook run is short and leaves no cycles worth collecting, yet the collector would walk the
    # tens of thousands of objects the imports create, again and again (about 5% of a run).
    gc.disable()
    if argv and argv[0] in CDI_HOOKS:
        from .cdi import main as cdi_hook

        return cdi_hook(argv)
    from .prestart import run as prestart

    return prestart(argv)


def main(argv: list[str] | None = None) -> int:
    """``nvcontainer-hook``: a prestart run is first offered to a resident server."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[-1:] == ["prestart"]:
        status = forward(argv)
        if status is not None:
            return status
    return run(argv)


def main_nvidia_container_runtime_hook(argv: list[str] | None = None) -> int:
    """The ``nvidia-container-runtime-hook`` drop-in: what ``docker run --gpus`` looks up in
    PATH and runs as ``nvidia-container-runtime-hook prestart``. Upstream's single-dash flags
    (``-config FILE``, ``-debug``, ``-version``) are mapped onto ours."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mapped: list[str] = []
    while argv:
        arg = argv.pop(0)
        if arg in ("-version", "--version"):
            from .. import __version__

            sys.stdout.write(f"NVIDIA Container Runtime Hook version {__version__} (nvcontainer)\n")
            return 0
        if arg in ("-debug", "--debug"):
            mapped += ["--debug", "/dev/stderr"]
        elif arg in ("-config", "--config") and argv:
            mapped += ["--config", argv.pop(0)]
        elif arg.startswith("-config="):
            mapped += ["--config", arg.split("=", 1)[1]]
        else:
            mapped.append(arg)
    return main(mapped)
