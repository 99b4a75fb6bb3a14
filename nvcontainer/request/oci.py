"""The OCI runtime's input to a hook: the container state on stdin and the bundle's config.json.

Both come through the container engine, but the image chose the environment, mounts and
annotations inside them, so they are parsed as hostile: bounded reads, strict JSON (no NaN or
Infinity, no trailing data, no recursion blow-up), and a type check on every field that is used.
A value of the wrong type is refused with a message naming the field, instead of being coerced
(``True`` is not a pid, ``"123"`` is not a pid).

Two readers must agree with the runtime that executes the spec. runc decodes config.json with
Go's ``encoding/json``, which matches a key to a field case-insensitively (``Env`` is ``env``;
``ſ`` and the Kelvin sign fold to ``s`` and ``k``) and keeps the last of duplicate keys; crun's
parser matches exact names and keeps the first. A spec holding ``env`` and ``Env`` (or ``env``
twice) would make the hook decide on other variables than the container gets, so a key that the
two runtimes would read differently is refused, with one line naming it (:func:`_get`).

The state arrives on stdin from the runtime, which writes all of it before it waits for the
hook, but may never close the pipe: reading stops at the first complete JSON document (plus
whitespace), at end of file, at :data:`STATE_CAP` bytes or after :data:`STATE_SECONDS`,
whichever comes first (:func:`read_state`).
"""

from __future__ import annotations

import os
import select
import stat
import time

from .. import jsontext
from ..documents import json_value
from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from ..records import field, record

STATE_CAP = 1 << 20          # crun puts every annotation in the state; 1 MiB is plenty
SPEC_CAP = 16 << 20
PID_MAX_LIMIT = 1 << 22      # the kernel's ceiling for pid_max; every pid is below it
STATE_SECONDS = 5.0          # for the state to arrive; runtimes write it at once


def _unusable(value: str) -> bool:
    """Whether ``value`` holds a NUL or a lone surrogate (legal in JSON's \\u escapes, and the only
    code points without a UTF-8 encoding). No path or environment entry can hold either: both
    would fail later, far from the input that caused them. Checked on every string of a spec,
    without ``re`` (its import costs a start several milliseconds)."""
    if "\0" in value:
        return True
    if value.isascii():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@record
class State:
    pid: int
    bundle: str
    root: str | None            # crun's extra field, made absolute against the bundle
    annotations: dict = field(default_factory=dict)
    id: str = ""                # the container id: whose lease a free:N request takes


@record
class Mount:
    source: str
    destination: str
    type: str
    options: tuple[str, ...]


@record
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


class _JsonObject(dict):
    """A JSON object that also remembers its keys as written, duplicates included, in order:
    the dict keeps the last duplicate, as Go does; :func:`_get` looks at ``written``."""

    __slots__ = ("written",)

    @classmethod
    def of(cls, pairs: list) -> "_JsonObject":
        obj = cls(pairs)
        obj.written = [key for key, _ in pairs]
        return obj


# Go's encoding/json folds ASCII letters and the two non-ASCII runes whose simple case folding
# reaches an ASCII letter: U+017F (long s) and U+212A (Kelvin sign).
_GO_FOLD = {**{c: c + 32 for c in range(65, 91)}, 0x017F: ord("s"), 0x212A: ord("k")}


def _fold(key: str) -> str:
    return key.translate(_GO_FOLD)


def _quoted(key: str) -> str:
    """A key as JSON writes it, non-ASCII kept, for an error's message (``json`` is imported only
    on the way to one)."""
    import json

    return json.dumps(key, ensure_ascii=False)


def _get(obj: dict, name: str, where: str):
    """``obj[name]`` as both runtimes read it, or None when absent; refuses a key that runc
    (case-insensitive, last duplicate wins) and crun (exact, first duplicate wins) would read
    differently: a duplicate, or a spelling other than ``name`` that Go folds onto it."""
    written = getattr(obj, "written", None)
    if written is None:
        return obj.get(name)
    folded = _fold(name)
    matches = [key for key in written if key == name or _fold(key) == folded]
    if not matches:
        return None
    if len(matches) > 1:
        keys = " and ".join(escape(_quoted(key), 80) for key in matches[:3])
        raise NvcError("input", f"{where}: ambiguous keys {keys}: runc reads them as one field {name!r} "
                                "(the last), crun only an exact, first one; refusing the spec")
    if matches[0] != name:
        raise NvcError("input", f"{where}: key {escape(_quoted(matches[0]), 80)} is not {name!r}: runc reads it "
                                "as that field, crun ignores it; refusing the spec")
    return obj[name]


