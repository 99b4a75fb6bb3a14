"""The health keys of the ``[device-plugin]`` table, checked. Pure.

Why here and not only in the device plugin's settings: both ways a node offers its GPUs (the
device plugin and the DRA driver) watch them with the same watcher and rules, so they read the
same five keys with the same checks, and the DRA driver must not import the device plugin to do
it. The device plugin's :mod:`~nvcontainer.deviceplugin.settings` parses the whole table with
these checks; :func:`parse` reads only these keys (the rest of the table is the device
plugin's to check) and is what the DRA driver uses. The value checkers are here too, the one
copy both parsers use.
"""

from __future__ import annotations

from ..errors import NvcError, escape
from ..records import record

MAX_XIDS = 256


@record
class Health:
    health_checks: bool = True
    ignore_xids: tuple[int, ...] = ()
    xid_recovery_seconds: float = 0
    heartbeat_seconds: float = 0.5
    heartbeat_timeout_seconds: float = 5


def bad(key: str, value: object, want: str) -> NvcError:
    return NvcError("config", f"device-plugin.{key}: expected {want}, got {escape(repr(value), 80)}")


def boolean(value, key):
    if not isinstance(value, bool):
        raise bad(key, value, "true or false")
    return value


def number(low: float, high: float):
    def check(value, key):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise bad(key, value, f"a number from {low} to {high}")
        return value
    return check


def xids(value, key):
    if (not isinstance(value, list) or len(value) > MAX_XIDS
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 32 for v in value)):
        raise bad(key, value, f"an array of at most {MAX_XIDS} XID numbers")
    return tuple(sorted(set(value)))


KEYS = {
    "health-checks": ("health_checks", boolean),
    "ignore-xids": ("ignore_xids", xids),
    "xid-recovery-seconds": ("xid_recovery_seconds", number(0, 86400)),
    "heartbeat-seconds": ("heartbeat_seconds", number(0.05, 60)),
    "heartbeat-timeout-seconds": ("heartbeat_timeout_seconds", number(0.2, 600)),
}


def check_beat(beat: float, timeout: float) -> None:
    """What no single key can say wrong: a beat that outlives its own timeout."""
    if timeout <= 2 * beat:
        raise NvcError("config", "device-plugin.heartbeat-timeout-seconds must be more than twice "
                                 "heartbeat-seconds")


def parse(raw: dict | None, source: str = "config") -> Health:
    """The health keys of ``raw`` (the ``[device-plugin]`` table as tomllib gave it; None: no
    table), checked; the table's other keys are left to the device plugin."""
    if raw is None:
        return Health()
    if not isinstance(raw, dict):
        raise NvcError("config", f"{escape(source)}: device-plugin must be a table")
    values = {}
    for key, (name, checker) in KEYS.items():
        if key in raw:
            values[name] = checker(raw[key], key)
    health = Health(**values)
    check_beat(health.heartbeat_seconds, health.heartbeat_timeout_seconds)
    return health
