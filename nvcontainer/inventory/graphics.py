"""What graphics and display need beyond the driver's libraries: Vulkan and EGL configuration,
the EGL platform libraries, the Xorg modules, and each GPU's DRI nodes (REFERENCE §2.5, §2.7).

Why a module of its own: nvidia-container-cli never gives a container these (its users get
"no Vulkan ICD", EGL without a device, no ``/dev/dri``: libnvidia-container#55, toolkit#16,
#191, #767); NVIDIA's CDI generator does (toolkit ``internal/discover/graphics.go``), and so do
we, from the same inventory, for the hook, ``configure``, ``list --graphics`` and ``cdi generate``
alike. None of it is in upstream's ``list``, so it is kept apart from the library table.

Everything is looked up under the driver root and is trusted-but-fragile: config files are
only located (never read: a container's loader parses them, not we), a symlink is resolved
inside the root, so the container gets the real file at the well-known path its loader searches;
sysfs is read with a bound on entries and bytes; a DRI node must be a character device with
the DRM major and the minor sysfs gives, or it is left out with a warning. Missing pieces are
normal (a headless driver install has no Xorg module) and only logged.
"""

from __future__ import annotations

import os
import re
import stat

from .. import log
from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from ..fs.inroot import resolve_in_root
from .devices import check_node
from .elfinfo import read_elf
from .ldcache import CacheEntry
from .libraries import host_links
from .model import DeviceNode, DriverFile

DRM_MAJOR = 226
MAX_DRM_ENTRIES = 16      # a GPU has a card and a render node (and controlD on old kernels)
MAX_DEV_TEXT = 32         # sysfs "dev" is "226:128\n"

# Where loaders look (the XDG and /etc directories of the Vulkan loader and libglvnd): each
# name is looked up under each directory and every hit is given, at the same path.
CONFIG_DIRS = ("/etc", "/usr/share")
CONFIG_NAMES = (
    "vulkan/icd.d/nvidia_icd.json",
    "vulkan/icd.d/nvidia_layers.json",
    "vulkan/implicit_layer.d/nvidia_layers.json",
    "glvnd/egl_vendor.d/10_nvidia.json",
    "egl/egl_external_platform.d/09_nvidia_wayland2.json",
    "egl/egl_external_platform.d/10_nvidia_wayland.json",
    "egl/egl_external_platform.d/15_nvidia_gbm.json",
    "egl/egl_external_platform.d/20_nvidia_xcb.json",
    "egl/egl_external_platform.d/20_nvidia_xlib.json",
    "nvidia/nvoptix.bin",
)
# The libraries the external-platform files name; separate packages, with versions of their own.
EGL_PLATFORM_PREFIXES = (
    "libnvidia-egl-wayland2.so",
    "libnvidia-egl-wayland.so",
    "libnvidia-egl-gbm.so",
    "libnvidia-egl-xcb.so",
    "libnvidia-egl-xlib.so",
)
# display: the X server's driver and GLX modules, in the distribution's directory (next to the
# driver's libraries, as Debian and Ubuntu package them) or where the .run installer puts them.
XORG_DIRS = ("{libdir}/nvidia/xorg", "/usr/lib/xorg/modules/{kind}", "/usr/lib64/xorg/modules/{kind}")
XORG_MODULES = (("drivers", "nvidia_drv.so"), ("extensions", "libglxserver_nvidia.so.{version}"))
XORG_CONFIG = "/usr/share/X11/xorg.conf.d/10-nvidia.conf"

_DRM_NAME = re.compile(r"(card|renderD)([0-9]{1,3})")


