"""CDI spec files on disk: writing one atomically, reading the spec directories as engines do.

Engines re-read spec directories while containers start (podman on every run, containerd and
CRI-O when the directory changes), so a half-written spec would be read as broken and its
devices would vanish for that start: a spec is written to a hidden temporary name in the same
directory (an extension engines ignore), synced, and renamed over the old one.

Directories are read in priority order, lowest first (``/etc/cdi``, then ``/var/run/cdi``): a
device name defined in a higher-priority directory shadows the same name in a lower one, and
the same name defined twice at the same priority is a conflict that makes it unresolvable.
"""

from __future__ import annotations

import os
import secrets
import stat

from ..documents import json_value
from ..errors import NvcError, escape
from ..records import record
from . import yamltext
from .spec import validate

DEFAULT_DIRS = ("/etc/cdi", "/var/run/cdi")
EXTENSIONS = (".json", ".yaml", ".yml")
MAX_SPEC = 16 << 20
MAX_FILES = 1024


@record
class SpecFile:
    path: str
    priority: int
    spec: dict         # the validated wire form
    text: str          # as read: the YAML header comment carries the driver version


@record
class Name:
    name: str                      # vendor/class=device
    path: str                      # the spec file that provides it
    conflicts: tuple[str, ...] = ()  # other files defining it at the same priority


def format_for(path: str | None, fmt: str | None) -> str:
    """``--format`` if given, else from the output file's extension, else YAML."""
    if fmt:
        return fmt
    if path and path.endswith(".json"):
        return "json"
    return "yaml"


def write_atomic(path: str, text: str, mode: int = 0o644, sync: bool = True) -> None:
    """``text`` at ``path``, whole or not at all; ``sync``: on disk before the rename (and the
    directory after), for files nothing else can stand in for after a crash."""
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    try:
        os.makedirs(directory, 0o755, exist_ok=True)
    except OSError as exc:
        raise NvcError("cdi", f"cannot create {escape(directory)}: {exc.strerror.lower()}") from None
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        raise NvcError("cdi", f"cannot write in {escape(directory)}: {exc.strerror.lower()}") from None
    try:
        try:
            view = memoryview(text.encode())
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)   # the umask narrowed it; engines run as other users (rootless)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise NvcError("cdi", f"cannot write {escape(path)}: {exc.strerror.lower()}") from None
    if sync:
        _sync_dir(directory)


def _sync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def parse_text(text: str, path: str) -> dict:
    """A spec from its text: JSON for ``.json`` files or text that starts with ``{``, else YAML."""
    if path.endswith(".json") or text.lstrip().startswith("{"):
        data = json_value(text, escape(path), cap=MAX_SPEC, category="cdi")
    else:
        data = yamltext.load(text, escape(path))
    return validate(data, escape(path))


def read_spec(path: str, priority: int = 0) -> SpecFile:
    """One spec file: a regular file (a symlink to one is fine), at most ``MAX_SPEC`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise NvcError("cdi", f"cannot open {escape(path)}: {exc.strerror.lower()}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NvcError("cdi", f"{escape(path)}: not a regular file")
        data = b""
        while len(data) <= MAX_SPEC and (chunk := os.read(fd, 1 << 20)):
            data += chunk
    except OSError as exc:
        raise NvcError("cdi", f"cannot read {escape(path)}: {exc.strerror.lower()}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SPEC:
        raise NvcError("cdi", f"{escape(path)}: larger than {MAX_SPEC} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise NvcError("cdi", f"{escape(path)}: not UTF-8 text") from None
    return SpecFile(path, priority, parse_text(text, path), text)


def scan(dirs) -> tuple[list[SpecFile], list[str]]:
    """Every spec in ``dirs`` (lowest priority first), and one line per file that could not be
    used. A missing directory is normal (no spec generated yet)."""
    specs: list[SpecFile] = []
    problems: list[str] = []
    for priority, directory in enumerate(dirs):
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"cannot list {escape(directory)}: {exc.strerror.lower()}")
            continue
        candidates = [n for n in names if n.endswith(EXTENSIONS) and not n.startswith(".")]
        if len(candidates) > MAX_FILES:
            problems.append(f"{escape(directory)}: more than {MAX_FILES} spec files, the rest ignored")
            candidates = candidates[:MAX_FILES]
        for name in candidates:
            try:
                specs.append(read_spec(os.path.join(directory, name), priority))
            except NvcError as exc:
                problems.append(exc.detail)
    return specs, problems


def resolve_names(specs: list[SpecFile]) -> list[Name]:
    """Fully-qualified device names and the file each resolves to, sorted by name."""
    found: dict[str, list[SpecFile]] = {}
    for spec_file in specs:
        for device in spec_file.spec["devices"]:
            found.setdefault(f"{spec_file.spec['kind']}={device['name']}", []).append(spec_file)
    out = []
    for name in sorted(found):
        top = max(s.priority for s in found[name])
        winners = [s.path for s in found[name] if s.priority == top]
        out.append(Name(name, winners[0], tuple(winners[1:])))
    return out