def _unique(obj: dict, where: str) -> None:
    """A map (annotations): keys are matched exactly by both runtimes, so only a duplicate,
    which runc resolves to the last and crun to the first, is ambiguous."""
    written = getattr(obj, "written", None)
    if written is not None and len(written) != len(obj):
        seen: set[str] = set()
        for key in written:
            if key in seen:
                raise NvcError("input", f"{where}: duplicate key {escape(_quoted(key), 80)}: runc keeps the last "
                                        "value, crun the first; refusing the spec")
            seen.add(key)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _loads(data: bytes, what: str, cap: int):
    if not isinstance(data, (bytes, bytearray)):
        raise NvcError("input", f"{what}: expected bytes")
    return json_value(data, what, cap=cap, depth=None, parse_constant=_reject_constant,
                      object_pairs_hook=_JsonObject.of)


def _show(value: object) -> str:
    """A JSON rendering of a bad value for a message: ``true``, ``"123"``, ``1.5``."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return escape(jsontext.dumps(value), 60)


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise NvcError("input", f"{where}: expected an object, got {_show(value)}")
    return value


def _string(value: object, where: str, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise NvcError("input", f"{where}: expected a string, got {_show(value)}")
    if nonempty and not value:
        raise NvcError("input", f"{where}: must not be empty")
    if _unusable(value):
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
    _unique(obj, where)
    return {_string(k, f"{where} key"): _string(v, f"{where}[{escape(k, 60)}]") for k, v in obj.items()}


def _absolute(base: str, path: str) -> str:
    """``path`` made absolute against ``base`` and lexically cleaned, as Go's filepath.Abs does."""
    joined = os.path.normpath(os.path.join(base, path))
    if joined.startswith("//"):   # POSIX normpath keeps a leading double slash; Go does not
        joined = "/" + joined.lstrip("/")
    return joined


def parse_state(data: bytes) -> State:
    obj = _object(_loads(data, "state", STATE_CAP), "state")
    pid = _get(obj, "pid", "state")
    if pid is None and "pid" not in obj:
        raise NvcError("input", "state: pid: missing")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 1 < pid < PID_MAX_LIMIT:
        raise NvcError("input", f"state: pid: expected an integer > 1, got {_show(pid)}")
    bundle = _get(obj, "bundle", "state")
    if bundle is not None:
        bundle = _string(bundle, "state: bundle", nonempty=True)
    elif (old := _get(obj, "bundlePath", "state")) is not None:   # OCI runtime spec before 1.0
        bundle = _string(old, "state: bundlePath", nonempty=True)
    else:
        if "bundle" in obj:
            _string(None, "state: bundle")
        raise NvcError("input", "state: bundle: missing")
    if not bundle.startswith("/"):
        raise NvcError("input", f"state: bundle: not an absolute path: {escape(bundle)}")
    bundle = _absolute("/", bundle)
    root = None
    if (value := _get(obj, "root", "state")) is not None:
        root = _absolute(bundle, _string(value, "state: root", nonempty=True))
    ident = _get(obj, "id", "state")
    ident = _string(ident, "state: id")[:256] if ident is not None else ""
    return State(pid, bundle, root, _annotations(_get(obj, "annotations", "state"), "state: annotations"), ident)


def read_state(fd: int, cap: int = STATE_CAP, seconds: float = STATE_SECONDS) -> State:
    """Read the state from ``fd`` (the hook's stdin) and parse it.

    crun writes the whole state before it waits for the hook, so reading must not stop while it
    still writes (a writer blocked on a full pipe would wait for ever); but a runtime need not
    close the pipe, so reading stops as soon as one complete JSON document and nothing but
    whitespace has arrived. A writer that never finishes is cut at ``cap`` bytes or after
    ``seconds``; one still writing when we stop gets EPIPE when the hook exits, never a hang.
    """
    return parse_state(read_document(fd, cap, seconds, "state"))