def _host(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root != "/" else path


def _regular(root: str, path: str) -> str | None:
    """The real file ``path`` leads to inside the root, if it is a regular file."""
    try:
        real = resolve_in_root(root, path)
        if stat.S_ISREG(os.lstat(_host(root, real)).st_mode):
            return real
    except OSError:
        pass
    return None


def sysfs_device(bus_id: str) -> str:
    """The GPU's PCI device in sysfs: ``00000000:07:00.0`` → ``/sys/bus/pci/devices/0000:07:00.0``."""
    return f"/sys/bus/pci/devices/{bus_id[4:]}"


def dri_nodes(root: str, bus_id: str) -> tuple[DeviceNode, ...]:
    """The GPU's ``/dev/dri/card*`` and ``renderD*`` nodes, as its PCI device's ``drm``
    directory lists them, each checked against the number sysfs gives (card first)."""
    try:
        drm = resolve_in_root(root, sysfs_device(bus_id) + "/drm")
        with os.scandir(_host(root, drm)) as it:
            names = []
            for entry in it:
                if len(names) >= MAX_DRM_ENTRIES:
                    break
                names.append(entry.name)
    except OSError:
        log.info(f"no DRM devices for GPU {bus_id}")
        return ()
    found = []
    for name in sorted(names, key=lambda n: (not n.startswith("card"), n)):
        m = _DRM_NAME.fullmatch(name)
        if not m:
            continue
        node = DeviceNode(f"/dev/dri/{name}", DRM_MAJOR, int(m.group(2)))
        if _sysfs_dev(root, f"{drm}/{name}/dev") != (node.major, node.minor):
            log.warning(f"skipping {node.path}: sysfs does not give it {node.major}:{node.minor}")
            continue
        try:
            present = check_node(root, node)
        except NvcError as exc:   # a wrong node is never given; graphics is not worth failing for
            log.warning(f"skipping {node.path}: {exc.detail}")
            continue
        if present:
            found.append(node)
        else:
            log.warning(f"missing device {node.path}")
    return tuple(found)


def _sysfs_dev(root: str, path: str) -> tuple[int, int] | None:
    try:
        real = resolve_in_root(root, path)
        fd = os.open(_host(root, real), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = read_at_most(fd, MAX_DEV_TEXT)[0].decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    major, sep, minor = text.partition(":")
    if not (sep and major.isascii() and major.isdigit() and minor.isascii() and minor.isdigit()):
        return None
    return int(major), int(minor)


def files(root: str, version: str, entries64: list[CacheEntry], libraries: tuple[DriverFile, ...]) -> list[DriverFile]:
    """The configuration files (``kind`` "config": ``name`` is where a loader looks and where
    the container gets it, ``path`` the real file), the EGL platform libraries (``kind``
    "library", as the driver's), and for ``display`` the Xorg modules (``kind`` "module")."""
    out = []
    for directory in CONFIG_DIRS:
        for name in CONFIG_NAMES:
            where = f"{directory}/{name}"
            real = _regular(root, where)
            if real:
                out.append(DriverFile(path=real, group="graphics", name=where, kind="config"))
    out += _platform_libraries(root, entries64)
    out += _xorg(root, version, libraries)
    return out


def _platform_libraries(root: str, entries: list[CacheEntry]) -> list[DriverFile]:
    """The first ELF file the ld cache gives for each EGL platform prefix, as the loader would."""
    out = []
    for prefix in EGL_PLATFORM_PREFIXES:
        for entry in entries:
            if not entry.key.startswith(prefix + "."):
                continue
            real = _regular(root, entry.value)
            try:
                facts = read_elf(_host(root, real)) if real else None
            except NvcError as exc:
                log.warning(f"skipping {escape(entry.value)}: {exc.detail}")
                continue
            if facts is None:
                continue
            out.append(DriverFile(path=real, group="graphics", name=prefix, soname=facts.soname, kind="library",
                                  links=host_links(root, real, prefix, facts.soname)))
            break
    return out


def _xorg(root: str, version: str, libraries: tuple[DriverFile, ...]) -> list[DriverFile]:
    libdirs = list(dict.fromkeys(os.path.dirname(lib.path) for lib in libraries if lib.name == "libcuda.so"))
    libdirs.append("/usr/lib/x86_64-linux-gnu")
    out = []
    for kind, module in XORG_MODULES:
        module = module.format(version=version)
        candidates = [d.format(libdir=libdir, kind=kind) for d in XORG_DIRS for libdir in libdirs]
        for directory in dict.fromkeys(candidates):
            real = _regular(root, f"{directory}/{module}")
            if real:
                # the X server loads "libglxserver_nvidia.so": the unversioned link, as upstream makes it
                links = (((module.rsplit(".so.", 1)[0] + ".so", module),) if kind == "extensions" else ())
                out.append(DriverFile(path=real, group="display", name=f"{directory}/{module}", kind="module",
                                      links=links))
                break
        else:
            log.info(f"no Xorg module {module}")
    real = _regular(root, XORG_CONFIG)
    if real:
        out.append(DriverFile(path=real, group="display", name=XORG_CONFIG, kind="config"))
    return out


def watched(inventory) -> list[str]:
    """Driver-root paths whose change may change what this module finds, present or not: each
    directory a file is looked for in (a file that appears or goes changes its directory), the
    files found and the links in front of them, each GPU's sysfs ``drm`` directory, its DRI nodes."""
    libdirs = {os.path.dirname(lib.path) for lib in inventory.libraries if lib.name == "libcuda.so"}
    libdirs.add("/usr/lib/x86_64-linux-gnu")
    paths = [os.path.dirname(f"{d}/{name}") for d in CONFIG_DIRS for name in CONFIG_NAMES]
    paths += [d.format(libdir=libdir, kind=kind) for kind, _ in XORG_MODULES for d in XORG_DIRS for libdir in sorted(libdirs)]
    paths.append(os.path.dirname(XORG_CONFIG))
    for f in inventory.graphics:
        paths += [f.path, f.name] if f.kind != "library" else [f.path]
    for gpu in inventory.gpus:
        drm = sysfs_device(gpu.bus_id) + "/drm"
        paths += [sysfs_device(gpu.bus_id), drm]
        try:
            paths.append(resolve_in_root(inventory.root, drm))   # the directory itself, not the bus link
        except OSError:
            pass
        paths += [node.path for node in gpu.dri]
    return list(dict.fromkeys(paths))
