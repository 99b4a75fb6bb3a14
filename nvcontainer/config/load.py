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
deadline                                                   20                    seconds for a whole hook run
cache-dir                                                  "/run/nvcontainer"    root-only directory of the per-boot
                                                                                 driver inventory cache (absolute)
driver-volume-dir                                          "/var/lib/nvcontainer/volumes"
                                                                                 where `nvcontainer volume create`
                                                                                 builds nvidia_<version>/ volumes for
                                                                                 com.nvidia.volumes.needed images
allowed-devices                                            unset: every device   the GPUs and MIG devices this node
                                                                                 may hand out (device tokens, comma
                                                                                 list or array); "all": every device

``cuda-compat-mode = "ldconfig"`` makes the image's ``/usr/local/cuda/compat`` libraries visible
with an ``/etc/ld.so.conf.d`` drop-in inside the container, when they are newer than the host
driver. Upstream's ``mount`` mode bind-mounts those image files; this project never mounts
anything taken from an image, so ``mount`` is refused with an explanation rather than accepted.
"""

from __future__ import annotations

import errno
import os
import stat

from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from . import values
from .model import Config

DEFAULT_PATH = "/etc/nvcontainer/config.toml"
CONFIG_CAP = 1 << 20


# TOML key -> (Config field, validator)
_KEYS = {
    "root": ("root", values.absolute),
    "ldcache": ("ldcache", values.absolute),
    "debug": ("debug", values.absolute),
    "user": ("user", values.user),
    "ldconfig": ("ldconfig", values.ldconfig),
    "no-cgroups": ("no_cgroups", values.boolean),
    "supported-driver-capabilities": ("supported_driver_capabilities", values.capabilities),
    "disable-require": ("disable_require", values.boolean),
    "swarm-resource": ("swarm_resource", values.env_names),
    "accept-nvidia-visible-devices-envvar-when-unprivileged": ("accept_envvar_unprivileged", values.boolean),
    "accept-nvidia-visible-devices-as-volume-mounts": ("accept_volume_mounts", values.boolean),
    "cuda-compat-mode": ("cuda_compat_mode", values.compat_mode),
    "deadline": ("deadline", values.deadline),
    "cache-dir": ("cache_dir", values.absolute),
    "driver-volume-dir": ("driver_volume_dir", values.absolute),
    "allowed-devices": ("allowed_devices", values.device_tokens),
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
