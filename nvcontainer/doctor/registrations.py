"""Which GPU hooks and runtimes the container engines on this node are set up to run: podman and
CRI-O hooks.d files, Docker's ``daemon.json`` and dockerd's PATH (``--gpus``), containerd's
``config.toml`` with its imports and ``nvidia-container-cli`` on PATH (``ctr --gpus``), CRI-O's
``crio.conf`` and ``crio.conf.d``.

Every registration ``nvcontainer setup`` can make is recognised here, and NVIDIA's own, so
``doctor`` can say whether an engine will reach the GPUs, through which program, and whose
program it is: a program is nvcontainer's when it is one of its names or sits beside an
``nvcontainer`` program (the package's ``/usr/lib/nvcontainer/bin``, a virtual environment's
``bin``), links followed inside the tree looked at.
"""

from __future__ import annotations

import glob
import os

from .. import log
from ..documents import json_value, toml_value
from ..errors import NvcError, escape
from ..inventory.catalog import DEFAULT_PATH
from ..native.build import NAME as NATIVE_CLIENT

OURS = {"nvcontainer-hook", NATIVE_CLIENT, "nvcontainer-runtime"}
NVIDIA_NAMES = {"nvidia-container-runtime-hook", "nvidia-container-toolkit", "nvidia-container-runtime",
                "nvidia-container-runtime.cdi", "nvidia-container-runtime.legacy", "nvidia-container-cli"}
HOOKS_DIRS = ("/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d")
CONFIG_CAP = 1 << 20
MAX_FILES = 256
# The Python hook client as registrations name it (before the package layout of 0.2: hookclient.py).
PYTHON_CLIENTS = ("/nvcontainer/hook/client.py", "/nvcontainer/hookclient.py")
CONTAINERD = "/etc/containerd/config.toml"
CRI_KEYS = ("io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime", "cri")


def _at(etc: str, path: str) -> str:
    return os.path.join(etc, path.lstrip("/"))


def _read(path: str) -> str | None:
    from ..inventory.procfs import read_text

    try:
        return read_text(path, CONFIG_CAP)
    except OSError as exc:
        log.warning(f"cannot read {escape(path)}: {exc.strerror}")
        return None


def _resolve(etc: str, path: str) -> str:
    """``path`` (absolute, as the engine names it) with links followed inside ``etc``."""
    for _ in range(16):
        try:
            target = os.readlink(_at(etc, path))
        except OSError:
            return path
        path = target if target.startswith("/") else os.path.normpath(os.path.join(os.path.dirname(path), target))
    return path


def provider(etc: str, program: object) -> str | None:
    """``nvcontainer``, ``nvidia-container-toolkit`` or None (not a GPU program)."""
    if not isinstance(program, str) or not program.startswith("/"):
        return None
    real = _resolve(etc, program)
    names = {os.path.basename(program), os.path.basename(real)}
    beside = os.path.join(os.path.dirname(real), "nvcontainer")
    if names & OURS or os.path.exists(_at(etc, beside)) or os.path.exists(beside):
        return "nvcontainer" if names & (OURS | NVIDIA_NAMES) else None
    return "nvidia-container-toolkit" if names & NVIDIA_NAMES else None


