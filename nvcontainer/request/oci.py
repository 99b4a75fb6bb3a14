"""The OCI runtime's input to a hook: the container state on stdin and the bundle's config.json.

Both come through the container engine, but the image chose the environment, mounts and
annotations inside them, so they are parsed as hostile: bounded reads, strict JSON (no NaN or
Infinity, no trailing data, no recursion blow-up), and a type check on every field that is used.
A value of the wrong type is refused with a message naming the field, instead of being coerced
(``True`` is not a pid, ``"123"`` is not a pid).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field

from ..errors import NvcError, escape
from ..fs.bounded import read_at_most

STATE_CAP = 1 << 20          # crun puts every annotation in the state; 1 MiB is plenty
SPEC_CAP = 16 << 20
PID_MAX_LIMIT = 1 << 22      # the kernel's ceiling for pid_max; every pid is below it

# No path or environment entry can hold a NUL, and a lone surrogate (legal in JSON's \u escapes)
# has no UTF-8 encoding: both would fail later, far from the input that caused them.
_UNUSABLE = re.compile("[\x00\ud800-\udfff]")


@dataclass(frozen=True)
class State:
    pid: int
    bundle: str
    root: str | None            # crun's extra field, made absolute against the bundle
    annotations: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Mount:
    source: str
    destination: str
    type: str
    options: tuple[str, ...]


@dataclass(frozen=True)
class Spec:
    """What the hook needs from config.json.

    ``env`` keeps the image order with one entry per name; a name given twice keeps its last
    value, as runc's ``runc init`` leaves it in the process environment.
    """

    env: tuple[tuple[str, str], ...]
    rootfs: str
    privileged: bool
    mounts: tuple[Mount, ...] = ()
    annotations: dict = field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        return dict(self.env)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _loads(data: bytes, what: str, cap: int):
    if not isinstance(data, (bytes, bytearray)):
        raise NvcError("input", f"{what}: expected bytes")
    if len(data) > cap:
        raise NvcError("input", f"{what}: larger than {cap} bytes")
    try:
        text = bytes(data).decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise NvcError("input", f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeError) as exc:   # JSONDecodeError is a ValueError
        raise NvcError("input", f"{what}: invalid JSON: {escape(exc)}") from None


def _show(value: object) -> str:
    """A JSON rendering of a bad value for a message: ``true``, ``"123"``, ``1.5``."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return escape(json.dumps(value), 60)


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise NvcError("input", f"{where}: expected an object, got {_show(value)}")
    return value


