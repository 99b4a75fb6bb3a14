"""The record of what ``setup`` changed, per engine, so ``--undo`` (and the package's removal)
takes back exactly that and nothing of the operator's.

One JSON file per engine in ``/var/lib/nvcontainer/setup/`` (root-only): for each file written,
the hash of the text written, where the previous text was saved, and for an operator's file the
keys changed with their values before; for each link, its target and the backup of what was in
its place. A second run keeps the first run's "before" values, so undo goes back to the state
before the first ``setup``, not to the state before the last.
"""

from __future__ import annotations

import hashlib
import json
import os

from ..documents import json_value
from ..errors import NvcError, escape
from .model import Link, WriteFile

RECORD_DIR = "/var/lib/nvcontainer/setup"
MAX_RECORD = 1 << 20


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def wrote(f: WriteFile, backup: str | None) -> dict:
    entry = {"file": f.path, "own": f.own, "wrote": digest(f.content), "backup": backup, "created": f.old is None}
    if f.keys:
        entry["keys"] = [[list(k), ours, before] for k, ours, before in f.keys]
    if f.imports:
        entry["imports"] = f.imports
    return entry


def linked(link: Link, backup: str | None) -> dict:
    return {"link": link.path, "target": link.target, "backup": backup}


def _path(prefix: str, engine: str) -> str:
    return os.path.join(prefix, RECORD_DIR.lstrip("/"), f"{engine}.json")


def load(prefix: str, engine: str) -> list[dict]:
    path = _path(prefix, engine)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise NvcError("setup", f"{escape(path)}: {exc.strerror}") from None
    with open(fd, "rb") as f:
        data = f.read(MAX_RECORD + 1)
    try:
        entries = json_value(data, escape(path), cap=MAX_RECORD, category="setup")["entries"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError("entries")
    except (NvcError, ValueError, KeyError, TypeError):
        raise NvcError("setup", f"{escape(path)}: not a record of setup (corrupt): undo by hand") from None
    return entries


def engines(prefix: str) -> list[str]:
    """The engines with a record, sorted."""
    try:
        names = os.listdir(os.path.join(prefix, RECORD_DIR.lstrip("/")))
    except OSError:
        return []
    return sorted(n[:-5] for n in names if n.endswith(".json"))


def _merge(old: list[dict], new: list[dict]) -> list[dict]:
    merged = [dict(e) for e in old]
    for entry in new:
        key = ("file", entry["file"]) if "file" in entry else ("link", entry["link"])
        same = next((m for m in merged if (key[0], m.get(key[0])) == key), None)
        if same is None:
            merged.append(entry)
            continue
        # keep what the first run saw before it: its backup, its "created", each key's old value
        keys = {tuple(k): (ours, before) for k, ours, before in same.get("keys", [])}
        for k, ours, before in entry.get("keys", []):
            keys[tuple(k)] = (ours, keys[tuple(k)][1] if tuple(k) in keys else before)
        same.update({k: v for k, v in entry.items() if k not in ("backup", "created", "keys")})
        if keys:
            same["keys"] = [[list(k), ours, before] for k, (ours, before) in keys.items()]
    return merged


def save(prefix: str, engine: str, done: list[dict], *, undone: bool = False) -> None:
    """Add ``done`` to the engine's record; ``undone``: the engine was undone, forget it."""
    path = _path(prefix, engine)
    if undone:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    entries = _merge(load(prefix, engine), done)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        json.dump({"engine": engine, "entries": entries}, f, indent=1)
        f.write("\n")
    os.rename(tmp, path)
