"""Request + inventory + container facts → the plan. Pure: no I/O, no clock, no randomness.

The order of the plan is the order of application (REFERENCE §1.4, step 6): procfs, the
graphics application profile, binaries, libraries, graphics and display files, firmware, IPC,
device nodes, symlinks, files, then the linker cache. Every device node in the plan gets exactly one cgroup rule, and
nothing else does.
"""

from __future__ import annotations

import os

from ..records import record
from ..request import require
from . import volume
from ..errors import NvcError, escape
from ..inventory.model import DeviceNode, DriverFile, Gpu, Inventory
from ..request.decide import Request
from ..request.selection import Selection, allow_list, select
from .container import COMPAT_DIR, ContainerFacts, forward_compat
from .model import (DEVICE_OPTIONS, IPC_OPTIONS, LIBRARY_OPTIONS, PROC_OPTIONS, Device, File, Ldconfig, Mount,
                    Plan, Symlink, Tmpfs)

PROC_DRIVER = "/proc/driver/nvidia"
APP_PROFILE_DIR = "/etc/nvidia/nvidia-application-profiles-rc.d"
COMPAT_DROP_IN = "/etc/ld.so.conf.d/00-nvcontainer-cuda-compat.conf"
IMEX_DIR = "/dev/nvidia-caps-imex-channels"


@record
class HostProc:
    """The host's ``/proc/driver/nvidia`` files the container gets copies or binds of."""

    version: str | None = None
    params: str | None = None
    registry: str | None = None
    gpu_dirs: tuple[str, ...] = ()


@record
class PlanOptions:
    no_cgroups: bool = False
    no_devbind: bool = False
    no_persistenced: bool = False
    no_fabricmanager: bool = False
    no_gsp_firmware: bool = False
    ldconfig: str = "@/sbin/ldconfig"
    cuda_compat_mode: str = "ldconfig"
    allowed_devices: tuple[str, ...] | None = None   # config allowed-devices; None: every device
    driver_volume_dir: str = "/var/lib/nvcontainer/volumes"   # config driver-volume-dir


