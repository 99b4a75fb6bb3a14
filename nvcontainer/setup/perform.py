"""Making (or, with ``--dry-run``, showing) the changes of a :class:`.model.Steps`: the only module
of ``setup`` that writes to the host.

Every write is atomic (a new file renamed over the old), and happens only if the file still
holds the text the decision was made from, so a change made meanwhile by someone else is never
overwritten blindly. A file that existed is first copied to ``PATH.bak-<stamp>``, and every
change is shown as a unified diff. A symbolic link where a file is to be written is refused,
not followed. Native programs are built before any file names them. What was done is recorded
(:mod:`.record`) as it is done, so ``--undo`` can take back exactly that, even after a failure
half-way, and each file is recorded before it is written, so even a process killed between
two writes leaves nothing the undo does not know of.
"""

from __future__ import annotations

import difflib
import os
import shutil
import stat
import subprocess

from ..errors import NvcError, escape
from ..inventory.catalog import DEFAULT_PATH
from . import record as records
from .model import Build, Link, RemoveFile, Steps, Unlink, WriteFile

MAX_FILE = 1 << 20
SYSTEMCTL_TIMEOUT = 60.0


def at(prefix: str, path: str) -> str:
    return os.path.join(prefix, path.lstrip("/"))


def current(path: str) -> str | None:
    """The file's text; None if absent. A symlink or non-regular file is refused, not followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE:
        raise NvcError("setup", f"{escape(path)}: not a regular file of at most {MAX_FILE} bytes; move it away first")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        data = f.read(MAX_FILE + 1)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise NvcError("setup", f"{escape(path)}: not UTF-8 text; fix or move it away first") from None


def diff(old: str | None, new: str | None, path: str) -> str:
    lines = difflib.unified_diff((old or "").splitlines(True), (new or "").splitlines(True),
                                 "/dev/null" if old is None else path, "/dev/null" if new is None else path)
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def _write(path: str, content: str, mode: int) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = f"{path}.nvcontainer-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.write(fd, content.encode())
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)


def _still(path: str, shown: str, expected: str | None) -> str | None:
    now = current(path)
    if now != expected:
        raise NvcError("setup", f"{escape(shown)} changed while setup ran; run it again")
    return now


def perform(s: Steps, *, prefix: str = "/", dry_run: bool = False, stamp: str = "") -> str:
    """Show (``dry_run``) or make ``s`` under ``prefix``; the report, one item per paragraph.
    ``stamp`` names backups (``PATH.bak-<stamp>``)."""
    out: list[str] = []
    done: list[dict] = []
    try:
        for b in s.builds:
            out.append(_build(b, prefix, dry_run))
        for change in s.changes:
            if isinstance(change, WriteFile):
                out.append(_write_file(change, prefix, dry_run, stamp, done, s.engine))
            elif isinstance(change, RemoveFile):
                out.append(_remove_file(change, prefix, dry_run))
            elif isinstance(change, Link):
                out.append(_link(change, prefix, dry_run, stamp, done))
            elif isinstance(change, Unlink):
                out.append(_unlink(change, prefix, dry_run))
        for unit in s.systemctl:
            out.append(_systemctl(unit.args, prefix, dry_run))
    except OSError as exc:
        raise NvcError("setup", f"{escape(exc.filename or '')}: {exc.strerror}") from None
    finally:
        if not dry_run and (done or s.undo):
            records.save(prefix, s.engine, done, undone=s.undo)
    for where, text in s.fragments:
        out.append(f"add to {where}:\n" + "".join(f"    {line}\n" for line in text.splitlines()))
    out += [f"note: {n}\n" for n in s.notes]
    if s.restart and (dry_run or any(not o.startswith("unchanged") for o in out)):
        out.append(f"restart: {s.restart}\n")
    return "\n".join(out)


def _write_file(f: WriteFile, prefix: str, dry_run: bool, stamp: str, done: list[dict], engine: str) -> str:
    path = at(prefix, f.path)
    old = _still(path, f.path, f.old)
    if old == f.content:
        return f"unchanged {f.path}\n"
    if dry_run:
        return f"would write {f.path}\n" + diff(old, f.content, f.path)
    note, backup = "", None
    if old is not None:
        backup = f"{f.path}.bak-{stamp}"
        _write(at(prefix, backup), old, stat.S_IMODE(os.lstat(path).st_mode))
        note = f" (previous contents in {backup})"
    # recorded before it is written: a process killed between the two (the installer's pod) leaves
    # a record --undo can follow, never a change no record knows of (undo of a write that did not
    # happen changes nothing: the file is not what the record says was written)
    entry = records.wrote(f, backup)
    records.save(prefix, engine, [entry])
    _write(path, f.content, f.mode)
    done.append(entry)
    return f"wrote {f.path}{note}\n" + diff(old, f.content, f.path)


def _remove_file(r: RemoveFile, prefix: str, dry_run: bool) -> str:
    path = at(prefix, r.path)
    old = _still(path, r.path, r.old)
    restored = None if r.restore is None else current(at(prefix, r.restore))
    verb = ("would restore" if dry_run else "restored") if restored is not None else \
        ("would remove" if dry_run else "removed")
    if not dry_run:
        if restored is not None:
            _write(path, restored, stat.S_IMODE(os.lstat(at(prefix, r.restore)).st_mode))
        else:
            os.unlink(path)
    where = f" from {r.restore}" if restored is not None else ""
    return f"{verb} {r.path}{where}\n" + diff(old, restored, r.path)


def _build(b: Build, prefix: str, dry_run: bool) -> str:
    from ..native import build as native

    what = "the native hook client" if b.kind == "client" else "the runtime shim's native front"
    if dry_run:
        return f"would build {b.path}: {what}\n"
    dest = at(prefix, b.path)
    linked = native.build(dest, b.python) if b.kind == "client" else native.build_runtime(dest, b.python)
    return f"built {b.path}: {what} ({linked}; falls back to {b.python})\n"


def _link(link: Link, prefix: str, dry_run: bool, stamp: str, done: list[dict]) -> str:
    path = at(prefix, link.path)
    try:
        was = os.readlink(path)
    except FileNotFoundError:
        was = None
    except OSError:   # a file or directory of the operator's: kept as a backup
        was = ""
    if was == link.target:
        return f"unchanged {link.path} -> {link.target}\n"
    verb = "would link" if dry_run else "linked"
    backup = f"{link.path}.bak-{stamp}" if was is not None else None
    moved = f" (replacing {'a file' if was == '' else 'a link to ' + was}, kept as {backup})" if backup else ""
    if not dry_run:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if backup:
            os.rename(path, at(prefix, backup))
        os.symlink(link.target, path)
        done.append(records.linked(link, backup))
    return f"{verb} {link.path} -> {link.target}{moved}\n"


def _unlink(u: Unlink, prefix: str, dry_run: bool) -> str:
    path = at(prefix, u.path)
    try:
        if os.readlink(path) != u.target:
            return f"left {u.path}: no longer a link to {u.target}\n"
    except OSError:
        return f"left {u.path}: no longer a link to {u.target}\n"
    restore = u.restore if u.restore and os.path.lexists(at(prefix, u.restore)) else None
    if not dry_run:
        os.unlink(path)
        if restore:
            os.rename(at(prefix, restore), path)
    verb = "would remove" if dry_run else "removed"
    return f"{verb} {u.path} -> {u.target}" + (f" (and put {restore} back)" if restore else "") + "\n"


def live_systemd(prefix: str) -> bool:
    """systemd is running this system (and set-up is for it, not for a tree under a prefix)."""
    return os.path.abspath(prefix) == "/" and os.path.isdir("/run/systemd/system")


def _systemctl(args: tuple[str, ...], prefix: str, dry_run: bool) -> str:
    line = "systemctl " + " ".join(args)
    program = shutil.which("systemctl", path=DEFAULT_PATH)
    if not live_systemd(prefix) or program is None:
        return f"note: no running systemd here: run '{line}' on the node\n"
    if dry_run:
        return f"would run {line}\n"
    try:
        res = subprocess.run([program, *args], capture_output=True, text=True, errors="replace", cwd="/",
                             env={"PATH": DEFAULT_PATH}, timeout=SYSTEMCTL_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NvcError("setup", f"{line}: {escape(exc)}") from None
    if res.returncode:
        raise NvcError("setup", f"{line}: {escape((res.stderr.strip().splitlines() or ['failed'])[-1], 200)}")
    return f"ran {line}\n"
