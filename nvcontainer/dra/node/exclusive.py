"""One prepared claim per device: what a new claim may not take. Pure.

Why at prepare, when the scheduler already allocates each device once: a claim force-deleted
while its pod still runs frees its devices in the API server before the kubelet unprepares it,
so the scheduler may allocate them to a second claim that reaches this node first (NVIDIA's
driver refuses it too, from 25.12). A device is held from the moment a prepare takes it until
its unprepare has finished (its daemon stopped, its time-slice reset), and over a plugin
restart (the checkpoint names it). A whole GPU and a MIG device of it overlap; a claim
allocated with ``adminAccess`` (monitoring) may share a held device, and is held by nobody.
"""

from __future__ import annotations

from ...errors import escape
from .prepared import PreparedClaim, PreparedDevice


def footprint(uuid: str, parents: dict[str, str]) -> tuple[str, str | None]:
    """(GPU UUID, MIG UUID or None) of a device UUID; ``parents``: MIG UUID → its GPU's."""
    return (parents[uuid], uuid) if uuid in parents else (uuid, None)


def overlaps(a: tuple[str, str | None], b: tuple[str, str | None]) -> bool:
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


def conflict(wanted: tuple[PreparedDevice, ...], held: dict[str, PreparedClaim], parents: dict[str, str],
             uid: str) -> str | None:
    """Why the devices ``wanted`` (device records) cannot be prepared for claim ``uid`` while
    ``held`` (UID → claim entry: prepared, being prepared or being unprepared) holds theirs; None
    when they can."""
    for device in wanted:
        if device.admin:
            continue
        mine = footprint(device.uuid, parents)
        for other_uid, entry in held.items():
            if other_uid == uid:
                continue
            for other in entry.devices:
                if not other.admin and overlaps(mine, footprint(other.uuid, parents)):
                    return (f"device {escape(device.device, 80)} ({device.uuid}) is prepared for claim "
                            f"{escape(entry.namespace, 80)}/{escape(entry.name, 120)} "
                            f"({other.device}); a device serves one claim at a time (unless adminAccess)")
    return None