def build_plan(
    request: Request,
    inv: Inventory,
    container: ContainerFacts,
    hostproc: HostProc,
    options: PlanOptions = PlanOptions(),
    *,
    rootfs: str,
    pid: int | None = None,
    owner: tuple[int, int] = (0, 0),
) -> Plan:
    if not request.gpu:
        return Plan(gpu=False, rootfs=rootfs, pid=pid)
    sel, warnings = _selection(request, inv, options.allowed_devices)
    require.evaluate(
        request.requirements, inv.cuda_version, inv.driver_version,
        [(g.arch, g.brand, f"{g.index} ({g.uuid})") for g in sel.gpus],
    )
    caps = set(request.capabilities)
    libgroups = request.library_groups
    host = _Host(inv.root)
    mig_all = bool(request.mig_config or request.mig_monitor)

    mounts: list[Mount] = []
    devices: list[Device] = []
    extra_rules: list[str] = []
    tmpfs = [_proc_tmpfs(hostproc, sel, mig_all)]
    mounts += _proc_binds(hostproc, sel, mig_all)
    if "graphics" in libgroups:
        tmpfs.append(_app_profile(sel.gpus))

    libs = [lib for lib in inv.libraries if lib.group in libgroups]
    libs32 = [lib for lib in inv.libraries32 if lib.group in libgroups] if "compat32" in caps else []
    if request.driver_volume:
        # a legacy image: the operator's consolidated volume as one directory, links included
        lib_dirs = [f"{volume.CONTAINER_PATH}/lib64"] + ([f"{volume.CONTAINER_PATH}/lib"] if libs32 else [])
        libs, libs32 = [], []
        source = os.path.join(options.driver_volume_dir, volume.PREFIX + inv.driver_version)
        mounts.append(Mount(source, volume.CONTAINER_PATH, LIBRARY_OPTIONS, kind="dir"))
    else:
        lib_dirs = [container.libs_dir] + ([container.libs32_dir] if libs32 else [])
    mounts += [Mount(host(b.path), f"/usr/bin/{os.path.basename(b.path)}", LIBRARY_OPTIONS)
               for b in inv.binaries if b.group in request.binary_groups and not request.driver_volume]
    mounts += [Mount(host(lib.path), f"{container.libs_dir}/{os.path.basename(lib.path)}", LIBRARY_OPTIONS)
               for lib in libs]
    mounts += [Mount(host(lib.path), f"{container.libs32_dir}/{os.path.basename(lib.path)}", LIBRARY_OPTIONS)
               for lib in libs32]
    # a legacy image's driver volume stands for every driver file: these too (its devices stay)
    gfx = [f for f in inv.graphics if not request.driver_volume
           and (f.group in libgroups or (f.group == "display" and "display" in caps))]
    gfx_libs = [f for f in gfx if f.kind == "library"]
    gfx_files = [f for f in gfx if f.kind != "library"]
    mounts += [Mount(host(f.path), f"{container.libs_dir}/{os.path.basename(f.path)}", LIBRARY_OPTIONS)
               for f in gfx_libs]
    mounts += [Mount(host(f.path), f.name, LIBRARY_OPTIONS) for f in gfx_files]   # where loaders look
    if not options.no_gsp_firmware:
        mounts += [Mount(host(f.path), f.path, LIBRARY_OPTIONS) for f in inv.firmwares]
    mounts += [Mount(host(i.path), i.path, IPC_OPTIONS, kind=i.kind or "socket")
               for i in inv.ipcs if _ipc_wanted(i, request, options)]

    for node in inv.ctl_devices:
        if _ctl_wanted(node, inv, libgroups, caps):
            devices.append(_device(host, node))
    devices += [_device(host, g.node) for g in sel.gpus]
    dri = [(g, node) for g in sel.whole_gpus() for node in g.dri] if "graphics" in libgroups else []
    devices += [_device(host, node) for _, node in dri]
    if mig_all:
        mounts += _mig_control(request, inv, sel, host, extra_rules)
    else:
        for mig in sel.migs:
            for cap in (mig.gi_cap, mig.ci_cap):
                if cap is not None:
                    devices.append(_device(host, cap))
    devices += _imex(request, inv, host)

    symlinks = _symlinks(libs, container.libs_dir, libgroups, inv.driver_version)
    symlinks += _symlinks(libs32, container.libs32_dir, frozenset(), inv.driver_version)
    symlinks += _symlinks(gfx_libs, container.libs_dir, frozenset(), inv.driver_version)
    symlinks += [Symlink(f"{os.path.dirname(f.name)}/{name}", target) for f in gfx_files for name, target in f.links]
    symlinks += [_by_path(g, node) for g, node in dri]
    files, compat_dirs = _compat(container, inv.driver_version, options.cuda_compat_mode, "compute" in libgroups)

    ld_dirs = [*compat_dirs, *lib_dirs]
    rules = list(dict.fromkeys([d.rule for d in devices] + extra_rules))
    return Plan(
        gpu=True,
        rootfs=rootfs,
        pid=pid,
        tmpfs=tuple(tmpfs),
        mounts=tuple(mounts),
        devices=tuple(devices),
        symlinks=tuple(symlinks),
        files=tuple(files),
        cgroup_rules=tuple(rules),
        ldconfig=Ldconfig(options.ldconfig, tuple(dict.fromkeys(ld_dirs))),
        devbind=not options.no_devbind,
        cgroups=not options.no_cgroups,
        owner=owner,
        warnings=request.warnings + warnings,
    )