def _hooks_d_entry(etc: str, text: str | None) -> str | None:
    """What an OCI hooks.d JSON file registers, if it is a GPU hook."""
    try:
        hook = json_value(text or "null", "hooks.d entry", cap=CONFIG_CAP)["hook"]
        path, args = hook["path"], hook.get("args") or []
        native = isinstance(path, str) and os.path.basename(path) == NATIVE_CLIENT
        if native or any(isinstance(a, str) and a.endswith(PYTHON_CLIENTS) for a in args):
            return f"nvcontainer hook {path} (client of nvcontainer serve)"
        who = provider(etc, path)
    except (NvcError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return f"{who} hook {path}" if who else None


def _toml(path: str, text: str | None) -> dict:
    try:
        return toml_value(text or "", escape(path), cap=CONFIG_CAP)
    except NvcError as exc:
        log.warning(f"not valid TOML: {exc.detail}")
        return {}


def _on_path(etc: str, name: str) -> tuple[str, str] | None:
    for d in DEFAULT_PATH.split(":"):
        path = os.path.join(d, name)
        if os.path.lexists(_at(etc, path)):
            who = provider(etc, path)
            return (f"{who} {name}", path) if who else None
    return None


def _docker(etc: str) -> list[tuple[str, str, str]]:
    path = "/etc/docker/daemon.json"
    found = []
    try:
        doc = json_value(_read(_at(etc, path)) or "null", path, cap=CONFIG_CAP) or {}
        runtimes = doc.get("runtimes") or {}
        default = doc.get("default-runtime")
        for name, r in runtimes.items():
            who = provider(etc, r.get("path"))
            if who:
                extra = ", the default runtime" if name == default else ""
                found.append(("docker", f"{who} runtime '{name}' ({r.get('path')}{extra})", path))
        if (doc.get("features") or {}).get("cdi") is True:
            found.append(("docker", "CDI devices (features.cdi)", path))
    except (NvcError, ValueError, AttributeError):
        pass
    gpus = _on_path(etc, "nvidia-container-runtime-hook")
    if gpus:
        found.append(("docker --gpus", gpus[0] + " on dockerd's PATH", gpus[1]))
    return found


def containerd_files(etc: str) -> list[tuple[str, dict]]:
    """(path, document) of containerd's config.toml and each file it imports, in its order."""
    main = _toml(CONTAINERD, _read(_at(etc, CONTAINERD)))
    files = [(CONTAINERD, main)] if main else []
    imports = main.get("imports") if isinstance(main.get("imports"), list) else []
    for pattern in imports[:MAX_FILES]:
        if not isinstance(pattern, str):
            continue
        pattern = pattern if pattern.startswith("/") else os.path.join(os.path.dirname(CONTAINERD), pattern)
        for real in sorted(glob.glob(_at(etc, pattern)))[:MAX_FILES]:
            path = "/" + os.path.relpath(real, _at(etc, "/"))
            files.append((path, _toml(path, _read(real))))
    return files


def _containerd(etc: str) -> list[tuple[str, str, str]]:
    found = []
    for path, doc in containerd_files(etc):
        plugins = doc.get("plugins") if isinstance(doc.get("plugins"), dict) else {}
        for key in CRI_KEYS:
            cri = plugins.get(key)
            if not isinstance(cri, dict):
                continue
            core = cri.get("containerd") if isinstance(cri.get("containerd"), dict) else {}
            runtimes = core.get("runtimes") if isinstance(core.get("runtimes"), dict) else {}
            for name, r in runtimes.items():
                options = r.get("options") if isinstance(r, dict) and isinstance(r.get("options"), dict) else {}
                binary = options.get("BinaryName")
                who = provider(etc, binary)
                if who:
                    extra = ", the default runtime" if core.get("default_runtime_name") == name else ""
                    found.append(("containerd", f"{who} runtime handler '{name}' ({binary}{extra})", path))
            if cri.get("enable_cdi") is True:
                found.append(("containerd", "CDI in the CRI plugin (enable_cdi)", path))
    ctr = _on_path(etc, "nvidia-container-cli")
    if ctr:
        found.append(("containerd ctr --gpus", ctr[0] + " on PATH", ctr[1]))
    return found


def _crio(etc: str) -> list[tuple[str, str, str]]:
    found = []
    names = sorted(glob.glob(_at(etc, "/etc/crio/crio.conf.d/*.toml")))[:MAX_FILES]
    for path in ["/etc/crio/crio.conf", *("/" + os.path.relpath(n, _at(etc, "/")) for n in names)]:
        doc = _toml(path, _read(_at(etc, path)))
        runtime = (doc.get("crio") or {}).get("runtime") if isinstance(doc.get("crio"), dict) else None
        runtimes = runtime.get("runtimes") if isinstance(runtime, dict) else None
        for name, r in (runtimes or {}).items():
            program = r.get("runtime_path") if isinstance(r, dict) else None
            who = provider(etc, program)
            if who:
                extra = ", the default runtime" if runtime.get("default_runtime") == name else ""
                found.append(("CRI-O", f"{who} runtime '{name}' ({program}{extra})", path))
    return found


def registrations(etc: str = "/") -> list[tuple[str, str, str]]:
    """(engine, what, file) for every GPU hook or runtime an engine's configuration names."""
    found = []
    for directory in HOOKS_DIRS:
        try:
            names = sorted(n for n in os.listdir(_at(etc, directory)) if n.endswith(".json"))[:MAX_FILES]
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            what = _hooks_d_entry(etc, _read(_at(etc, path)))
            if what:
                found.append(("podman/CRI-O", what, path))
    return found + _docker(etc) + _containerd(etc) + _crio(etc)


def problems(etc: str = "/") -> list[str]:
    """Registrations set up by ``setup`` that no longer hold: containerd's drop-in out of date."""
    from ..setup import containerd
    from ..setup.perform import current

    def read(path: str) -> str | None:
        try:
            return current(_at(etc, path))
        except (NvcError, OSError):   # a file doctor cannot read is not for this check to report
            return None

    def expand(pattern: str) -> list[str]:
        return sorted("/" + os.path.relpath(p, _at(etc, "/")) for p in glob.glob(_at(etc, pattern)))

    why = containerd.stale(read, expand)
    return [f"{containerd.DROPIN}: {why}"] if why else []