def read_state_from_stdin() -> State:
    """:func:`read_state` on the hook's standard input, which a runtime may have left closed."""
    import sys

    try:
        fd = sys.stdin.fileno()
    except (AttributeError, ValueError, OSError):   # None (fd 0 closed at start-up), or closed since
        raise NvcError("input", "state: standard input is closed") from None
    return read_state(fd)


def read_document(fd: int, cap: int, seconds: float, what: str) -> bytes:
    """Bytes from ``fd`` up to EOF or up to the end of the first complete JSON object followed
    only by whitespace, whichever comes first; ``NvcError`` past ``cap`` bytes or ``seconds``."""
    end = time.monotonic() + seconds
    data = bytearray()
    poller = select.poll()
    try:
        poller.register(fd, select.POLLIN)
        while True:
            left = end - time.monotonic()
            if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                if time.monotonic() >= end:
                    raise NvcError("input", f"{what}: no complete JSON document on standard input within "
                                            f"{seconds:g}s ({len(data)} bytes, not closed)")
                continue
            chunk = os.read(fd, min(1 << 16, cap + 1 - len(data)))
            if not chunk:
                return bytes(data)
            data += chunk
            if len(data) > cap:
                raise NvcError("input", f"{what}: larger than {cap} bytes")
            if _complete(data):
                return bytes(data)
    except OSError as exc:
        raise NvcError("input", f"{what}: cannot read standard input: {exc.strerror}") from None


_WHITESPACE = b" \t\r\n"


def _complete(data: bytearray) -> bool:
    """Whether ``data`` is one whole JSON object plus whitespace. Tried only when the last
    non-blank byte closes an object, so a large state costs a few parses, not one per chunk."""
    if not data.rstrip(_WHITESPACE).endswith(b"}"):
        return False
    try:
        text = data.decode("utf-8")
        _, stop = jsontext.raw_decode(text, len(text) - len(text.lstrip()))
    except (ValueError, RecursionError):   # incomplete, or bad: the parser says which, at EOF
        return False
    return not text[stop:].strip(" \t\r\n")


def _privileged(process: dict) -> bool:
    caps = _get(process, "capabilities", "config.json: process")
    if caps is None:
        return False
    if isinstance(caps, list):   # OCI 1.0.0-rc1 to rc4: one flat list
        return "CAP_SYS_ADMIN" in _strings(caps, "config.json: process.capabilities")
    caps = _object(caps, "config.json: process.capabilities")
    bounding = _get(caps, "bounding", "config.json: process.capabilities")
    if bounding is None:
        return False
    return "CAP_SYS_ADMIN" in _strings(bounding, "config.json: process.capabilities.bounding")


def _env(process: dict) -> tuple[tuple[str, str], ...]:
    entries = _get(process, "env", "config.json: process")
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
        options = _get(m, "options", where)
        source, kind = _get(m, "source", where), _get(m, "type", where)
        mounts.append(Mount(
            source=_string("" if source is None and "source" not in m else source, f"{where}.source"),
            destination=_string(_get(m, "destination", where), f"{where}.destination", nonempty=True),
            type=_string("" if kind is None and "type" not in m else kind, f"{where}.type"),
            options=() if options is None else _strings(options, f"{where}.options"),
        ))
    return tuple(mounts)


def parse_spec(data: bytes, bundle: str) -> Spec:
    obj = _object(_loads(data, "config.json", SPEC_CAP), "config.json")
    _string(_get(obj, "ociVersion", "config.json"), "config.json: ociVersion", nonempty=True)
    process = _get(obj, "process", "config.json")
    process = {} if process is None else _object(process, "config.json: process")
    root = _object(_get(obj, "root", "config.json"), "config.json: root")
    path = _string(_get(root, "path", "config.json: root"), "config.json: root.path", nonempty=True)
    return Spec(
        env=_env(process),
        rootfs=_absolute(bundle, path),   # hooks run with the bundle as working directory
        privileged=_privileged(process),
        mounts=_mounts(_get(obj, "mounts", "config.json")),
        annotations=_annotations(_get(obj, "annotations", "config.json"), "config.json: annotations"),
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
