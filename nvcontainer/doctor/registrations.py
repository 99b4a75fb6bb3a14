"""Which GPU hooks and runtimes the container engines on this node are set up to run: podman
and CRI-O hooks.d files, Docker's ``daemon.json`` and PATH, containerd's and CRI-O's TOML.

What ``nvcontainer setup`` can register, and NVIDIA's own names, are recognised here, so
``doctor`` can say whether an engine will reach the GPUs and through which program.
"""

from __future__ import annotations

import json
import os
import re

from .. import log
from ..errors import escape
from ..native.build import NAME as NATIVE_CLIENT

HOOK_NAMES = {"nvcontainer-hook": "nvcontainer", "nvidia-container-runtime-hook": "nvidia-container-toolkit",
              "nvidia-container-toolkit": "nvidia-container-toolkit"}
HOOKS_DIRS = ("/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d")
CONFIG_CAP = 1 << 20
MAX_HOOK_FILES = 256
# The Python hook client as registrations name it (before the package layout of 0.2: hookclient.py).
PYTHON_CLIENTS = ("/nvcontainer/hook/client.py", "/nvcontainer/hookclient.py")


def registrations(etc: str = "/") -> list[tuple[str, str, str]]:
    """(engine, what, file) for every GPU hook or runtime an engine's configuration names."""
    def at(path: str) -> str:
        return os.path.join(etc, path.lstrip("/"))

    found = []
    for directory in HOOKS_DIRS:
        try:
            names = sorted(n for n in os.listdir(at(directory)) if n.endswith(".json"))[:MAX_HOOK_FILES]
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            what = _hooks_d_entry(_read(at(path)))
            if what:
                found.append(("podman/CRI-O", what, path))
    daemon = _read(at("/etc/docker/daemon.json"))
    found += [("docker", what, "/etc/docker/daemon.json") for what in _docker(daemon)]
    for path in ("/etc/containerd/config.toml", "/etc/crio/crio.conf"):
        what = _runtime_in_toml(_read(at(path)))
        if what:
            found.append(("containerd" if "containerd" in path else "CRI-O", what, path))
    return found


def _read(path: str) -> str | None:
    from ..inventory.procfs import read_text

    try:
        return read_text(path, CONFIG_CAP)
    except OSError as exc:
        log.warning(f"cannot read {escape(path)}: {exc.strerror}")
        return None


def _provider(program: str) -> str | None:
    return HOOK_NAMES.get(os.path.basename(program))


def _hooks_d_entry(text: str | None) -> str | None:
    """What an OCI hooks.d JSON file registers, if it is a GPU hook."""
    try:
        hook = json.loads(text or "null")["hook"]
        provider = _provider(hook["path"])
        args = hook.get("args") or []
        native = isinstance(hook["path"], str) and os.path.basename(hook["path"]) == NATIVE_CLIENT
        if not provider and (native or any(isinstance(a, str) and a.endswith(PYTHON_CLIENTS) for a in args)):
            return f"nvcontainer hook {hook['path']} (client of nvcontainer serve)"
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return f"{provider} hook {hook['path']}" if provider else None


def _docker(text: str | None) -> list[str]:
    try:
        runtimes = json.loads(text or "null").get("runtimes") or {}
        return [f"nvidia-container-toolkit runtime '{name}' ({r.get('path')})" for name, r in runtimes.items()
                if "nvidia" in str(r.get("path", ""))]
    except (ValueError, AttributeError):
        return []


def _runtime_in_toml(text: str | None) -> str | None:
    """containerd's and CRI-O's TOML: a runtime or hook whose program is an NVIDIA one."""
    if not text:
        return None
    match = re.search(r"""["']?(/[^"'\s]*nvidia-container-runtime[^"'\s]*)""", text)
    return f"nvidia-container-toolkit runtime {match.group(1)}" if match else None