class _Host:
    """Driver-root-relative path → host path."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")

    def __call__(self, path: str) -> str:
        return self.root + path


def _selection(request: Request, inv: Inventory, allowed: tuple[str, ...] | None) -> tuple[Selection, tuple[str, ...]]:
    tokens = ["all"] if request.devices == "all" else list(request.devices)
    allow = allow_list(inv, allowed)
    sel = select(inv, tokens, allow)
    if (request.mig_config or request.mig_monitor) and sel.migs and not sel.all:
        which = "mig-config" if request.mig_config else "mig-monitor"
        raise NvcError(which, f"cannot enable {which} with specific MIG devices selected")
    if (request.mig_config or request.mig_monitor) and allow is not None:
        # MIG control reaches every MIG device of a GPU: only for GPUs this node may hand out whole
        partial = [g.index for g in sel.gpus if not allow.permits(g)]
        if partial:
            which = "mig-config" if request.mig_config else "mig-monitor"
            raise NvcError(which, f"GPU {partial[0]}: only some of its MIG devices are allowed on this node "
                                  "(allowed-devices)")
    unknown = allow.unknown if allow is not None else ()
    return sel, tuple(f"allowed-devices: {escape(t)} matches no device on this node" for t in unknown)


def _device(host: _Host, node: DeviceNode) -> Device:
    return Device(node.path, node.major, node.minor, host(node.path))


def _ctl_wanted(node: DeviceNode, inv: Inventory, libgroups, caps) -> bool:
    """nvidiactl always; uvm only with the compute libraries; modeset only for display."""
    name = node.path.rsplit("/", 1)[-1]
    if name.startswith("nvidia-uvm"):
        return "compute" in libgroups
    if name == "nvidia-modeset":
        return "display" in caps
    return True


def _ipc_wanted(ipc: DriverFile, request: Request, options: PlanOptions) -> bool:
    if ipc.name == "persistenced":
        return "utility" in request.capabilities and not options.no_persistenced
    if ipc.name == "fabricmanager":
        return "utility" in request.capabilities and not options.no_fabricmanager
    if ipc.name == "mps":
        return "compute" in request.capabilities
    return False


def gpu_dir(hostproc: HostProc, gpu: Gpu) -> str | None:
    """The ``gpus/<bus>`` name the driver uses: 32-bit domain first, then 16-bit (upstream)."""
    short = gpu.bus_id[4:]
    for name in (gpu.bus_id, short):
        if name in hostproc.gpu_dirs:
            return name
    return None


_MODIFY = r"(?m)^(ModifyDeviceFiles:\s*)\d+\s*$"   # compiled by re on first use
# what nvcontainer serve compiles before it forks (serve/server.py preload), so no request does
PATTERNS = (_MODIFY,)


_PARAM = "ModifyDeviceFiles:"
_OTHER_SPACE = "\r\x0b\x0c\x1c\x1d\x1e\x1f"   # what re's \s matches beside space, tab and newline (ASCII)


def _no_device_files(params: str) -> str:
    """``re.sub(_MODIFY, r"\\g<1>0", params)``; without re (its import costs every start
    milliseconds) for the driver's own layout: ASCII, one ``ModifyDeviceFiles: N`` per line,
    each followed by the end or a line that starts with neither a blank nor whitespace (where
    the pattern's whitespace cannot reach into the next line). Anything else goes to re."""
    if params.isascii() and not any(c in params for c in _OTHER_SPACE):
        lines = params.split("\n")
        for i, line in enumerate(lines):
            if not line.startswith(_PARAM):
                continue
            digits = line[len(_PARAM):].lstrip(" \t")
            after = lines[i + 1][:1] if i + 1 < len(lines) else "end"
            if not digits.isdigit() or after in ("", " ", "\t"):
                break
            lines[i] = line[:len(line) - len(digits)] + "0"
        else:
            return "\n".join(lines)
    import re

    return re.sub(_MODIFY, r"\g<1>0", params)


def _proc_tmpfs(hostproc: HostProc, sel: Selection, mig_all: bool) -> Tmpfs:
    """A private ``/proc/driver/nvidia``: copies, with ``ModifyDeviceFiles: 0`` so NVML inside
    the container never re-creates device nodes, and mount points for what gets bound in."""
    files = []
    if hostproc.params is not None:
        files.append(File(f"{PROC_DRIVER}/params", _no_device_files(hostproc.params)))
    if hostproc.version is not None:
        files.append(File(f"{PROC_DRIVER}/version", hostproc.version))
    if hostproc.registry is not None:
        files.append(File(f"{PROC_DRIVER}/registry", hostproc.registry))
    dirs = ["gpus"] + [f"gpus/{d}" for d in (gpu_dir(hostproc, g) for g in sel.gpus) if d]
    if mig_all:
        dirs.append("capabilities")
    elif sel.migs:
        for mig in sel.migs:
            for access in (mig.gi_access, mig.ci_access):
                rel = access[len(PROC_DRIVER) + 1:]
                parent = rel.rsplit("/", 1)[0]
                parts = parent.split("/")
                dirs += ["/".join(parts[: i + 1]) for i in range(len(parts))]
                files.append(File(access, ""))
    return Tmpfs(PROC_DRIVER, tuple(files), tuple(dict.fromkeys(dirs)))


def _proc_binds(hostproc: HostProc, sel: Selection, mig_all: bool) -> list[Mount]:
    mounts = []
    for g in sel.gpus:
        name = gpu_dir(hostproc, g)
        if name:
            path = f"{PROC_DRIVER}/gpus/{name}"
            mounts.append(Mount(path, path, PROC_OPTIONS, kind="dir"))
    if not mig_all:
        for mig in sel.migs:
            mounts += [Mount(p, p, PROC_OPTIONS) for p in (mig.gi_access, mig.ci_access)]
    return mounts


def _app_profile(gpus: tuple[Gpu, ...]) -> Tmpfs:
    """The EGL application profile that limits EGL to the container's GPUs (by minor)."""
    mask = 0
    for g in gpus:
        mask |= 1 << g.minor
    content = (
        "{\n"
        '    "profiles": [{"name": "_container_", "settings": ["EGLVisibleDGPUDevices", '
        f"0x{mask:x}]}}],\n"
        '    "rules": [{"pattern": [], "profile": "_container_"}]\n'
        "}\n"
    )
    return Tmpfs(APP_PROFILE_DIR, (File(f"{APP_PROFILE_DIR}/10-container.conf", content),))


def _mig_control(request: Request, inv: Inventory, sel: Selection, host: _Host, rules: list[str]) -> list[Mount]:
    """mig-config / mig-monitor = all: the capabilities tree, /dev/nvidia-caps, every MIG minor.

    As upstream: the whole /dev/nvidia-caps directory is bound, and the config (minor 1) and
    monitor (minor 2) nodes are allowed in the cgroup, not bound once more on top of it; the
    directory already holds them (docs/plan.md says why nothing needs the extra binds)."""
    mounts = [Mount("/proc/driver/nvidia/capabilities", "/proc/driver/nvidia/capabilities", PROC_OPTIONS, kind="dir")]
    if inv.caps_major is None:
        raise NvcError("mig-config" if request.mig_config else "mig-monitor",
                       "nvidia-caps is not in /proc/devices: no MIG capability devices on this host")
    mounts.append(Mount(host("/dev/nvidia-caps"), "/dev/nvidia-caps", ("nosuid", "noexec"), kind="dir"))
    for wanted, cap in ((request.mig_config, inv.mig.config_cap), (request.mig_monitor, inv.mig.monitor_cap)):
        if wanted and cap is not None:
            rules.append(cap.rule)
    for g in sel.gpus:
        if not g.mig_capable:
            continue
        prefix = f"gpu{g.minor}/"
        rules += [f"c {inv.caps_major}:{minor} rw" for name, minor in inv.mig_minors if name.startswith(prefix)]
    return mounts


def _by_path(gpu: Gpu, node: DeviceNode) -> Symlink:
    """udev's ``/dev/dri/by-path`` name of a DRI node, which some Vulkan and Wayland code opens:
    ``pci-0000:07:00.0-card -> ../card1``, ``pci-0000:07:00.0-render -> ../renderD129``."""
    name = os.path.basename(node.path)
    kind = "card" if name.startswith("card") else "render"
    return Symlink(f"/dev/dri/by-path/pci-{gpu.bus_id[4:]}-{kind}", f"../{name}")


def _imex(request: Request, inv: Inventory, host: _Host) -> list[Device]:
    if not request.imex_channels:
        return []
    if inv.imex_major is None:
        raise NvcError("device", "IMEX channels requested, but nvidia-caps-imex-channels is not in /proc/devices")
    return [Device(f"{IMEX_DIR}/channel{c}", inv.imex_major, c, host(f"{IMEX_DIR}/channel{c}"))
            for c in request.imex_channels]


def _symlinks(libs: list[DriverFile], directory: str, libgroups, version: str) -> list[Symlink]:
    """The host's SONAME and ``.so`` links of each injected library, plus upstream's three.

    Link targets are names in the same directory, whatever form the host link had, so they are
    right wherever the container keeps its libraries.
    """
    out: dict[str, Symlink] = {}
    names = {lib.name: lib for lib in libs}
    for lib in libs:
        for name, target in lib.links:
            link = f"{directory}/{name}"
            out.setdefault(link, Symlink(link, os.path.basename(target)))
    extras = []
    if "compute" in libgroups and "libcuda.so" in names:
        extras.append(("libcuda.so", "libcuda.so.1"))
    if "graphics" in libgroups and "libGLX_nvidia.so" in names:
        extras.append(("libGLX_indirect.so.0", os.path.basename(names["libGLX_nvidia.so"].path)))
    if "video" in libgroups and "libnvidia-opticalflow.so" in names:
        extras.append(("libnvidia-opticalflow.so", "libnvidia-opticalflow.so.1"))
    for name, target in extras:
        link = f"{directory}/{name}"
        out.setdefault(link, Symlink(link, target))
    return list(out.values())


def _compat(container: ContainerFacts, version: str, mode: str, compute: bool) -> tuple[list[File], list[str]]:
    """CUDA forward compatibility without mounting anything from the image.

    Only a compat libcuda whose major is newer than the host driver's is worth using (older or
    equal ones give CUDA errors 803/804); then the container's own loader is pointed at the
    image's compat directory by an ld.so.conf.d drop-in, and ldconfig scans it first.
    """
    if mode == "disabled" or not compute or not forward_compat(container.compat, version):
        return [], []
    return [File(COMPAT_DROP_IN, COMPAT_DIR + "\n", 0o644)], [COMPAT_DIR]