def _string(value: object, where: str, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise NvcError("input", f"{where}: expected a string, got {_show(value)}")
    if nonempty and not value:
        raise NvcError("input", f"{where}: must not be empty")
    if _UNUSABLE.search(value):
        raise NvcError("input", f"{where}: contains a NUL or an unpaired surrogate: {escape(value)}")
    return value


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise NvcError("input", f"{where}: expected a list, got {_show(value)}")
    return tuple(_string(item, f"{where}[{i}]") for i, item in enumerate(value))


def _annotations(value: object, where: str) -> dict:
    if value is None:
        return {}
    obj = _object(value, where)
    return {_string(k, f"{where} key"): _string(v, f"{where}[{escape(k, 60)}]") for k, v in obj.items()}


def _absolute(base: str, path: str) -> str:
    """``path`` made absolute against ``base`` and lexically cleaned, as Go's filepath.Abs does."""
    joined = os.path.normpath(os.path.join(base, path))
    if joined.startswith("//"):   # POSIX normpath keeps a leading double slash; Go does not
        joined = "/" + joined.lstrip("/")
    return joined


def parse_state(data: bytes) -> State:
    obj = _object(_loads(data, "state", STATE_CAP), "state")
    if "pid" not in obj:
        raise NvcError("input", "state: pid: missing")
    pid = obj["pid"]
    if isinstance(pid, bool) or not isinstance(pid, int) or not 1 < pid < PID_MAX_LIMIT:
        raise NvcError("input", f"state: pid: expected an integer > 1, got {_show(pid)}")
    if "bundle" in obj:
        bundle = _string(obj["bundle"], "state: bundle", nonempty=True)
    elif "bundlePath" in obj:   # OCI runtime spec before 1.0
        bundle = _string(obj["bundlePath"], "state: bundlePath", nonempty=True)
    else:
        raise NvcError("input", "state: bundle: missing")
    if not bundle.startswith("/"):
        raise NvcError("input", f"state: bundle: not an absolute path: {escape(bundle)}")
    bundle = _absolute("/", bundle)
    root = None
    if obj.get("root") is not None:
        root = _absolute(bundle, _string(obj["root"], "state: root", nonempty=True))
    return State(pid, bundle, root, _annotations(obj.get("annotations"), "state: annotations"))


def read_state(fd: int, cap: int = STATE_CAP) -> State:
    """Read the state from ``fd`` (the hook's stdin) to EOF.

    crun writes the whole state before it waits for the hook, so stopping early could leave it
    blocked on a full pipe; reading stops only at EOF or when the cap is passed.
    """
    try:
        data, more = read_at_most(fd, cap)
    except OSError as exc:
        raise NvcError("input", f"state: cannot read standard input: {exc.strerror}") from None
    if more:
        raise NvcError("input", f"state: larger than {cap} bytes")
    return parse_state(data)


def _privileged(process: dict) -> bool:
    caps = process.get("capabilities")
    if caps is None:
        return False
    if isinstance(caps, list):   # OCI 1.0.0-rc1 to rc4: one flat list
        return "CAP_SYS_ADMIN" in _strings(caps, "config.json: process.capabilities")
    caps = _object(caps, "config.json: process.capabilities")
    bounding = caps.get("bounding")
    if bounding is None:
        return False
    return "CAP_SYS_ADMIN" in _strings(bounding, "config.json: process.capabilities.bounding")


def _env(process: dict) -> tuple[tuple[str, str], ...]:
    entries = process.get("env")
    if entries is None:
        return ()
    env: dict[str, str] = {}
    for i, entry in enumerate(_strings(entries, "config.json: process.env")):
        name, sep, value = entry.partition("=")
        if not sep:
            raise NvcError("input", f"config.json: process.env[{i}]: expected NAME=VALUE, got {escape(entry)}")
        env[name] = value
    return tuple(env.items())


def _mounts(value: object) -> tuple[Mount, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise NvcError("input", f"config.json: mounts: expected a list, got {_show(value)}")
    mounts = []
    for i, item in enumerate(value):
        where = f"config.json: mounts[{i}]"
        m = _object(item, where)
        options = m.get("options")
        mounts.append(Mount(
            source=_string(m.get("source", ""), f"{where}.source"),
            destination=_string(m.get("destination"), f"{where}.destination", nonempty=True),
            type=_string(m.get("type", ""), f"{where}.type"),
            options=() if options is None else _strings(options, f"{where}.options"),
        ))
    return tuple(mounts)


def parse_spec(data: bytes, bundle: str) -> Spec:
    obj = _object(_loads(data, "config.json", SPEC_CAP), "config.json")
    _string(obj.get("ociVersion"), "config.json: ociVersion", nonempty=True)
    process = obj.get("process")
    process = {} if process is None else _object(process, "config.json: process")
    root = _object(obj.get("root"), "config.json: root")
    path = _string(root.get("path"), "config.json: root.path", nonempty=True)
    return Spec(
        env=_env(process),
        rootfs=_absolute(bundle, path),   # hooks run with the bundle as working directory
        privileged=_privileged(process),
        mounts=_mounts(obj.get("mounts")),
        annotations=_annotations(obj.get("annotations"), "config.json: annotations"),
    )


def spec_object(data: bytes) -> dict:
    """The whole of a config.json, as strictly as :func:`parse_spec` reads it (the runtime shim
    edits it and writes it back)."""
    return _object(_loads(data, "config.json", SPEC_CAP), "config.json")


def read_spec_file(path: str, cap: int = SPEC_CAP) -> tuple[bytes, os.stat_result]:
    """A config.json's bytes and ``fstat``, without following a final symlink or blocking on a FIFO."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except (OSError, ValueError) as exc:   # ValueError: a NUL in the path
        raise NvcError("input", f"cannot open {escape(path)}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NvcError("input", f"{escape(path)}: not a regular file")
        if st.st_size > cap:
            raise NvcError("input", f"{escape(path)}: larger than {cap} bytes")
        data, more = read_at_most(fd, cap)
        if more:
            raise NvcError("input", f"{escape(path)}: larger than {cap} bytes")
    except OSError as exc:
        raise NvcError("input", f"cannot read {escape(path)}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return data, st


def read_spec(bundle: str, cap: int = SPEC_CAP) -> Spec:
    """Load ``<bundle>/config.json`` without following a final symlink or blocking on a FIFO."""
    data, _ = read_spec_file(os.path.join(bundle, "config.json"), cap)
    return parse_spec(data, bundle)
