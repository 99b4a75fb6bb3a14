"""Inventory + settings → the devices the plugin advertises, per resource. Pure.

Why a table decided once, up front: the kubelet only ever names devices by the IDs we gave it,
so every later answer (Allocate, the preferred allocation, a health change) is a look-up in this
table and nothing else. It is built from the same inventory ``list``, the hook and ``cdi
generate`` use, with the node's ``allowed-devices`` applied by the same matcher, so an ID the
kubelet holds always names something the hook will also hand out.

What is advertised under which resource follows NVIDIA's plugin:

* ``mig-strategy = none``: every GPU as ``nvidia.com/gpu`` (MIG mode or not);
* ``single``: on a node whose GPUs all have MIG enabled with one profile, the MIG devices as
  ``nvidia.com/gpu``; on a node with MIG disabled everywhere, the GPUs; anything in between is
  an error (the scheduler would count unlike things as one resource);
* ``mixed``: GPUs without MIG as ``nvidia.com/gpu``, MIG devices as ``nvidia.com/mig-<profile>``.

An ID is the device's UUID (``GPU-…``, ``MIG-…``) or its index (``0``, ``0:1``); with
``replicas = N`` (time-slicing) each device is advertised N times as ``<id>::<k>``.
"""

from __future__ import annotations

import re

from ..errors import NvcError, escape
from ..inventory.model import Gpu, Inventory, MigDevice
from ..records import field, record
from .settings import Settings

VENDOR = "nvidia.com"
GPU_RESOURCE = f"{VENDOR}/gpu"
REPLICA_SEPARATOR = "::"
MAX_ID = 63                     # Device.ID's limit in the API
_PROFILE = re.compile(r"MIG ([0-9A-Za-z][0-9A-Za-z.+_-]{0,40})\Z")   # \Z: "$" also matches before a final "\n"


@record
class Unit:
    """What a container can be given: a whole GPU, or one MIG device of it."""

    gpu: Gpu
    mig: MigDevice | None = None

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid

    @property
    def index(self) -> str:
        """The device token by index: ``0``, or ``0:1`` for a MIG device."""
        return f"{self.gpu.index}:{self.mig.index}" if self.mig else str(self.gpu.index)

    def token(self, id_strategy: str) -> str:
        """How NVIDIA_VISIBLE_DEVICES, a volume mount and a CDI name say this unit."""
        return self.uuid if id_strategy == "uuid" else self.index


@record
class Advertised:
    id: str
    unit: Unit
    replica: int | None = None      # k of <id>::<k>
    numa: int | None = None


@record
class Resource:
    name: str                        # nvidia.com/gpu, nvidia.com/mig-1g.10gb, ...
    devices: tuple[Advertised, ...]
    by_id: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        self.by_id.update((d.id, d) for d in self.devices)

    @property
    def socket(self) -> str:
        """Our socket's file name in the kubelet's directory (not NVIDIA's nvidia-*.sock, so the
        two plugins never remove each other's)."""
        return f"nvcontainer-{self.name.partition('/')[2]}.sock"


def mig_profile(mig: MigDevice) -> str:
    """``1g.10gb`` from NVML's ``NVIDIA A100-SXM4-80GB MIG 1g.10gb``; '' when the name has none."""
    match = _PROFILE.search(mig.name)
    return match.group(1) if match else ""


def resource_name(profile: str) -> str:
    """``nvidia.com/mig-<profile>``; characters a resource name cannot hold become '.'."""
    return f"{VENDOR}/mig-" + re.sub(r"[^a-z0-9.-]", ".", profile.lower())


def advertise(inv: Inventory, settings: Settings, allow=None, numa: dict | None = None) -> tuple[Resource, ...]:
    """Every resource this node offers under ``settings``, ``nvidia.com/gpu`` first (always
    there, possibly empty, so the kubelet sees 0 rather than a stale count)."""
    numa = numa or {}
    gpus = [g for g in inv.gpus if allow is None or allow.touches(g)]
    whole = [g for g in gpus if allow is None or allow.permits(g)]
    migs = [(g, m) for g in gpus for m in g.migs if allow is None or allow.permits(g, m)]
    groups: dict[str, list[Unit]] = {GPU_RESOURCE: []}
    strategy = settings.mig_strategy
    if strategy == "none":
        groups[GPU_RESOURCE] = [Unit(g) for g in whole]
    elif strategy == "single":
        groups[GPU_RESOURCE] = _single(gpus, whole, migs)
    else:
        groups[GPU_RESOURCE] = [Unit(g) for g in whole if not g.mig_enabled]
        for g, m in migs:
            profile = _profile_of(m)
            groups.setdefault(resource_name(profile), []).append(Unit(g, m))
    out = []
    for name, units in groups.items():
        if settings.replicas > 1 and settings.rename_shared:
            name += ".shared"
        out.append(Resource(name, tuple(_advertised(units, settings, numa))))
    return tuple(out)


def _single(gpus: list[Gpu], whole: list[Gpu], migs: list[tuple[Gpu, MigDevice]]) -> list[Unit]:
    enabled = [g for g in gpus if g.mig_enabled]
    if not enabled:
        return [Unit(g) for g in whole]
    disabled = [g for g in gpus if not g.mig_enabled]
    if disabled:
        raise NvcError("device", "mig-strategy single: MIG is enabled on GPU "
                                 f"{', '.join(str(g.index) for g in enabled)} but not on GPU "
                                 f"{', '.join(str(g.index) for g in disabled)}; use mig-strategy mixed")
    profiles = sorted({_profile_of(m) for _, m in migs})
    if len(profiles) > 1:
        raise NvcError("device", f"mig-strategy single: more than one MIG profile on this node "
                                 f"({', '.join(escape(p, 40) for p in profiles)}); use mig-strategy mixed")
    return [Unit(g, m) for g, m in migs]


def _profile_of(mig: MigDevice) -> str:
    profile = mig_profile(mig)
    if not profile:
        raise NvcError("device", f"MIG device {escape(mig.uuid, 80)}: NVML names it "
                                 f"'{escape(mig.name, 80)}', with no profile to advertise it by")
    return profile


def _advertised(units: list[Unit], settings: Settings, numa: dict):
    for unit in units:
        base = unit.token(settings.device_id_strategy)
        where = numa.get(unit.gpu.index)
        if settings.replicas == 1:
            yield Advertised(_checked_id(base), unit, None, where)
            continue
        for k in range(settings.replicas):
            yield Advertised(_checked_id(f"{base}{REPLICA_SEPARATOR}{k}"), unit, k, where)


def _checked_id(device_id: str) -> str:
    if len(device_id) > MAX_ID:
        raise NvcError("device", f"device ID {escape(device_id, 80)} is longer than {MAX_ID} characters")
    return device_id
