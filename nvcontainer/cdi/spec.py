"""A CDI spec as plain data, and the rules that decide which ``cdiVersion`` it may declare.

Engines refuse a spec whose declared version is older than what its content needs, and also one
newer than they know: podman 4.3 reads up to 0.5.0. So a spec declares the *lowest* version its
content needs (:func:`min_version`), computed on the wire form (the JSON-able dict), which is
also what is read back from disk. The dataclasses below are what the generator builds; their
``to_dict`` leaves out empty fields, since a present-but-empty field can raise the version
(``annotations: {}`` counts as annotations for some readers).
"""

from __future__ import annotations

import re

from ..errors import NvcError, escape
from ..records import record

KNOWN_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
BASE_VERSION = "0.3.0"          # the oldest version engines still read
HOOK_STAGES = ("prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop")

# CDI's name grammar: vendor a DNS-like name, class alphanumerics with - and _ (and dots since
# 0.6.0), device names alphanumerics with - _ . : (a leading digit since 0.5.0).
_VENDOR = re.compile(r"[A-Za-z](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
_CLASS = re.compile(r"[A-Za-z](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
_DEVICE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]{0,126}[A-Za-z0-9])?")


@record
class DeviceNode:
    path: str                       # in the container
    host_path: str = ""             # on the host, when it differs from path
    type: str = ""
    major: int | None = None
    minor: int | None = None

    def to_dict(self) -> dict:
        out: dict = {"path": self.path}
        if self.host_path and self.host_path != self.path:
            out["hostPath"] = self.host_path
        if self.type:
            out["type"] = self.type
        if self.major is not None:
            out["major"] = self.major
            out["minor"] = self.minor
        return out


@record
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out: dict = {"hostPath": self.host_path, "containerPath": self.container_path}
        if self.options:
            out["options"] = list(self.options)
        return out


@record
class Hook:
    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None   # seconds; the runtime kills the hook after it (none: it waits forever)

    def to_dict(self) -> dict:
        out: dict = {"hookName": self.hook_name, "path": self.path}
        if self.args:
            out["args"] = list(self.args)
        if self.env:
            out["env"] = list(self.env)
        if self.timeout is not None:
            out["timeout"] = self.timeout
        return out


@record
class Edits:
    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()

    def to_dict(self) -> dict:
        out: dict = {}
        if self.env:
            out["env"] = list(self.env)
        if self.device_nodes:
            out["deviceNodes"] = [d.to_dict() for d in self.device_nodes]
        if self.mounts:
            out["mounts"] = [m.to_dict() for m in self.mounts]
        if self.hooks:
            out["hooks"] = [h.to_dict() for h in self.hooks]
        return out


@record
class Device:
    name: str
    edits: Edits

    def to_dict(self) -> dict:
        return {"name": self.name, "containerEdits": self.edits.to_dict()}


@record
class Spec:
    kind: str                                       # vendor/class
    devices: tuple[Device, ...]
    edits: Edits = Edits()
    annotations: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict:
        """The wire form, ``cdiVersion`` first and set to what the content needs."""
        body: dict = {"kind": self.kind}
        if self.annotations:
            body["annotations"] = dict(self.annotations)
        body["devices"] = [d.to_dict() for d in self.devices]
        body["containerEdits"] = self.edits.to_dict()
        return {"cdiVersion": min_version(body), **body}


def check_kind(vendor: str, cls: str) -> str:
    if not _VENDOR.fullmatch(vendor):
        raise NvcError("input", f"invalid CDI vendor {escape(vendor, 80)}: letters, digits, '-', '_' and '.', "
                                "starting with a letter")
    if not _CLASS.fullmatch(cls):
        raise NvcError("input", f"invalid CDI class {escape(cls, 80)}: letters, digits, '-', '_' and '.', "
                                "starting with a letter")
    return f"{vendor}/{cls}"


def valid_device_name(name: str) -> bool:
    return _DEVICE.fullmatch(name) is not None


def split_kind(kind: object) -> tuple[str, str] | None:
    """``vendor/class`` → (vendor, class), or None if ``kind`` is not one."""
    if not isinstance(kind, str):
        return None
    vendor, sep, cls = kind.partition("/")
    if not sep or not _VENDOR.fullmatch(vendor) or not _CLASS.fullmatch(cls):
        return None
    return vendor, cls


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def version_at_least(declared: str, needed: str) -> bool:
    return _key(declared) >= _key(needed)


