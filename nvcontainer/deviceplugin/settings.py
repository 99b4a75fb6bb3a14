"""The ``[device-plugin]`` table of the config file, checked into :class:`Settings`. Pure.

Why a table of its own, parsed here rather than in ``config.py``: the hook reads the config file
on every container start and must not pay for (or fail on) settings it never uses, and the
plugin's settings change with the plugin. ``config.py`` only accepts the table and keeps it as
raw TOML data; this module is as strict with it as ``config.py`` is with the rest: an unknown
key or a value of the wrong type is an error naming the key (a misspelt ``mig-strategy`` must
not silently advertise whole GPUs on a MIG node). The five health keys and the value checkers
are :mod:`nvcontainer.health.settings`'s, which the DRA driver reads the same keys with.

Key (TOML)                          Default                            Meaning
socket-dir                          "/var/lib/kubelet/device-plugins"  where kubelet.sock is and ours go
mig-strategy                        "none"                             none, single or mixed
device-id-strategy                  "uuid"                             IDs and NVIDIA_VISIBLE_DEVICES by
                                                                       uuid or index
device-list-strategy                ["envvar"]                         how Allocate names the devices:
                                                                       envvar, volume-mounts,
                                                                       cdi-annotations, cdi-cri
cdi-kind                            "nvidia.com/gpu"                   vendor/class of the CDI names
                                                                       (as `cdi generate` was given)
cdi-annotation-prefix               "cdi.k8s.io/"                      annotation key prefix
replicas                            1                                  IDs per device (shared by
                                                                       time-slicing or MPS)
sharing                             "time-slicing"                     how replicas share a GPU:
                                                                       time-slicing or mps
mps-root                            "/run/nvidia/mps"                  host directory of the MPS
                                                                       daemons' per-resource pipe
                                                                       and log directories
rename-shared                       false                              with replicas: advertise
                                                                       <resource>.shared
fail-requests-greater-than-one      false                              with replicas: refuse requests
                                                                       for more than one
health-checks                       true                               watch NVML events
ignore-xids                         []                                 more XIDs that leave a GPU healthy
xid-recovery-seconds                0                                  a GPU unhealthy after a critical
                                                                       XID is healthy again after this
                                                                       long without one; 0: never
heartbeat-seconds                   0.5                                the health watcher's beat
heartbeat-timeout-seconds           5                                  no beat this long: the driver
                                                                       stopped answering
sysfs                               "/sys"                             where the GPUs' NUMA nodes are read
"""

from __future__ import annotations

import re

from ..errors import NvcError, escape
from ..health import settings as health
from ..records import record, replace

_bad, _bool, _number = health.bad, health.boolean, health.number

MIG_STRATEGIES = ("none", "single", "mixed")
ID_STRATEGIES = ("uuid", "index")
LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
SHARING = ("time-slicing", "mps")
DEFAULT_MPS_ROOT = "/run/nvidia/mps"
MAX_REPLICAS = 64
MAX_XIDS = health.MAX_XIDS
DEFAULT_SOCKET_DIR = "/var/lib/kubelet/device-plugins"

_KIND = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,62}/[A-Za-z][A-Za-z0-9_.-]{0,62}")
# a DNS subdomain and a slash: what may stand before an annotation's name
_PREFIX = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/")


@record
class Settings:
    socket_dir: str = DEFAULT_SOCKET_DIR
    mig_strategy: str = "none"
    device_id_strategy: str = "uuid"
    device_list_strategy: tuple[str, ...] = ("envvar",)
    cdi_kind: str = "nvidia.com/gpu"
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    replicas: int = 1
    sharing: str = "time-slicing"
    mps_root: str = DEFAULT_MPS_ROOT
    rename_shared: bool = False
    fail_requests_greater_than_one: bool = False
    health_checks: bool = True
    ignore_xids: tuple[int, ...] = ()
    xid_recovery_seconds: float = 0
    heartbeat_seconds: float = 0.5
    heartbeat_timeout_seconds: float = 5
    sysfs: str = "/sys"

    def with_overrides(self, **changes) -> "Settings":
        """These settings with the command line's options that were given (not None), checked
        as the same keys in the file would be."""
        given = {k: v for k, v in changes.items() if v is not None}
        raw = {field.replace("_", "-"): value for field, value in given.items()}
        if "device-list-strategy" in raw:
            raw["device-list-strategy"] = list(raw["device-list-strategy"])
        return check(replace(self, **_checked(raw, "command line")))


def _choice(choices):
    def check(value, key):
        if value not in choices:
            raise _bad(key, value, " or ".join(repr(c) for c in choices))
        return value
    return check


def _absolute(value, key):
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value or len(value) > 200:
        raise _bad(key, value, "an absolute path (at most 200 characters)")
    return value.rstrip("/") or "/"


def _replicas(value, key):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REPLICAS:
        raise _bad(key, value, f"a whole number from 1 to {MAX_REPLICAS}")
    return value


def _strategies(value, key):
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise _bad(key, value, "a comma-separated string or an array of strings")
    items = [i.strip() for i in items if i.strip()]
    unknown = [i for i in items if i not in LIST_STRATEGIES]
    if unknown or not items:
        raise _bad(key, value, "some of " + ", ".join(LIST_STRATEGIES))
    return tuple(dict.fromkeys(items))


def _kind(value, key):
    if not isinstance(value, str) or not _KIND.fullmatch(value):
        raise _bad(key, value, "a CDI kind, vendor/class (e.g. nvidia.com/gpu)")
    return value


def _prefix(value, key):
    if not isinstance(value, str) or not _PREFIX.fullmatch(value):
        raise _bad(key, value, "a DNS subdomain followed by '/' (e.g. cdi.k8s.io/)")
    return value


_KEYS = {
    "socket-dir": ("socket_dir", _absolute),
    "mig-strategy": ("mig_strategy", _choice(MIG_STRATEGIES)),
    "device-id-strategy": ("device_id_strategy", _choice(ID_STRATEGIES)),
    "device-list-strategy": ("device_list_strategy", _strategies),
    "cdi-kind": ("cdi_kind", _kind),
    "cdi-annotation-prefix": ("cdi_annotation_prefix", _prefix),
    "replicas": ("replicas", _replicas),
    "sharing": ("sharing", _choice(SHARING)),
    "mps-root": ("mps_root", _absolute),
    "rename-shared": ("rename_shared", _bool),
    "fail-requests-greater-than-one": ("fail_requests_greater_than_one", _bool),
    **health.KEYS,
    "sysfs": ("sysfs", _absolute),
}

KEYS = tuple(_KEYS)


def _checked(raw: dict, source: str) -> dict:
    values = {}
    for key, value in raw.items():
        if key not in _KEYS:
            raise NvcError("config", f"{escape(source)}: unknown key 'device-plugin.{escape(key, 80)}'")
        name, check = _KEYS[key]
        values[name] = check(value, key)
    return values


def parse(raw: dict | None, source: str = "config") -> Settings:
    """``raw``: the ``[device-plugin]`` table as tomllib gave it (None: no table)."""
    if raw is None:
        return Settings()
    if not isinstance(raw, dict):
        raise NvcError("config", f"{escape(source)}: device-plugin must be a table")
    settings = Settings(**_checked(raw, source))
    return check(settings)


def check(settings: Settings) -> Settings:
    """What no single key can say wrong: a beat that outlives its own timeout."""
    health.check_beat(settings.heartbeat_seconds, settings.heartbeat_timeout_seconds)
    return settings
