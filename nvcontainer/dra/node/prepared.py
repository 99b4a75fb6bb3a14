"""What this node has prepared for a claim, as records: the claim (namespace, name, UID, spec
file) and each device the kubelet is answered with (request, pool, DRA name, UUID, CDI names,
sharing settings and their configuration group, shareID, adminAccess). Pure.

Why records and not the JSON's dicts: the same entry is kept in memory, written to the
checkpoint, written as the comment of the claim's spec, and read back from either after a
restart. As dicts, every reader indexed them by string and guarded against a missing key on
its own (``(d.get("sharing") or {}).get("strategy")``), and the one check of their shape sat
apart from them. Here the shape is checked once, where the JSON is read
(:meth:`PreparedClaim.from_json`), and everything after reads typed attributes.

Why the JSON is kept exactly as it was (:meth:`PreparedClaim.to_json`): checkpoints and spec
comments written by an earlier version are on the nodes, and a plugin rolled back must read
what this one wrote. The device's sharing settings are :class:`~nvcontainer.dra.opaque.Sharing`
(what the claim's configuration asked), written as its ``to_dict`` with the configuration group
beside them; ``adminAccess`` is written only when true, so an entry of a claim without it reads
as it did before the field existed. An entry of before configuration groups (no ``group``)
reads as group "" and is written back with it.

Bounds of what is read: at most MAX_DEVICES devices per claim, every name text, the sharing
settings' fields of the types and ranges the claim's configuration allows (``opaque``): a
damaged or hostile checkpoint is refused with one line naming what is wrong, never a crash
later in the code that reads it.
"""

from __future__ import annotations

from ...errors import NvcError
from ...records import record
from .. import opaque
from . import claims, claimspec

MAX_DEVICES = 256
ENTRY_KEYS = {"namespace", "name", "uid", "devices", "spec"}
DEVICE_KEYS = {"request", "pool", "device", "uuid", "cdi", "sharing", "shareID"}
OPTIONAL_DEVICE_KEYS = {"adminAccess"}      # only when true: older checkpoints read the same
NAME_KEYS = ("request", "pool", "device", "uuid", "shareID")
SHARING_TEXT = ("kind", "strategy", "interval", "group")
SHARING_KEYS = {*SHARING_TEXT, "activeThreads", "pinnedLimit", "perDeviceLimits"}


@record
class PreparedDevice:
    """One device prepared for the claim: what the kubelet is answered with, and what
    unprepare, MPS and time-slicing need to undo it."""

    request: str
    pool: str
    device: str                               # the DRA device name (gpu-0, gpu-0-mig-...)
    uuid: str
    cdi: tuple[str, ...]                      # the CDI names the kubelet is given
    sharing: opaque.Sharing
    group: str = ""                           # the config entry that gave ``sharing`` ("config[2]")
    share_id: str = ""                        # the allocation result's shareID, if any
    admin: bool = False                       # allocated with adminAccess

    def to_json(self) -> dict:
        out: dict = {"request": self.request, "pool": self.pool, "device": self.device, "uuid": self.uuid,
                     "cdi": list(self.cdi), "sharing": {**self.sharing.to_dict(), "group": self.group},
                     "shareID": self.share_id}
        if self.admin:
            out["adminAccess"] = True
        return out


@record
class PreparedClaim:
    """A prepared claim: the checkpoint's entry, and the record in its spec's comment."""

    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]
    spec: str                                 # the spec's file name in the CDI directory

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"

    @classmethod
    def of(cls, claim: claims.Claim) -> PreparedClaim:
        """The entry of a claim just resolved against the inventory."""
        return cls(claim.namespace, claim.name, claim.uid, tuple(
            PreparedDevice(u.request, claim.pool, u.device, u.uuid, (claimspec.cdi_name(claim.uid, u.device),),
                           u.sharing, u.group, u.share_id, u.admin) for u in claim.units),
            claimspec.file_name(claim.uid))

    @classmethod
    def nothing(cls, namespace: str, name: str, uid: str) -> PreparedClaim:
        """A claim this node knows nothing of (unprepare after a lost checkpoint): no devices."""
        return cls(namespace, name, uid, (), claimspec.file_name(uid))

    def to_json(self) -> dict:
        return {"namespace": self.namespace, "name": self.name, "uid": self.uid,
                "devices": [d.to_json() for d in self.devices], "spec": self.spec}

    @classmethod
    def from_json(cls, uid, data) -> PreparedClaim:
        """The entry of claim ``uid`` from its JSON; NvcError("input") with one line saying what
        is wrong with it otherwise."""
        if not isinstance(data, dict) or set(data) != ENTRY_KEYS:
            raise _bad("not a claim record")
        if data["uid"] != uid or not isinstance(data["spec"], str) or claimspec.uid_of(data["spec"]) != uid:
            raise _bad("its UID and spec file disagree")
        if not isinstance(data["namespace"], str) or not isinstance(data["name"], str):
            raise _bad("namespace and name must be text")
        devices = data["devices"]
        if not isinstance(devices, list) or len(devices) > MAX_DEVICES:
            raise _bad("devices: not a list")
        return cls(data["namespace"], data["name"], uid, tuple(_device(d) for d in devices), data["spec"])


def _device(data) -> PreparedDevice:
    if not isinstance(data, dict) or set(data) - OPTIONAL_DEVICE_KEYS != DEVICE_KEYS \
            or data.get("adminAccess", True) is not True:
        raise _bad("a device record of another shape")
    if not isinstance(data["cdi"], list) or not all(isinstance(n, str) for n in data["cdi"]):
        raise _bad("a device's CDI names are not text")
    if not all(isinstance(data[k], str) for k in NAME_KEYS):
        raise _bad("a device's names are not text")
    sharing, group = _sharing(data["sharing"])
    return PreparedDevice(data["request"], data["pool"], data["device"], data["uuid"], tuple(data["cdi"]),
                          sharing, group, data["shareID"], "adminAccess" in data)


def _sharing(data) -> tuple[opaque.Sharing, str]:
    """The recorded settings (``Sharing.to_dict`` and ``group``) back; a key missing takes the
    default (a record of before that key), an unknown one is refused."""
    if not isinstance(data, dict) or not set(data) <= SHARING_KEYS \
            or not all(isinstance(data.get(k, ""), str) for k in SHARING_TEXT):
        raise _bad("a device's sharing settings are of another shape")
    threads, limit, per = data.get("activeThreads"), data.get("pinnedLimit"), data.get("perDeviceLimits") or []
    if not (threads is None or _int(threads, 0, 100)) or not (limit is None or _limit(limit)) \
            or not isinstance(per, list) or len(per) > MAX_DEVICES \
            or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and _limit(p[1]) for p in per):
        raise _bad("a device's MPS settings are of another shape")
    return opaque.Sharing(kind=data.get("kind", "gpu"), strategy=data.get("strategy", ""),
                          interval=data.get("interval", ""), active_threads=threads, pinned_limit=limit,
                          per_device_limits=tuple((key, amount) for key, amount in per)), data.get("group", "")


def _int(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _limit(value) -> bool:
    """A memory limit as the claim's configuration allows it (``opaque._limit``'s bounds)."""
    return _int(value, opaque.MIB, opaque.QUANTITY_MAX)


def _bad(problem: str) -> NvcError:
    return NvcError("input", problem)
