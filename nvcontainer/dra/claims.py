"""A ResourceClaim (as the API server returns it, a plain dict) → what this node must prepare.
Pure: the claim is read elsewhere (``kubeapi.get_claim``), the inventory is given.

Why each check: the kubelet names a claim by namespace, name and UID, but reads nothing of it;
the plugin reads the claim itself. So the claim read back may be another one by the same name
(deleted and created again: the UID differs), may be on its way out (``deletionTimestamp``),
may not be allocated yet, or may hold results for other drivers and other nodes (a claim can
span drivers; network-attached pools are not this node's). Only the results for
``gpu.nvidia.com`` in this node's pool are ours, and each must name a device this node has,
allowed (``allowed-devices``) and healthy: anything else is an error that names the device,
never a container started without it.
"""

from __future__ import annotations

from ..errors import NvcError, escape
from ..records import record
from . import opaque

DRIVER = opaque.DRIVER
MAX_RESULTS = 256


@record
class Unit:
    """One allocated device, resolved against the inventory."""

    request: str
    device: str                       # the DRA device name (gpu-0, gpu-0-mig-...)
    gpu: object                       # inventory Gpu
    mig: object = None                # inventory MigDevice, or None for a whole GPU
    sharing: opaque.Sharing = opaque.Sharing()
    share_id: str = ""                # the result's shareID (a consumable-capacity share), if any
    admin: bool = False               # allocated with adminAccess (may share a device another claim holds)
    group: str = ""                   # the config entry that gave ``sharing`` ("config[2]"), "" for none

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig is not None else self.gpu.uuid


@record
class Claim:
    namespace: str
    name: str
    uid: str
    pool: str
    units: tuple[Unit, ...]

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"


def resolve(claim: dict, namespace: str, name: str, uid: str, node: str, table: dict, *, unhealthy=None,
            driver: str = DRIVER) -> Claim:
    """The claim's devices for this driver and node. ``table``: DRA device name → (gpu, mig)
    for the devices this node publishes (allowed ones only); ``unhealthy``: UUID → reason."""
    label = f"{escape(namespace, 80)}/{escape(name, 120)}"
    if not isinstance(claim, dict):
        raise NvcError("input", f"claim {label}: not an object")
    meta = claim.get("metadata") or {}
    if meta.get("uid") != uid:
        raise NvcError("input", f"claim {label}: its UID is {escape(str(meta.get('uid')), 60)}, the kubelet "
                                f"asked for {escape(uid, 60)} (deleted and created again?)")
    if meta.get("deletionTimestamp"):
        raise NvcError("input", f"claim {label}: is being deleted")
    allocation = (claim.get("status") or {}).get("allocation")
    if not isinstance(allocation, dict):
        raise NvcError("input", f"claim {label}: not allocated yet")
    devices = allocation.get("devices") or {}
    if not isinstance(devices, dict):
        raise NvcError("input", f"claim {label}: status.allocation.devices: not an object")
    results = devices.get("results") or []
    if not isinstance(results, list) or len(results) > MAX_RESULTS:
        raise NvcError("input", f"claim {label}: status.allocation.devices.results: not a list of at most "
                                f"{MAX_RESULTS}")
    try:
        configs = opaque.entries(devices.get("config"), driver)
    except NvcError as exc:
        raise NvcError("input", f"claim {label}: {exc.detail}") from None
    units = []
    for i, result in enumerate(results):
        if not isinstance(result, dict):
            raise NvcError("input", f"claim {label}: results[{i}]: not an object")
        if result.get("driver") != driver or result.get("pool") != node:
            continue
        device, request = result.get("device"), result.get("request")
        if not isinstance(device, str) or not isinstance(request, str):
            raise NvcError("input", f"claim {label}: results[{i}]: device and request must be names")
        found = table.get(device)
        if found is None:
            raise NvcError("input", f"claim {label}: device {escape(device, 80)} is not on node "
                                    f"{escape(node, 80)} (or not allowed there)")
        gpu, mig = found
        uuid = mig.uuid if mig is not None else gpu.uuid
        if unhealthy and uuid in unhealthy:
            raise NvcError("input", f"claim {label}: device {escape(device, 80)} ({uuid}) is unhealthy: "
                                    f"{escape(unhealthy[uuid], 120)}")
        try:
            sharing = opaque.choose(configs, request, device, "mig" if mig is not None else "gpu")
        except NvcError as exc:
            raise NvcError("input", f"claim {label}: {exc.detail}") from None
        share = result.get("shareID") or ""
        group = next((e.where for e in configs if e.sharing is sharing), "")
        units.append(Unit(request, device, gpu, mig, sharing, share if isinstance(share, str) else "",
                          result.get("adminAccess") is True, group))
    _check_groups(units, label)
    return Claim(namespace, name, uid, node, tuple(units))


def group_uuids(units, group: str) -> list[str]:
    """The devices of one configuration group, in the claim's order, each once: what a
    per-device limit's index counts (NVIDIA: the config's own devices, not the claim's)."""
    return list(dict.fromkeys(u.uuid for u in units if u.group == group))


def _check_groups(units, label: str) -> None:
    """A device is in one configuration group (one sharing, one MPS daemon): a device allocated
    for two requests that two different configurations name is refused; per-device limits name
    a device of their own group."""
    seen: dict[str, Unit] = {}
    for unit in units:
        first = seen.setdefault(unit.uuid, unit)
        if first.group != unit.group:
            raise NvcError("input", f"claim {label}: device {escape(unit.device, 80)} is in two configuration "
                                    f"groups ({first.group or 'none'} for request {escape(first.request, 80)}, "
                                    f"{unit.group or 'none'} for request {escape(unit.request, 80)}): a device is "
                                    "shared one way")
    for unit in units:
        try:
            opaque.check_devices(unit.sharing, group_uuids(units, unit.group), f"{unit.group}: mpsConfig")
        except NvcError as exc:
            raise NvcError("input", f"claim {label}: {exc.detail}") from None
