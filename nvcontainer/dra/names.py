"""The names a DRA claim uses for this node's devices, to and from the one inventory. Pure.

Why a module of its own: a ResourceClaim's allocation names devices by the names our
ResourceSlices published, and the kubelet later asks us to prepare exactly those names. If the
slice writer and the prepare path each derived names on their own, a rename on one side would
make claims allocate devices the node then cannot find. So both go through :func:`devices` and
:func:`lookup` here, over the same :class:`~nvcontainer.inventory.model.Inventory`.

The names are NVIDIA's ``k8s-dra-driver-gpu`` names (claims written for it work unchanged):

* driver ``gpu.nvidia.com``;
* a full GPU: ``gpu-<minor>`` (the ``/dev/nvidia<minor>`` number, not the NVML index, which
  changes with ``CUDA_VISIBLE_DEVICES``-like reorderings and across boots);
* a MIG device (releases 25.12 and later): ``gpu-<parent minor>-mig-<profile>-<GI profile
  id>-<placement start>``, the profile written without dots and lower-cased to RFC 1123
  (``1g.10gb`` → ``1g10gb``, ``1g.10gb+me`` → ``1g10gb-me``). Earlier releases (25.3, 25.8) used
  ``gpu-<minor>-mig-<GI profile id>-<placement start>-<placement size>``; :func:`parse` accepts
  both so a claim allocated under either still finds its device.

As NVIDIA's driver does, a GPU in MIG mode is offered only through its MIG devices: the whole
GPU is not a device of its own then.
"""

from __future__ import annotations

import re

from ..errors import NvcError, escape
from ..inventory.model import Gpu, Inventory, MigDevice
from ..records import record

DRIVER = "gpu.nvidia.com"
GPU_CLASS = "gpu.nvidia.com"
MIG_CLASS = "mig.nvidia.com"
TYPE_GPU = "gpu"
TYPE_MIG = "mig"

_MIG_NAME = re.compile(r"gpu-([0-9]+)-mig-(.+)-([0-9]+)-([0-9]+)")   # [0-9]: \d is any script's digit
_GPU_NAME = re.compile(r"gpu-([0-9]+)")
_NOT_DNS = re.compile(r"[^a-z0-9-.]")


@record
class Named:
    """One device as DRA names it: the GPU, and the MIG device when it is one."""

    name: str
    gpu: Gpu
    mig: MigDevice | None = None

    @property
    def kind(self) -> str:
        return TYPE_MIG if self.mig is not None else TYPE_GPU

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig is not None else self.gpu.uuid


def gpu_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.minor}"


def profile_label(profile: str) -> str:
    """A MIG profile as it appears inside a device name (NVIDIA's toRFC1123Compliant of the
    profile without its dots)."""
    label = _NOT_DNS.sub("-", profile.replace(".", "").lower()).strip("-")
    return label.removesuffix(".")


def mig_name(gpu: Gpu, mig: MigDevice) -> str:
    if mig.profile_id < 0 or mig.placement_start < 0 or not mig.profile:
        raise NvcError("device", f"MIG device {escape(mig.uuid)}: its profile and placement are not known "
                                 "(the inventory predates them: nvcontainer info --refresh)")
    return f"gpu-{gpu.minor}-mig-{profile_label(mig.profile)}-{mig.profile_id}-{mig.placement_start}"


def devices(inv: Inventory) -> tuple[Named, ...]:
    """Every device this node offers, in the order slices list them: by GPU minor, a GPU's MIG
    devices by placement."""
    out = []
    for gpu in sorted(inv.gpus, key=lambda g: g.minor):
        if not gpu.mig_enabled:
            out.append(Named(gpu_name(gpu), gpu))
            continue
        for mig in sorted(gpu.migs, key=lambda m: (m.placement_start, m.profile_id, m.gi, m.ci)):
            out.append(Named(mig_name(gpu, mig), gpu, mig))
    return tuple(out)


def parse(name: str) -> tuple[int, int | None, int | None]:
    """``(GPU minor, GI profile id, placement start)`` of a device name, ``None`` twice for a
    full GPU; both MIG forms (see the module's docstring). NvcError naming it otherwise."""
    if len(name) <= 128:
        whole = _GPU_NAME.fullmatch(name)
        if whole:
            return int(whole[1]), None, None
        mig = _MIG_NAME.fullmatch(name)
        if mig:
            minor, middle, a, b = int(mig[1]), mig[2], int(mig[3]), int(mig[4])
            if middle.isascii() and middle.isdigit():                    # 25.3/25.8: <profile id>-<start>-<size>
                return minor, int(middle), a
            return minor, a, b
    raise NvcError("device", f"device name {escape(name, 80)}: not a {DRIVER} device name")


def lookup(inv: Inventory, name: str) -> Named:
    """The inventory's device behind ``name``; NvcError naming it when this node has none."""
    minor, profile_id, start = parse(name)
    for named in devices(inv):
        if named.gpu.minor != minor:
            continue
        if profile_id is None and named.mig is None:
            return named
        if named.mig is not None and (named.mig.profile_id, named.mig.placement_start) == (profile_id, start):
            return named
    raise NvcError("device", f"device {escape(name, 80)}: this node has no such device")


def by_uuid(inv: Inventory) -> dict[str, Named]:
    """Each offered device by its UUID (the health watcher reports UUIDs)."""
    return {named.uuid: named for named in devices(inv)}
