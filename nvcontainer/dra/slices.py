"""The inventory → this node's ResourceSlices, with NVIDIA's attribute names and formats. Pure.

Why NVIDIA's names: a ResourceClaim's CEL selectors and a DeviceClass's are written against a
driver's attribute names (``device.attributes["gpu.nvidia.com"].productName``,
``device.capacity["gpu.nvidia.com"].memory``); a claim written for NVIDIA's k8s-dra-driver-gpu
must select the same devices here. Its attributes changed over releases (25.3 had ``index``,
``minor``, ``pcieBusID``; 25.8 dropped ``index`` and ``minor``; 25.12 moved the bus id to the
standard ``resource.kubernetes.io/pciBusID``), so a device here carries the union: a selector
written for any of those releases finds what it asks for. Values are in NVIDIA's formats:

* versions (``cudaComputeCapability``, ``driverVersion``, ``cudaDriverVersion``) as strict
  semver: ``8.0`` → ``8.0.0``, CUDA 12.4 → ``12.4.0``, driver ``535.104.05`` → ``535.104.5`` (a
  leading zero is not semver; the API server refuses such a slice);
* ``brand`` and ``architecture`` as go-nvlib names them (``Nvidia``, ``Grid``, ``Ampere``,
  ``Ada Lovelace``): the architecture from the compute capability, as NVML's architecture maps;
* the PCI bus id lower case with a 4-digit domain (``0000:07:00.0``);
* ``memory`` capacity in bytes as Kubernetes writes a binary quantity (``80Gi``, ``81559Mi``);
* MIG devices: ``type`` ``mig``, ``uuid``, ``parentUUID``, ``profile`` (``1g.10gb``), the
  parent's product attributes; capacities ``multiprocessors``, ``copyEngines``, ``decoders``,
  ``encoders``, ``jpegEngines``, ``ofaEngines`` (what NVML says the MIG device has), ``memory``,
  and one ``memorySlice<i>`` per memory slice of its placement (how NVIDIA shows placement).

Where we differ, and why (docs/engines/kubernetes-dra.md has the table): no ``addressingMode``;
the MIG devices are the ones that exist (NVIDIA's dynamic MIG, partitions created on demand, is
not done here).

An unhealthy device (the device plugin's health rules, ``health/rules.py``) is withdrawn
from the slice by default; with ``taint`` it stays, carrying NVIDIA's taint keys
(``gpu.nvidia.com/xid`` with the XID, ``gpu.nvidia.com/gpu-lost``,
``gpu.nvidia.com/unmonitored``), for clusters with device taints enabled.
"""

from __future__ import annotations

import re

from ..inventory.model import Gpu, Inventory, MigDevice
from .names import DRIVER, TYPE_GPU, TYPE_MIG, Named, devices

MAX_DEVICES = 128                   # ResourceSliceMaxDevices
STANDARD = "resource.kubernetes.io"
GO_NVLIB_BRANDS = {"GRID": "Grid", "TITAN": "Titan", "VApps": "NvidiaVApps", "VPC": "NvidiaVPC",
                   "VCS": "NvidiaVCS", "VWS": "NvidiaVWS", "CloudGaming": "NvidiaCloudGaming"}
_ARCH_BY_CC = (("3.", "Kepler"), ("5.", "Maxwell"), ("6.", "Pascal"), ("7.0", "Volta"), ("7.2", "Volta"),
               ("7.5", "Turing"), ("8.9", "Ada Lovelace"), ("8.", "Ampere"), ("9.", "Hopper"),
               ("10.", "Blackwell"), ("11.", "Blackwell"), ("12.", "Blackwell"))
TAINT_XID = f"{DRIVER}/xid"
TAINT_LOST = f"{DRIVER}/gpu-lost"
TAINT_UNMONITORED = f"{DRIVER}/unmonitored"
_BINARY = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def semver(text: str) -> str:
    """A dotted version as strict semver: missing parts are 0, leading zeros dropped, parts past
    the third kept as build metadata. ``""`` when ``text`` has no leading number."""
    parts = text.strip().split(".")
    if not parts or not all(p.isdigit() and p.isascii() for p in parts):
        return ""
    numbers = [str(int(p)) for p in parts[:3]] + ["0"] * (3 - min(len(parts), 3))
    extra = ".".join(str(int(p)) for p in parts[3:])
    return ".".join(numbers) + (f"+{extra}" if extra else "")


def binary_quantity(value: int) -> str:
    """Bytes as Kubernetes writes a binary-SI quantity: the largest power of 1024 that divides."""
    for suffix, shift in _BINARY:
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


def architecture(cc: str) -> str:
    for prefix, name in _ARCH_BY_CC:
        if cc == prefix or cc.startswith(prefix) and prefix.endswith("."):
            return name
    return "Unknown"


def bus_id(gpu: Gpu) -> str:
    """``00000000:07:00.0`` → ``0000:07:00.0``."""
    domain, _, rest = gpu.bus_id.lower().partition(":")
    return f"{int(domain, 16) & 0xFFFF:04x}:{rest}"


