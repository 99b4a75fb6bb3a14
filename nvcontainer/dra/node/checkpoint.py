"""What this node has prepared, on disk: one JSON file in the plugin's own directory, and the
claims' CDI specs, which can stand in for it.

Why a checkpoint at all: the kubelet calls NodePrepareResources again for every claim of a pod
after a restart (of itself or of the plugin), and NodeUnprepareResources with only the claim's
namespace, name and UID, when the claim may be gone from the API server. So the plugin must
know, without asking anyone, what it prepared and what to undo: the answer to a repeated
prepare (the same CDI names, at once) and exactly the files to remove.

Why it can be rebuilt: every prepared claim also has its spec in the CDI directory, with the
same record as a comment (:mod:`claimspec`). The checkpoint is read bounded (a hostile or
damaged file cannot make the plugin allocate without limit) and checked entry by entry; when
it is unreadable, too large, truncated or of another shape, it is refused with one line and
rebuilt from the specs, which are what the runtimes will read anyway. Writes are atomic (a
temporary file renamed), so a crash leaves the old or the new file, never half of one; they are
not synced (see :func:`save`).
"""

from __future__ import annotations

import json
import os

from ...cdi import store
from ...documents import json_value
from ...errors import NvcError, escape
from ...fs.bounded import Refused, read_regular
from . import claimspec

NAME = "checkpoint.json"
VERSION = 1
MAX_BYTES = 8 << 20
MAX_CLAIMS = 4096
ENTRY_KEYS = {"namespace", "name", "uid", "devices", "spec"}
DEVICE_KEYS = {"request", "pool", "device", "uuid", "cdi", "sharing", "shareID"}
OPTIONAL_DEVICE_KEYS = {"adminAccess"}      # only when true: older checkpoints read the same


def load(directory: str, cdi_root: str, warn) -> dict[str, dict]:
    """UID → entry. A bad file is reported (``warn``) and replaced by what the specs say."""
    path = os.path.join(directory, NAME)
    try:
        return _read(path)
    except FileNotFoundError:
        found = rebuild(cdi_root)
        if found:
            warn(f"no checkpoint in {escape(directory)}: {len(found)} prepared claims found in {escape(cdi_root)}")
        return found
    except NvcError as exc:
        found = rebuild(cdi_root)
        warn(f"checkpoint refused ({exc.detail}): rebuilt from {len(found)} claim specs in {escape(cdi_root)}")
        save(directory, found)
        return found


def save(directory: str, claims: dict[str, dict]) -> None:
    """Atomic, not synced: after a crash an older checkpoint is as good (a claim it misses is
    read again at its next prepare, and unprepare goes by the UID's spec file), and the specs,
    which are synced, can rebuild it."""
    text = json.dumps({"version": VERSION, "claims": claims}, sort_keys=True, separators=(",", ":"))
    store.write_atomic(os.path.join(directory, NAME), text + "\n", mode=0o600, sync=False)


def _read(path: str) -> dict[str, dict]:
    try:
        data = read_regular(path, MAX_BYTES, follow=False)[0]
    except FileNotFoundError:
        raise
    except Refused as exc:
        raise NvcError("input", f"{escape(path)}: {exc}") from None
    except OSError as exc:
        raise NvcError("input", f"{escape(path)}: {exc.strerror}") from None
    doc = json_value(data, escape(path), cap=MAX_BYTES)
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("claims"), dict):
        raise NvcError("input", f"{escape(path)}: not a version {VERSION} checkpoint")
    claims = doc["claims"]
    if len(claims) > MAX_CLAIMS:
        raise NvcError("input", f"{escape(path)}: more than {MAX_CLAIMS} claims")
    for uid, entry in claims.items():
        problem = check_entry(uid, entry)
        if problem:
            raise NvcError("input", f"{escape(path)}: claim {escape(uid, 60)}: {problem}")
    return claims


def check_entry(uid, entry) -> str | None:
    """Why ``entry`` is not a well-formed record of claim ``uid``, or None."""
    if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
        return "not a claim record"
    if entry["uid"] != uid or claimspec.uid_of(entry.get("spec") or "") != uid:
        return "its UID and spec file disagree"
    if not isinstance(entry["namespace"], str) or not isinstance(entry["name"], str):
        return "namespace and name must be text"
    devices = entry["devices"]
    if not isinstance(devices, list) or len(devices) > 256:
        return "devices: not a list"
    for device in devices:
        if not isinstance(device, dict) or set(device) - OPTIONAL_DEVICE_KEYS != DEVICE_KEYS \
                or device.get("adminAccess", True) is not True:
            return "a device record of another shape"
        if not isinstance(device["cdi"], list) or not all(isinstance(n, str) for n in device["cdi"]):
            return "a device's CDI names are not text"
        if not all(isinstance(device[k], str) for k in ("request", "pool", "device", "uuid", "shareID")):
            return "a device's names are not text"
        if not isinstance(device["sharing"], dict) or not all(isinstance(device["sharing"].get(k, ""), str)
                                                             for k in ("kind", "strategy", "interval", "group")):
            return "a device's sharing settings are of another shape"
    return None


def rebuild(cdi_root: str) -> dict[str, dict]:
    """The prepared claims, from the records in our claim specs under ``cdi_root``."""
    try:
        names = sorted(os.listdir(cdi_root))
    except OSError:
        return {}
    out: dict[str, dict] = {}
    for name in names:
        uid = claimspec.uid_of(name)
        if uid is None:
            continue
        try:
            spec = store.read_spec(os.path.join(cdi_root, name))
        except NvcError:
            continue
        entry = claimspec.record_of(spec.text)
        if entry is not None and check_entry(uid, entry) is None:
            out[uid] = entry
        if len(out) >= MAX_CLAIMS:
            break
    return out
