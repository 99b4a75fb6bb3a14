"""What the health watcher reported → which devices are unhealthy. Pure.

Why keep the decision here and not in the watcher: the watcher is vendor code's process and
may be restarted at any moment (a hung driver, a crash); the marks it produced must survive that,
and the rules (which XIDs count, when a GPU is well again) must be testable without a GPU. The
watcher only reports what NVML said; :class:`Health` is the plugin's memory of it.

The rules, NVIDIA's plugin's plus recovery:

* a critical XID (an ``XidCriticalError`` event whose code is not one of the application errors
  13, 31, 43, 45, 68, 109 nor in ``ignore-xids``) marks its GPU unhealthy, or only the MIG device
  whose instance ids it carries; with ``xid-recovery-seconds`` set, the mark lapses when that long
  has passed without another one (0: it stays until the plugin restarts, as upstream's does);
* a GPU that stops answering NVML (``GPU is lost``) is unhealthy, with its MIG devices, until
  it answers again;
* a driver that stops answering altogether (no heartbeat, NVML failing) makes every device
  unhealthy until the watcher runs again.
"""

from __future__ import annotations

from ..inventory.model import Inventory
from ..records import field, record, replace

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
XID_CRITICAL_EVENT = 0x8          # nvmlEventTypeXidCriticalError
NO_INSTANCE = 0xFFFFFFFF


@record
class Health:
    xids: tuple = ()                  # ((gpu uuid, gi, ci), xid, at), one per instance key
    lost: frozenset = frozenset()     # GPU UUIDs that do not answer
    down: str = ""                    # why the driver does not answer; "" when it does


@record
class Policy:
    ignore: frozenset = field(default_factory=frozenset)
    recovery: float = 0               # seconds; 0: never

    def critical(self, event_type: int, xid: int) -> bool:
        return event_type == XID_CRITICAL_EVENT and xid not in APPLICATION_XIDS and xid not in self.ignore


def on_event(health: Health, gpu: str, event_type: int, xid: int, gi: int, ci: int, now: float,
             policy: Policy) -> Health:
    if not policy.critical(event_type, xid):
        return health
    key = (gpu, gi, ci)
    kept = tuple(m for m in health.xids if m[0] != key)
    return replace(health, xids=kept + ((key, xid, now),))


def on_beat(health: Health, lost, now: float, policy: Policy) -> Health:
    """A heartbeat: the driver answers, and ``lost`` are the GPUs that did not."""
    return expire(replace(health, lost=frozenset(lost), down=""), now, policy)


def on_down(health: Health, why: str) -> Health:
    return replace(health, down=why or "the driver does not answer")


def expire(health: Health, now: float, policy: Policy) -> Health:
    if policy.recovery <= 0:
        return health
    kept = tuple(m for m in health.xids if now - m[2] < policy.recovery)
    return health if len(kept) == len(health.xids) else replace(health, xids=kept)


def bad_units(health: Health, inv: Inventory) -> dict[str, str]:
    """UUID of every unhealthy GPU and MIG device → why (for the log)."""
    out: dict[str, str] = {}
    for gpu in inv.gpus:
        units = [gpu.uuid, *(m.uuid for m in gpu.migs)]
        if health.down:
            out.update((u, health.down) for u in units)
            continue
        if gpu.uuid in health.lost:
            out.update((u, "GPU is lost") for u in units)
            continue
        for (uuid, gi, ci), xid, _ in health.xids:
            if uuid != gpu.uuid:
                continue
            why = f"XID {xid}"
            out.setdefault(gpu.uuid, why)
            for mig in gpu.migs:
                if (gi, ci) == (NO_INSTANCE, NO_INSTANCE) or (mig.gi, mig.ci) == (gi, ci):
                    out.setdefault(mig.uuid, why)
    return out
