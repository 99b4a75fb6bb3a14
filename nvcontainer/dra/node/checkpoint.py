"""What this node has prepared, on disk: one JSON file in the plugin's own directory, and the
claims' CDI specs, which can stand in for it.

Why a checkpoint at all: the kubelet calls NodePrepareResources again for every claim of a pod
after a restart (of itself or of the plugin), and NodeUnprepareResources with only the claim's
namespace, name and UID, when the claim may be gone from the API server. So the plugin must
know, without asking anyone, what it prepared and what to undo: the answer to a repeated
prepare (the same CDI names, at once) and exactly the files to remove.

Why it can be rebuilt: every prepared claim also has its spec in the CDI directory, with the
same record as a comment (:mod:`claimspec`). The checkpoint is read bounded (a hostile or
damaged file cannot make the plugin allocate without limit) and checked entry by entry (each
read into a :class:`~.prepared.PreparedClaim`, whose JSON is the entry's); when
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
from .prepared import PreparedClaim

NAME = "checkpoint.json"
VERSION = 1
MAX_BYTES = 8 << 20
MAX_CLAIMS = 4096


def load(directory: str, cdi_root: str, warn) -> dict[str, PreparedClaim]:
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


def save(directory: str, claims: dict[str, PreparedClaim]) -> None:
    """Atomic, not synced: after a crash an older checkpoint is as good (a claim it misses is
    read again at its next prepare, and unprepare goes by the UID's spec file), and the specs,
    which are synced, can rebuild it."""
    doc = {"version": VERSION, "claims": {uid: entry.to_json() for uid, entry in claims.items()}}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    store.write_atomic(os.path.join(directory, NAME), text + "\n", mode=0o600, sync=False)


def _read(path: str) -> dict[str, PreparedClaim]:
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
    if len(doc["claims"]) > MAX_CLAIMS:
        raise NvcError("input", f"{escape(path)}: more than {MAX_CLAIMS} claims")
    claims: dict[str, PreparedClaim] = {}
    for uid, entry in doc["claims"].items():
        try:
            claims[uid] = PreparedClaim.from_json(uid, entry)
        except NvcError as exc:
            raise NvcError("input", f"{escape(path)}: claim {escape(uid, 60)}: {exc.detail}") from None
    return claims


def rebuild(cdi_root: str) -> dict[str, PreparedClaim]:
    """The prepared claims, from the records in our claim specs under ``cdi_root``."""
    try:
        names = sorted(os.listdir(cdi_root))
    except OSError:
        return {}
    out: dict[str, PreparedClaim] = {}
    for name in names:
        uid = claimspec.uid_of(name)
        if uid is None:
            continue
        try:
            spec = store.read_spec(os.path.join(cdi_root, name))
        except NvcError:
            continue
        data = claimspec.record_of(spec.text)
        if data is None:
            continue
        try:
            out[uid] = PreparedClaim.from_json(uid, data)
        except NvcError:
            continue
        if len(out) >= MAX_CLAIMS:
            break
    return out
