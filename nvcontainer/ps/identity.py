"""Which engine started a container and under what ID and name: pure readings of the cgroup
path engines choose and of the annotations they put in the OCI spec.

Engines name cgroups after the container: systemd's driver makes ``docker-<id>.scope``,
``libpod-<id>.scope``, ``cri-containerd-<id>.scope``, ``crio-<id>.scope``; cgroupfs makes
``/docker/<id>``, ``/libpod_parent/libpod-<id>`` or ``/kubepods/<qos>/pod<uid>/<id>``. The
name is not in the path; the annotations (CRI's, CRI-O's, nerdctl's) carry it.

A container no engine or runtime state names (plain runc with its own ``--root``, the Mesos
containerizer, anything whose ID is not 64 hex digits) is still named by what the kernel shows:
its cgroup directory's last component (:func:`from_kernel`) and its init's command line.
"""

from __future__ import annotations

import re

_SCOPE = re.compile(r"(docker|libpod|cri-containerd|crio)-([0-9a-f]{64})(?:\.scope)?")
_BARE = re.compile(r"[0-9a-f]{64}")
_ENGINES = {"docker": "docker", "libpod": "podman", "cri-containerd": "containerd", "crio": "cri-o"}


def from_cgroup(path: str) -> tuple[str, str]:
    """(engine, container ID) the cgroup path shows, ("", "") when it shows none."""
    parts = [p for p in path.split("/") if p]
    kube = any(p.startswith("kubepods") for p in parts)
    for at in range(len(parts) - 1, -1, -1):
        m = _SCOPE.fullmatch(parts[at])
        if m:
            return ("kubernetes" if kube else _ENGINES[m.group(1)]), m.group(2)
        if _BARE.fullmatch(parts[at]):
            parent = parts[at - 1] if at else ""
            if kube:
                return "kubernetes", parts[at]
            return ("docker" if parent == "docker" else ""), parts[at]
    return "", ""


MAX_KERNEL_ID = 128


def from_kernel(path: str) -> str:
    """The last component of a cgroup path, as the ID of a container nothing else names;
    "" for the root. Bounded; the caller escapes it where it is shown."""
    return path.rstrip("/").rpartition("/")[2][:MAX_KERNEL_ID]


def name_from_annotations(annotations: dict[str, str]) -> str:
    """The engine's name for a container: ``namespace/pod/container`` under Kubernetes."""
    get = annotations.get
    container = get("io.kubernetes.cri.container-name") or get("io.kubernetes.container.name")
    pod = (get("io.kubernetes.cri.sandbox-name") or get("io.kubernetes.pod.name"))
    namespace = get("io.kubernetes.cri.sandbox-namespace") or get("io.kubernetes.pod.namespace")
    if container and pod:
        return "/".join(p for p in (namespace, pod, container) if p)
    return get("nerdctl/name") or get("io.podman.annotations.name") or container or ""


def annotations_from_labels(labels) -> dict[str, str]:
    """runc keeps the spec's annotations in its state as ``key=value`` labels (and ``bundle=``)."""
    out: dict[str, str] = {}
    for label in labels if isinstance(labels, list) else ():
        if isinstance(label, str) and "=" in label:
            key, _, value = label.partition("=")
            out.setdefault(key, value)
    return out
