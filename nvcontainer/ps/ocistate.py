"""What the low-level runtimes' state directories say about running containers.

runc keeps ``<root>/<id>/state.json`` (the init's pid and start time, the spec's annotations as
labels, the bundle); crun keeps ``<root>/<id>/status`` (pid, bundle) beside the bundle's
``config.json``. Engines give runc their own roots: Docker ``/run/docker/runtime-runc/moby``,
containerd ``/run/containerd/runc/<namespace>``, podman ``/run/crun`` or ``/run/runc``, plain runc
``/run/runc``. Docker keeps the name in its own ``config.v2.json``; podman in its storage's
``containers.json``, two levels above the bundle (``<graphroot>/<driver>-containers/<id>/userdata``). All of these are root's files, still read bounded
and without following a symlink at the last step: a confused entry is skipped, never trusted.
"""

from __future__ import annotations

import json
import os
import re

from ..inventory.procfs import read_text
from .naming import annotations_from_labels, name_from_annotations

MAX_STATE = 4 << 20
MAX_STORAGE = 32 << 20    # containers/storage's list of every container on the host
MAX_ENTRIES = 65536
ROOTS = (("runc", "/run/runc"), ("runc", "/run/docker/runtime-runc/moby"), ("crun", "/run/crun"),
         ("runc", "/run/containerd/runc/*"), ("runc", "/run/user/0/runc"))
DOCKER_CONTAINERS = "/var/lib/docker/containers"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,1023}")


def read_json(path: str, limit: int = MAX_STATE):
    """A small JSON document, or None: missing, a symlink, not a regular file, too large (cut
    short, so not JSON) or not JSON."""
    try:
        text = read_text(path, limit)
        return None if text is None else json.loads(text)
    except (OSError, ValueError, RecursionError):
        return None


def _entries(directory: str) -> list[str]:
    try:
        with os.scandir(directory) as it:
            names = []
            for entry in it:
                if len(names) >= MAX_ENTRIES:
                    break
                if entry.is_dir(follow_symlinks=False) and _ID.fullmatch(entry.name):
                    names.append(entry.name)
            return names
    except OSError:
        return []


def _roots(roots) -> list[tuple[str, str]]:
    out = []
    for runtime, root in roots:
        if root.endswith("/*"):
            out += [(runtime, os.path.join(root[:-2], sub)) for sub in _entries(root[:-2])]
        else:
            out.append((runtime, root))
    return out


def storage_name(bundle, container_id: str) -> str:
    """podman's name for a container, from containers/storage's ``containers.json``."""
    if not isinstance(bundle, str) or not bundle.startswith("/") or os.path.basename(bundle) != "userdata":
        return ""
    doc = read_json(os.path.join(os.path.dirname(os.path.dirname(bundle)), "containers.json"), MAX_STORAGE)
    for entry in doc if isinstance(doc, list) else ():
        if isinstance(entry, dict) and entry.get("id") == container_id:
            names = entry.get("names")
            if isinstance(names, list) and names and isinstance(names[0], str):
                return names[0]
    return ""


def _bundle_annotations(bundle) -> dict[str, str]:
    if not isinstance(bundle, str) or not bundle.startswith("/"):
        return {}
    spec = read_json(os.path.join(bundle, "config.json"))
    annotations = spec.get("annotations") if isinstance(spec, dict) else None
    if not isinstance(annotations, dict):
        return {}
    return {k: v for k, v in annotations.items() if isinstance(k, str) and isinstance(v, str)}


def docker_name(container_id: str, containers: str = DOCKER_CONTAINERS) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", container_id):
        return ""
    doc = read_json(os.path.join(containers, container_id, "config.v2.json"))
    name = doc.get("Name") if isinstance(doc, dict) else None
    return name.lstrip("/") if isinstance(name, str) else ""


def states(roots=ROOTS) -> dict[int, tuple[str, str, str]]:
    """init pid → (runtime, container ID, name) for every container a runtime's state shows."""
    out: dict[int, tuple[str, str, str]] = {}
    for runtime, root in _roots(roots):
        for name in _entries(root):
            where = os.path.join(root, name)
            if runtime == "crun":
                doc = read_json(os.path.join(where, "status"))
                pid = doc.get("pid") if isinstance(doc, dict) else None
                bundle = doc.get("bundle") if isinstance(doc, dict) else None
                annotations = _bundle_annotations(bundle)
            else:
                doc = read_json(os.path.join(where, "state.json"))
                pid = doc.get("init_process_pid") if isinstance(doc, dict) else None
                config = doc.get("config") if isinstance(doc, dict) else None
                annotations = annotations_from_labels(config.get("labels")) if isinstance(config, dict) else {}
                bundle = annotations.get("bundle")
            if type(pid) is not int or pid <= 0:
                continue
            out[pid] = (runtime, name, name_from_annotations(annotations) or storage_name(bundle, name))
    return out
