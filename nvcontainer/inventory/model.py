"""What the host's driver offers, as plain immutable data.

One :class:`Inventory` feeds ``info``, ``list``, the plan builder, the hook and CDI. It holds
facts only (no policy): which capability a library belongs to is recorded, whether a container
gets it is decided later by the plan. Paths are as seen *inside* the driver root (``--root``),
so the same inventory describes where a file lives on the host and where it lands in the
container. Everything here converts to and from JSON-able dicts so it can be cached.
"""

from __future__ import annotations

import os

from ..records import asdict, field, fields, record

NVIDIA_MAJOR = 195
CTL_MINOR = 255
MODESET_MINOR = 254


@record
class DeviceNode:
    path: str   # e.g. /dev/nvidia0, the same inside the root and inside the container
    major: int
    minor: int

    @property
    def rule(self) -> str:
        return f"c {self.major}:{self.minor} rw"


@record
class MigDevice:
    parent: int          # index of the parent GPU
    index: int           # j in the "i:j" token
    uuid: str            # MIG-... as NVML reports it
    gi: int              # GPU instance id
    ci: int              # compute instance id
    gi_access: str       # /proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access
    ci_access: str       # .../gi<G>/ci<C>/access
    gi_cap: DeviceNode | None = None   # /dev/nvidia-caps/nvidia-capN behind gi_access
    ci_cap: DeviceNode | None = None
    name: str = ""       # as NVML names it: "<GPU model> MIG <profile>" (the device plugin's resource)
    memory: int = 0      # bytes of its GPU instance (nvmlDeviceGetMemoryInfo); 0: not known
    profile_id: int = -1           # GPU instance profile id (nvmlGpuInstanceGetInfo); -1: not known
    placement_start: int = -1      # first memory slice of its GPU instance; -1: not known
    placement_size: int = 0        # memory slices it spans
    # its engines (nvmlDeviceGetAttributes on the MIG device); -1: not known
    multiprocessors: int = -1
    copy_engines: int = -1
    decoders: int = -1
    encoders: int = -1
    jpeg_engines: int = -1
    ofa_engines: int = -1

    @property
    def profile(self) -> str:
        """The profile as nvidia-smi and NVML's name write it: ``1g.10gb``, ``1g.10gb+me``."""
        return self.name.rpartition(" MIG ")[2] if " MIG " in self.name else ""
    # NVML's nvmlDeviceGetAttributes, by field: memory_mb, multiprocessors, slices_gi, slices_ci,
    # copy_engines, decoders, encoders, jpegs, ofas (node labels); empty where NVML gave none
    attributes: tuple[tuple[str, int], ...] = ()


@record
class Gpu:
    index: int
    minor: int
    model: str
    brand: str
    uuid: str
    bus_id: str          # %08x:%02x:%02x.0
    arch: str            # compute capability "major.minor"
    mig_capable: bool = False
    mig_enabled: bool = False
    migs: tuple[MigDevice, ...] = ()
    dri: tuple[DeviceNode, ...] = ()   # /dev/dri/card*, renderD* of its PCI device (graphics, display)
    memory: int = 0      # bytes of framebuffer memory (nvmlDeviceGetMemoryInfo total); 0: not known

    @property
    def node(self) -> DeviceNode:
        return DeviceNode(f"/dev/nvidia{self.minor}", NVIDIA_MAJOR, self.minor)


@record
class DriverFile:
    """A file of the driver: a library, a binary, an IPC endpoint or a firmware blob.

    ``path`` is the real file (symlinks resolved inside the root). ``links`` are the symlinks
    the host keeps next to it that lead to it (SONAME and ``.so`` development links), as
    ``(link name, link target)`` pairs, so a container can be given the same ones.
    """

    path: str
    group: str = ""          # capability group: utility, compute, video, graphics, ngx, display
    name: str = ""           # the prefix or name that found it (libcuda.so, nvidia-smi, ...)
    soname: str = ""
    links: tuple[tuple[str, str], ...] = ()
    kind: str = ""           # IPC: "socket" or "dir"; graphics: "config", "module" (at ``name``) or "library"


@record
class MigControl:
    """Files and nodes that the mig-config / mig-monitor options expose."""

    config: str = ""                  # /proc/driver/nvidia/capabilities/mig/config
    monitor: str = ""
    config_cap: DeviceNode | None = None
    monitor_cap: DeviceNode | None = None


@record
class Inventory:
    root: str
    driver_version: str
    cuda_version: str
    gpus: tuple[Gpu, ...] = ()
    ctl_devices: tuple[DeviceNode, ...] = ()   # nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset
    caps_major: int | None = None
    imex_major: int | None = None
    mig: MigControl = field(default_factory=MigControl)
    mig_minors: tuple[tuple[str, int], ...] = ()   # lines of /proc/driver/nvidia-caps/mig-minors
    libraries: tuple[DriverFile, ...] = ()
    libraries32: tuple[DriverFile, ...] = ()
    binaries: tuple[DriverFile, ...] = ()
    ipcs: tuple[DriverFile, ...] = ()
    firmwares: tuple[DriverFile, ...] = ()
    # Vulkan/EGL configuration, EGL platform libraries, Xorg modules (graphics.py): not upstream's list
    graphics: tuple[DriverFile, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Inventory":
        return _build(cls, data)


NVML = "libnvidia-ml.so"   # the catalog's name (DriverFile.name) of NVML's library


def nvml_path(inventory: Inventory) -> str | None:
    """The host path of the NVML library the inventory chose (the running driver's version), for
    the programs that load it themselves (``ps``, the health watcher); None when it has none."""
    for lib in inventory.libraries:
        if lib.name == NVML:
            return os.path.join(inventory.root, lib.path.lstrip("/"))
    return None


def _build(cls, data):
    """Inverse of ``asdict`` for this module's dataclasses (tuples and nested nodes restored)."""
    kwargs = {}
    for name, convert in _plan(cls):
        if name not in data:
            continue
        value = data[name]
        kwargs[name] = value if convert is None or value is None else convert(value)
    return cls(**kwargs)


_TYPES = {c.__name__: c for c in (DeviceNode, MigDevice, Gpu, DriverFile, MigControl)}
_PLANS: dict = {}


def _plan(cls) -> list:
    """(field name, converter or None) of ``cls``: its annotations read once per class, not
    once per value (a cache entry holds hundreds of values, read on every container start)."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = [(f.name, _converter(f.type)) for f in fields(cls)]
    return plan


def _converter(annotation: str):
    """What turns a (non-null) JSON value back into a value of this annotation; None: as it is."""
    ann = annotation.replace(" ", "")
    for name, cls in _TYPES.items():
        if ann in (name, f"{name}|None"):
            return lambda value, cls=cls: _build(cls, value)
        if ann == f"tuple[{name},...]":
            return lambda value, cls=cls: tuple(_build(cls, v) for v in value)
    if ann.startswith("tuple[tuple["):
        return lambda value: tuple(tuple(v) for v in value)
    return None