def _all_edits(spec: dict) -> list[dict]:
    edits = [spec.get("containerEdits")]
    edits += [d.get("containerEdits") for d in _list(spec.get("devices")) if isinstance(d, dict)]
    return [e for e in edits if isinstance(e, dict)]


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def min_version(spec: dict) -> str:
    """The lowest ``cdiVersion`` that allows everything in the wire-form ``spec`` (the rules of
    the CDI reference library, REFERENCE §7.3)."""
    edits = _all_edits(spec)
    devices = [d for d in _list(spec.get("devices")) if isinstance(d, dict)]
    rdt = [e["intelRdt"] for e in edits if isinstance(e.get("intelRdt"), dict)]
    if any(e.get("netDevices") for e in edits) or any("schemata" in r or r.get("enableMonitoring") for r in rdt):
        return "1.1.0"
    if any(e.get("intelRdt") is not None or e.get("additionalGids") for e in edits):
        return "0.7.0"
    kind = spec.get("kind")
    cls = kind.partition("/")[2] if isinstance(kind, str) else ""
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in cls:
        return "0.6.0"
    names = [d.get("name") for d in devices]
    if any(isinstance(n, str) and n and not n[0].isalpha() for n in names):
        return "0.5.0"
    nodes = [n for e in edits for n in _list(e.get("deviceNodes")) if isinstance(n, dict)]
    if any(n.get("hostPath") for n in nodes):
        return "0.5.0"
    mounts = [m for e in edits for m in _list(e.get("mounts")) if isinstance(m, dict)]
    if any(m.get("type") for m in mounts):
        return "0.4.0"
    return BASE_VERSION


def validate(spec: object, where: str) -> dict:
    """Check the parts of a spec read from disk that ``list`` and ``check`` rely on.

    Unknown fields are allowed (a newer spec version may add some); a known field of the wrong
    type, an unknown version, or a declared version below what the content needs is an error,
    as it is for the engines, which then ignore the whole file.
    """
    if not isinstance(spec, dict):
        raise NvcError("cdi", f"{where}: not a CDI spec (expected a mapping at the top)")
    version = spec.get("cdiVersion")
    if version not in KNOWN_VERSIONS:
        raise NvcError("cdi", f"{where}: unknown cdiVersion {escape(version, 40)}")
    if split_kind(spec.get("kind")) is None:
        raise NvcError("cdi", f"{where}: invalid kind {escape(spec.get('kind'), 80)} (expected vendor/class)")
    devices = spec.get("devices")
    if not isinstance(devices, list):
        raise NvcError("cdi", f"{where}: devices: expected a list")
    seen: set[str] = set()
    for i, device in enumerate(devices):
        if not isinstance(device, dict) or not isinstance(device.get("name"), str):
            raise NvcError("cdi", f"{where}: devices[{i}]: expected a mapping with a name")
        if not valid_device_name(device["name"]):
            raise NvcError("cdi", f"{where}: devices[{i}]: invalid name {escape(device['name'], 80)}")
        if device["name"] in seen:
            raise NvcError("cdi", f"{where}: devices[{i}]: device {escape(device['name'], 80)} defined twice")
        seen.add(device["name"])
        _edits(device.get("containerEdits"), f"{where}: devices[{i}].containerEdits")
    _edits(spec.get("containerEdits"), f"{where}: containerEdits")
    needed = min_version(spec)
    if not version_at_least(version, needed):
        raise NvcError("cdi", f"{where}: declares cdiVersion {version} but its content needs {needed}")
    return spec


def _edits(edits: object, where: str) -> None:
    if edits is None:
        return
    if not isinstance(edits, dict):
        raise NvcError("cdi", f"{where}: expected a mapping")
    for key, fields in (("deviceNodes", {"path": str, "hostPath": str, "major": int, "minor": int, "type": str}),
                        ("mounts", {"hostPath": str, "containerPath": str}),
                        ("hooks", {"hookName": str, "path": str, "timeout": int})):
        items = edits.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            raise NvcError("cdi", f"{where}.{key}: expected a list")
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise NvcError("cdi", f"{where}.{key}[{i}]: expected a mapping")
            for name, kind in fields.items():
                value = item.get(name)
                if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                    raise NvcError("cdi", f"{where}.{key}[{i}].{name}: expected {kind.__name__}")
    for i, hook in enumerate(edits.get("hooks") or []):
        if hook.get("hookName") not in HOOK_STAGES:
            raise NvcError("cdi", f"{where}.hooks[{i}].hookName: {escape(hook.get('hookName'), 40)} is not an OCI hook "
                                  f"stage ({', '.join(HOOK_STAGES)})")
    env = edits.get("env")
    if env is not None and (not isinstance(env, list) or not all(isinstance(e, str) for e in env)):
        raise NvcError("cdi", f"{where}.env: expected a list of strings")
