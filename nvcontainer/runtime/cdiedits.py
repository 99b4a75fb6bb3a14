"""A CDI device's edits applied to an OCI spec, as the engines' CDI library applies them.

Why here and not in the engine: a node whose engine has no CDI (Docker before 25, containerd
1.6 without ``enable_cdi``, a Kubernetes device plugin passing CDI names in annotations) gets
CDI devices through the runtime shim. The result must be what podman or containerd would
have written: ``env`` entries replace a variable of the same name, else are appended; a device
node goes into ``linux.devices`` (a node already at that path is replaced) with an allow rule in
``linux.resources.devices`` (default access ``rwm``), its type and numbers taken from the host
node when the spec leaves them out; a mount replaces any mount at the same destination, and the
mounts are then ordered by depth (stable) so a parent is mounted before its children; hooks
join their stage. Device edits come first, then each spec's common edits once.

Pure: the host's nodes are seen only through ``probe`` (:func:`..cdi.check.probe`'s shape).
"""

from __future__ import annotations

import os

from ..errors import NvcError, escape
from .specdict import items as _list, table as _table

HOOK_STAGES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")
_UNSUPPORTED = ("intelRdt", "netDevices")


def _absolute(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise NvcError("cdi", f"{where}: expected an absolute path, got {escape(repr(value), 80)}")
    return value


def _env(spec: dict, entries: list) -> None:
    process = _table(spec, "process")
    env = _list(process, "env")
    for entry in entries:
        name = entry.partition("=")[0]
        same = [i for i, e in enumerate(env) if isinstance(e, str) and e.partition("=")[0] == name]
        if same:
            env[same[0]] = entry
            for i in reversed(same[1:]):
                del env[i]
        else:
            env.append(entry)


def _node(spec: dict, node: dict, where: str, probe) -> None:
    path = _absolute(node.get("path"), f"{where}.path")
    host = _absolute(node.get("hostPath") or path, f"{where}.hostPath")
    kind, major, minor = node.get("type"), node.get("major"), node.get("minor")
    mode = node.get("fileMode")
    if kind is None or (kind != "p" and (major is None or minor is None)):
        found = probe(host)
        if found is None:
            raise NvcError("cdi", f"{where}: device node {escape(host)} does not exist on this host")
        if found[0] not in ("c", "b", "p") or (kind is not None and kind != found[0]):
            raise NvcError("cdi", f"{where}: {escape(host)} is not a {escape(kind or 'device')} node")
        kind, major, minor = found[0], found[1], found[2]
    if kind not in ("c", "b", "p", "u"):
        raise NvcError("cdi", f"{where}.type: {escape(kind, 20)} is not c, b, u or p")
    access = node.get("permissions") or "rwm"
    if not isinstance(access, str) or not access or set(access) - set("rwm"):
        raise NvcError("cdi", f"{where}.permissions: expected r, w and m, got {escape(access, 20)}")
    entry: dict = {"path": path, "type": kind, "major": major, "minor": minor}
    entry["fileMode"] = mode if isinstance(mode, int) and not isinstance(mode, bool) else 0o666
    for key in ("uid", "gid"):
        if node.get(key) is not None:
            entry[key] = node[key]
    linux = _table(spec, "linux")
    devices = _list(linux, "devices")
    devices[:] = [d for d in devices if not (isinstance(d, dict) and d.get("path") == path)] + [entry]
    if kind != "p":
        rules = _list(_table(linux, "resources"), "devices")
        rules.append({"allow": True, "type": "c" if kind == "u" else kind, "major": major, "minor": minor,
                      "access": access})


def _mount(spec: dict, mount: dict, where: str) -> None:
    destination = _absolute(mount.get("containerPath"), f"{where}.containerPath")
    entry: dict = {"source": _absolute(mount.get("hostPath"), f"{where}.hostPath"), "destination": destination}
    if mount.get("type"):
        entry["type"] = mount["type"]
    options = mount.get("options")
    if options:
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise NvcError("cdi", f"{where}.options: expected a list of strings")
        entry["options"] = list(options)
    mounts = _list(spec, "mounts")
    mounts[:] = [m for m in mounts if not (isinstance(m, dict) and m.get("destination") == destination)] + [entry]


def _hook(spec: dict, hook: dict, where: str) -> None:
    stage = hook.get("hookName")
    if stage not in HOOK_STAGES:
        raise NvcError("cdi", f"{where}.hookName: {escape(stage, 40)} is not an OCI hook stage")
    entry: dict = {"path": _absolute(hook.get("path"), f"{where}.path")}
    for key in ("args", "env"):
        if hook.get(key) is not None:
            entry[key] = list(hook[key])
    if hook.get("timeout") is not None:
        entry["timeout"] = hook["timeout"]
    _list(_table(spec, "hooks"), stage).append(entry)


def _depth(mount: object) -> int:
    destination = mount.get("destination") if isinstance(mount, dict) else None
    return len([p for p in os.path.normpath(str(destination or "/")).split("/") if p])


def apply(spec: dict, edits: dict, where: str, probe) -> None:
    """Apply one ``containerEdits`` mapping (validated as ``cdi check`` does) to ``spec``, in place."""
    for key in _UNSUPPORTED:
        if edits.get(key):
            raise NvcError("cdi", f"{where}.{key}: not supported by nvcontainer-runtime")
    if edits.get("env"):
        _env(spec, edits["env"])
    for i, node in enumerate(edits.get("deviceNodes") or ()):
        _node(spec, node, f"{where}.deviceNodes[{i}]", probe)
    for i, mount in enumerate(edits.get("mounts") or ()):
        _mount(spec, mount, f"{where}.mounts[{i}]")
    for i, hook in enumerate(edits.get("hooks") or ()):
        _hook(spec, hook, f"{where}.hooks[{i}]")
    gids = edits.get("additionalGids") or edits.get("additionalGIDs")
    if gids:
        if not isinstance(gids, list) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gids):
            raise NvcError("cdi", f"{where}.additionalGids: expected a list of group ids")
        user = _table(_table(spec, "process"), "user")
        extra = _list(user, "additionalGids")
        extra += [g for g in gids if g not in extra]
    if edits.get("mounts"):
        spec["mounts"] = sorted(spec["mounts"], key=_depth)