def _string(value: str) -> dict:
    return {"string": value[:64]}


def _common(inv: Inventory, gpu: Gpu, roots: dict) -> dict:
    attrs = {
        "productName": _string(gpu.model),
        "brand": _string(GO_NVLIB_BRANDS.get(gpu.brand, gpu.brand)),
        "architecture": _string(architecture(gpu.arch)),
        "pcieBusID": _string(bus_id(gpu)),
        f"{STANDARD}/pciBusID": _string(bus_id(gpu)),
    }
    for name, text in (("cudaComputeCapability", gpu.arch), ("driverVersion", inv.driver_version),
                       ("cudaDriverVersion", inv.cuda_version)):
        version = semver(text)
        if version:
            attrs[name] = {"version": version}
    root = roots.get(gpu.bus_id)
    if root:
        attrs[f"{STANDARD}/pcieRoot"] = _string(root)
    return attrs


def gpu_device(inv: Inventory, gpu: Gpu, name: str, roots: dict) -> dict:
    attrs = {"type": _string(TYPE_GPU), "uuid": _string(gpu.uuid), "minor": {"int": gpu.minor},
             "index": {"int": gpu.index}, **_common(inv, gpu, roots)}
    device = {"name": name, "attributes": attrs}
    if gpu.memory:
        device["capacity"] = {"memory": {"value": binary_quantity(gpu.memory)}}
    return device


def mig_device(inv: Inventory, gpu: Gpu, mig: MigDevice, name: str, roots: dict) -> dict:
    attrs = {"type": _string(TYPE_MIG), "uuid": _string(mig.uuid), "parentUUID": _string(gpu.uuid),
             "profile": _string(mig.profile), "index": {"int": mig.index}, "parentIndex": {"int": gpu.index},
             **_common(inv, gpu, roots)}
    capacity = {name: {"value": str(value)} for name, value in (
        ("multiprocessors", mig.multiprocessors), ("copyEngines", mig.copy_engines), ("decoders", mig.decoders),
        ("encoders", mig.encoders), ("jpegEngines", mig.jpeg_engines), ("ofaEngines", mig.ofa_engines)) if value >= 0}
    if mig.memory:
        capacity["memory"] = {"value": binary_quantity(mig.memory)}
    for i in range(mig.placement_start, mig.placement_start + mig.placement_size):
        capacity[f"memorySlice{i}"] = {"value": "1"}
    device = {"name": name, "attributes": attrs}
    if capacity:
        device["capacity"] = capacity
    return device


def taint_for(why: str) -> dict:
    """NVIDIA's taint for a health verdict (``health.bad_units``' reasons)."""
    match = re.fullmatch(r"XID (\d+)", why)
    if match:
        return {"key": TAINT_XID, "value": match[1], "effect": "NoSchedule"}
    if why == "GPU is lost":
        return {"key": TAINT_LOST, "effect": "NoSchedule"}
    return {"key": TAINT_UNMONITORED, "effect": "NoSchedule"}


def offered(inv: Inventory, allow=None) -> tuple[Named, ...]:
    """The devices this node offers: the names' devices the node's ``allowed-devices`` permits."""
    return tuple(n for n in devices(inv) if allow is None or allow.permits(n.gpu, n.mig))


def build(inv: Inventory, node: str, *, allow=None, unhealthy: dict | None = None, roots: dict | None = None,
          generation: int = 1, taint: bool = False) -> list[dict]:
    """This node's slices (v1 shape; kubeapi writes them in the version the server serves).

    ``allow``: a ``request.selection.AllowList`` or None; ``unhealthy``: {UUID: why};
    ``roots``: {inventory bus id: PCIe root, ``pci0000:00``}; ``generation``: the pool's."""
    unhealthy, roots = unhealthy or {}, roots or {}
    out = []
    for named in offered(inv, allow):
        why = unhealthy.get(named.uuid)
        if why and not taint:
            continue
        if named.mig is None:
            device = gpu_device(inv, named.gpu, named.name, roots)
        else:
            device = mig_device(inv, named.gpu, named.mig, named.name, roots)
        if why:
            device["taints"] = [taint_for(why)]
        out.append(device)
    chunks = [out[i:i + MAX_DEVICES] for i in range(0, len(out), MAX_DEVICES)] or [[]]
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": slice_name(node, i)},
             "spec": {"driver": DRIVER, "nodeName": node,
                      "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
                      "devices": chunk}}
            for i, chunk in enumerate(chunks)]


def slice_name(node: str, i: int) -> str:
    """``<node>-gpu.nvidia.com-<i>`` (a DNS subdomain: node names are; cut to 253)."""
    suffix = f"-{DRIVER}-{i}"
    return node[:253 - len(suffix)].rstrip(".-") + suffix


def pcie_root(link_target: str) -> str:
    """The root complex in a sysfs PCI device link's target (``../../../devices/pci0000:00/
    0000:00:01.0/0000:07:00.0`` → ``pci0000:00``), as Kubernetes' standard attribute names it."""
    for part in link_target.split("/"):
        if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", part):
            return part
    return ""
