"""Which configuration file is read, and its keys into one :class:`~.model.Config`.

The hook and the runtime shim read the file on every container start, as root, so it is strict:
an unknown key or a value of the wrong type is an error naming the key, never silently ignored
(a misspelt ``accept-nvidia-visible-devices-envvar-when-unprivileged`` would otherwise quietly
reopen the hole it was meant to close). The layout is nvidia-container-toolkit's
(:mod:`.toolkit`: its tables, its keys, upstream keys without an effect here accepted and
reported), plus nvcontainer's earlier flat layout, so both an operator's
``/etc/nvidia-container-runtime/config.toml`` and an existing ``/etc/nvcontainer/config.toml``
are read as they are.

Which file: ``--config FILE`` (which must exist), else ``/etc/nvcontainer/config.toml``, else
``/etc/nvidia-container-runtime/config.toml``, else the defaults. nvcontainer's own file wins
because it was written for nvcontainer, where the toolkit's may be left over from the stack being
replaced; when both exist, one line says which was read (:attr:`Config.note`). Never from the
environment: upstream's ``NVIDIA_CTK_CONFIG_FILE_PATH`` and ``XDG_CONFIG_HOME`` would let whoever
starts a runtime choose the settings of a root program.

``cuda-compat-mode = "ldconfig"`` makes the image's ``/usr/local/cuda/compat`` libraries visible
with an ``/etc/ld.so.conf.d`` drop-in inside the container, when they are newer than the host
driver. Upstream's ``mount`` mode bind-mounts those image files; this project never mounts
anything taken from an image, so ``mount`` is refused with an explanation rather than accepted.
"""

from __future__ import annotations

import errno
import os
import stat

from ..documents import toml_value
from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from ..records import replace
from . import values
from .model import Config

DEFAULT_PATH = "/etc/nvcontainer/config.toml"
TOOLKIT_PATH = "/etc/nvidia-container-runtime/config.toml"
CONFIG_CAP = 1 << 20


def _shown(value: object) -> str:
    import json   # on the way to an error only

    return escape(json.dumps(value, default=str), 80)


class _Reader:
    """One file's keys into Config fields, each field set at most once."""

    def __init__(self, source: str):
        self.source = source
        self.values: dict[str, object] = {}
        self.named: dict[str, str] = {}
        self.inert: list[str] = []

    def take(self, table: str, key: str, value: object, where: str | None = None) -> None:
        from . import toolkit   # here: a start without a file does not import the file's layout

        name, check = toolkit.TABLES[table][key]
        where = where or toolkit.where(table, key)
        if name in self.named:
            raise NvcError("config", f"{escape(self.source)}: {escape(where)} and {escape(self.named[name])} set "
                                     "the same setting: keep one")
        self.values[name] = check(value, where)
        self.named[name] = where

    def table(self, table: str, data: dict) -> None:
        from . import toolkit

        for key, value in data.items():
            path = f"{table}.{key}" if table else key
            if key in toolkit.TABLES.get(table, {}):
                self.take(table, key, value)
            elif not table and key in toolkit.RAW:
                if not isinstance(value, dict):
                    raise values.bad(key, value, "a table")
                self.values[toolkit.RAW[key]] = value
                self.named[toolkit.RAW[key]] = key
            elif key in toolkit.INERT.get(table, {}):
                self.inert.append(f"{toolkit.where(table, key)} = {_shown(value)}: no effect here "
                                  f"({toolkit.INERT[table][key]})")
            elif isinstance(value, dict) and toolkit.is_table(path):
                self.table(path, value)
            elif not table and key in toolkit.FLAT:
                self.take(*toolkit.FLAT[key], value, where=key)
            else:
                raise NvcError("config", f"{escape(self.source)}: unknown key '{escape(path, 80)}'")


def parse(text: str, source: str = "config") -> Config:
    data = toml_value(text, escape(source), cap=CONFIG_CAP, category="config")   # imports tomllib: only now
    reader = _Reader(source)
    reader.table("", data)
    return Config(**reader.values, source=source, origins=tuple((name, source) for name in reader.values),
                  inert=tuple(reader.inert))


def _read(path: str) -> bytes | None:
    """The file's bytes, or None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise NvcError("config", f"cannot open {escape(path)}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NvcError("config", f"{escape(path)}: not a regular file")
        data, more = read_at_most(fd, CONFIG_CAP)
        if more:
            raise NvcError("config", f"{escape(path)}: larger than {CONFIG_CAP} bytes")
        return data
    except OSError as exc:
        raise NvcError("config", f"cannot read {escape(path)}: {exc.strerror}") from None
    finally:
        os.close(fd)


def load(path: str | None = None) -> Config:
    """The configuration from ``path`` (which must exist), else from the first default file
    present (:data:`DEFAULT_PATH`, then :data:`TOOLKIT_PATH`), else the defaults."""
    if path is not None:
        data = _read(path)
        if data is None:
            raise NvcError("config", f"cannot open {escape(path)}: {os.strerror(errno.ENOENT)}")
        return _parse_bytes(data, path)
    ours = _read(DEFAULT_PATH)
    if ours is not None:
        config = _parse_bytes(ours, DEFAULT_PATH)
        if os.path.lexists(TOOLKIT_PATH):
            return replace(config, note=f"both {DEFAULT_PATH} and {TOOLKIT_PATH} exist: {DEFAULT_PATH} is read, "
                                        f"{TOOLKIT_PATH} is not (nvcontainer's own file wins)")
        return config
    theirs = _read(TOOLKIT_PATH)
    return Config() if theirs is None else _parse_bytes(theirs, TOOLKIT_PATH)


def _parse_bytes(data: bytes, path: str) -> Config:
    try:
        text = data.decode("utf-8")
    except UnicodeError:
        raise NvcError("config", f"{escape(path)}: not UTF-8 text") from None
    return parse(text, path)
