"""The operator's settings, from ``/etc/nvcontainer/config.toml``.

The hook reads this file on every container start, as root, so it is strict: an unknown key or a
value of the wrong type is an error naming the key, never silently ignored (a misspelt
``accept-nvidia-visible-devices-envvar-when-unprivileged`` would otherwise quietly reopen the hole
it was meant to close). A missing default file means the defaults; a file named with ``--config``
must exist. All keys are top level; names follow nvidia-container-toolkit's config.toml, where
they live under ``[nvidia-container-cli]`` or at top level:

Key (TOML)                                                 Default               Meaning
root                                                       "/"                   driver root (absolute)
ldcache                                                    "/etc/ld.so.cache"    DSO cache inside root
debug                                                      unset                 debug log file (absolute)
user                                                       unset: overflow ids   UID[:GID] of the NVML helper
ldconfig                                                   "@/sbin/ldconfig"     "@" + absolute host path; an
                                                                                 image's ldconfig is never run;
                                                                                 /sbin/ldconfig means
                                                                                 /sbin/ldconfig.real where the
                                                                                 host has that (Ubuntu)
no-cgroups                                                 false                 leave the device cgroup alone
supported-driver-capabilities                              all seven             "all", comma list or array
disable-require                                            false                 ignore every requirement
swarm-resource                                             ""                    env names (comma list or array)
                                                                                 that replace NVIDIA_VISIBLE_DEVICES
accept-nvidia-visible-devices-envvar-when-unprivileged     true                  false: unprivileged containers get
                                                                                 GPUs only through volume mounts
accept-nvidia-visible-devices-as-volume-mounts             false                 honour /dev/null device mounts
cuda-compat-mode                                           "ldconfig"            or "disabled"
deadline                                                   30                    seconds for a whole hook run
cache-dir                                                  "/run/nvcontainer"    root-only directory of the per-boot
                                                                                 driver inventory cache (absolute)
driver-volume-dir                                          "/var/lib/nvcontainer/volumes"
                                                                                 where `nvcontainer volume create`
                                                                                 builds nvidia_<version>/ volumes for
                                                                                 com.nvidia.volumes.needed images
allowed-devices                                            unset: every device   the GPUs and MIG devices this node
                                                                                 may hand out (device tokens, comma
                                                                                 list or array); "all": every device
[device-plugin]                                            unset                 `nvcontainer device-plugin`'s table,
                                                                                 kept raw here and checked by
                                                                                 nvcontainer.deviceplugin.settings

``cuda-compat-mode = "ldconfig"`` makes the image's ``/usr/local/cuda/compat`` libraries visible
with an ``/etc/ld.so.conf.d`` drop-in inside the container, when they are newer than the host
driver. Upstream's ``mount`` mode bind-mounts those image files; this project never mounts
anything taken from an image, so ``mount`` is refused with an explanation rather than accepted.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field, replace

from .errors import NvcError, escape
from .fs.bounded import read_at_most
from .request import CAPABILITIES

DEFAULT_PATH = "/etc/nvcontainer/config.toml"
CONFIG_CAP = 1 << 20
MAX_DEADLINE = 3600

_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(?::[A-Za-z0-9_][A-Za-z0-9_.-]*)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_COMPAT_MODES = ("ldconfig", "disabled")
_DEVICE_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9:./-]{0,127}")
MAX_ALLOWED = 1024


@dataclass(frozen=True)
class Config:
    root: str = "/"
    ldcache: str = "/etc/ld.so.cache"
    debug: str | None = None
    user: str | None = None
    ldconfig: str = "@/sbin/ldconfig"
    no_cgroups: bool = False
    supported_driver_capabilities: tuple[str, ...] = CAPABILITIES
    disable_require: bool = False
    swarm_resource: tuple[str, ...] = ()
    accept_envvar_unprivileged: bool = True
    accept_volume_mounts: bool = False
    cuda_compat_mode: str = "ldconfig"
    deadline: float = 30
    cache_dir: str = "/run/nvcontainer"
    driver_volume_dir: str = "/var/lib/nvcontainer/volumes"
    allowed_devices: tuple[str, ...] | None = None
    device_plugin: dict | None = field(default=None, hash=False)   # raw [device-plugin] table

    def with_overrides(self, *, root: str | None = None, ldcache: str | None = None,
                       debug: str | None = None, user: str | None = None) -> "Config":
        """This config with the global command-line options that were given (not None) applied."""
        changes = {}
        if root is not None:
            changes["root"] = _absolute(root, "--root")
        if ldcache is not None:
            changes["ldcache"] = _absolute(ldcache, "--ldcache")
        if debug is not None:
            changes["debug"] = _path(debug, "--debug")
        if user is not None:
            changes["user"] = _user(user, "--user")
        return replace(self, **changes)

    def ldconfig_program(self) -> str:
        """The host path of the ldconfig a run executes: :func:`host_ldconfig` of ``ldconfig``."""
        return host_ldconfig(self.ldconfig).removeprefix("@")


LDCONFIG = "/sbin/ldconfig"
LDCONFIG_REAL = "/sbin/ldconfig.real"


def host_ldconfig(value: str, exists=os.path.exists) -> str:
    """``value`` (``@PATH`` or a bare host path), with /sbin/ldconfig read as /sbin/ldconfig.real
    where the host has that, as nvidia-container-toolkit normalises it.

    Why: on Ubuntu, /sbin/ldconfig is a shell script that execs the binary beside it. Only a
    static binary runs in the sandbox (no interpreter of the host is taken into the container),
    so the default would refuse every GPU container there with "not an ELF file"."""
    if value.removeprefix("@") == LDCONFIG and exists(LDCONFIG_REAL):
        return value.replace(LDCONFIG, LDCONFIG_REAL, 1)
    return value


def _bad(key: str, value: object, want: str) -> NvcError:
    return NvcError("config", f"{key}: expected {want}, got {escape(repr(value), 80)}")


def _path(value: object, key: str) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise _bad(key, value, "a path")
    return value


def _absolute(value: object, key: str) -> str:
    if not _path(value, key).startswith("/"):
        raise _bad(key, value, "an absolute path")
    return value


def _user(value: object, key: str) -> str:
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise _bad(key, value, "UID[:GID] (numbers or names)")
    return value


def _bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false")
    return value


def _list(value: object, key: str) -> list[str]:
    """A comma-separated string (upstream's form) or a TOML array of strings."""
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = value
    else:
        raise _bad(key, value, "a comma-separated string or an array of strings")
    return [item.strip() for item in items if item.strip()]


def _capabilities(value: object, key: str) -> tuple[str, ...]:
    items = _list(value, key)
    if "all" in items:
        return CAPABILITIES
    unknown = [i for i in items if i not in CAPABILITIES]
    if unknown:
        raise NvcError("config", f"{key}: unknown capability '{escape(unknown[0], 40)}' "
                                 f"(known: {','.join(CAPABILITIES)}, all)")
    return tuple(sorted(set(items)))


def _env_names(value: object, key: str) -> tuple[str, ...]:
    names = _list(value, key)
    for name in names:
        if not _ENV_NAME.fullmatch(name):
            raise _bad(key, name, "environment variable names")
    return tuple(dict.fromkeys(names))


def _ldconfig(value: object, key: str) -> str:
    if not isinstance(value, str) or not value.startswith("@/") or "\0" in value:
        raise _bad(key, value, "'@' followed by an absolute host path (the image's ldconfig is never run)")
    return value


def _compat_mode(value: object, key: str) -> str:
    if value == "mount":
        raise NvcError("config", f"{key}: 'mount' is not supported: nvcontainer never bind-mounts files "
                                 "from an image; 'ldconfig' uses the image's compat libraries in place")
    if value not in _COMPAT_MODES:
        raise _bad(key, value, " or ".join(repr(m) for m in _COMPAT_MODES))
    return value


def _deadline(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_DEADLINE:
        raise _bad(key, value, f"a number of seconds, more than 0 and at most {MAX_DEADLINE}")
    return value


def _device_tokens(value: object, key: str) -> tuple[str, ...] | None:
    """Device tokens as in a request; they are matched against the GPUs when a container asks.
    An empty list is a node that hands out no GPU at all (the driver only)."""
    tokens = _list(value, key)
    if len(tokens) > MAX_ALLOWED:
        raise _bad(key, f"{len(tokens)} entries", f"at most {MAX_ALLOWED} device tokens")
    for token in tokens:
        if not _DEVICE_TOKEN.fullmatch(token):
            raise _bad(key, token, "device tokens (an index, GPU-/MIG- UUID, PCI bus id, <gpu>:<mig> or all)")
    if "all" in tokens:
        return None
    return tuple(dict.fromkeys(tokens))


def _table(value: object, key: str) -> dict:
    if not isinstance(value, dict):
        raise _bad(key, value, "a table")
    return value


# TOML key -> (Config field, validator)
_KEYS = {
    "root": ("root", _absolute),
    "ldcache": ("ldcache", _absolute),
    "debug": ("debug", _absolute),
    "user": ("user", _user),
    "ldconfig": ("ldconfig", _ldconfig),
    "no-cgroups": ("no_cgroups", _bool),
    "supported-driver-capabilities": ("supported_driver_capabilities", _capabilities),
    "disable-require": ("disable_require", _bool),
    "swarm-resource": ("swarm_resource", _env_names),
    "accept-nvidia-visible-devices-envvar-when-unprivileged": ("accept_envvar_unprivileged", _bool),
    "accept-nvidia-visible-devices-as-volume-mounts": ("accept_volume_mounts", _bool),
    "cuda-compat-mode": ("cuda_compat_mode", _compat_mode),
    "deadline": ("deadline", _deadline),
    "cache-dir": ("cache_dir", _absolute),
    "driver-volume-dir": ("driver_volume_dir", _absolute),
    "allowed-devices": ("allowed_devices", _device_tokens),
    "device-plugin": ("device_plugin", _table),
}


def parse(text: str, source: str = "config") -> Config:
    import tomllib   # here, not at the top: most hosts have no file, and the hook starts faster

    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise NvcError("config", f"{escape(source)}: {escape(exc)}") from None
    values = {}
    for key, value in data.items():
        if key not in _KEYS:
            raise NvcError("config", f"{escape(source)}: unknown key '{escape(key, 80)}'")
        name, check = _KEYS[key]
        values[name] = check(value, key)
    return Config(**values)


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
    """The configuration from ``path`` (which must exist) or from the default file if present."""
    data = _read(path if path is not None else DEFAULT_PATH)
    if data is None:
        if path is not None:
            raise NvcError("config", f"cannot open {escape(path)}: {os.strerror(errno.ENOENT)}")
        return Config()
    try:
        text = data.decode("utf-8")
    except UnicodeError:
        raise NvcError("config", f"{escape(path or DEFAULT_PATH)}: not UTF-8 text") from None
    return parse(text, path or DEFAULT_PATH)
