"""Assembling the driver inventory from the host: the imperative shell around the readers.

Order matters for the errors a user sees: the ld cache first (it locates NVML), then NVML
(it says whether the driver is loaded and which GPUs exist), then the files that depend on the
driver version. Everything below returns plain data; nothing here changes the host.
"""

from __future__ import annotations

import os

from .. import log
from ..errors import NvcError, escape
from ..fs.inroot import resolve_in_root
from . import devices, files, graphics, ldcache, libraries, nvml, procfs
from .catalog import DEFAULT_PATH, MPS_PIPE_DIRECTORY, brand_name
from .model import Gpu, Inventory, MigControl, MigDevice

MIG_CONFIG = "/proc/driver/nvidia/capabilities/mig/config"
MIG_MONITOR = "/proc/driver/nvidia/capabilities/mig/monitor"


def build(
    root: str = "/",
    ldcache_path: str = "/etc/ld.so.cache",
    user: tuple[int, int] | None = None,
    *,
    proc: str = "/proc",
    deadline: float = 30.0,
    search_path: str | None = None,
    mps_dir: str | None = None,
    query=nvml.query,
) -> Inventory:
    """``query(library_path, user, deadline)`` answers for NVML (:func:`nvml.query`, or the
    inventory cache's stored answers)."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise NvcError("initialization", f"driver root {escape(root)}: not a directory")
    entries = read_cache(root, ldcache_path)
    arch64, arch32 = ldcache.native_arches()
    entries64 = ldcache.entries_for_arch(entries, arch64)
    entries32 = ldcache.entries_for_arch(entries, arch32) if arch32 is not None else []

    kernel = procfs.driver_version(proc)
    if kernel is None:
        raise NvcError(
            "initialization",
            "nvml error: driver not loaded (no /proc/driver/nvidia/version: is the nvidia kernel module loaded?)",
        )
    nvml_path = _nvml_library(root, ldcache_path, entries64, kernel)
    log.info(f"loading NVML from {nvml_path}")
    facts = query(nvml_path, user, deadline)
    version = facts["driver_version"]
    if kernel != version:
        raise NvcError(
            "initialization",
            f"nvml error: driver/library version mismatch: kernel module {escape(kernel)}, library {escape(version)}",
        )
    majors = procfs.char_majors(proc)
    caps_major = majors.get("nvidia-caps")
    gpus = tuple(_gpu(g, root, proc, caps_major) for g in facts["gpus"])
    log.info(f"driver {version}, {len(gpus)} GPU(s)")

    libs64 = tuple(libraries.select(entries64, root, version))
    return Inventory(
        root=root,
        driver_version=version,
        cuda_version=cuda_version_text(facts["cuda_version"]),
        gpus=gpus,
        ctl_devices=tuple(devices.control_nodes(root, majors)),
        caps_major=caps_major,
        imex_major=majors.get("nvidia-caps-imex-channels"),
        mig=MigControl(
            config=MIG_CONFIG if procfs.cap_minor(proc, MIG_CONFIG) is not None else "",
            monitor=MIG_MONITOR if procfs.cap_minor(proc, MIG_MONITOR) is not None else "",
            config_cap=devices.cap_node(root, caps_major, procfs.cap_minor(proc, MIG_CONFIG)),
            monitor_cap=devices.cap_node(root, caps_major, procfs.cap_minor(proc, MIG_MONITOR)),
        ),
        mig_minors=procfs.mig_minors(proc),
        libraries=libs64,
        libraries32=tuple(libraries.select(entries32, root, version, label="compat32 ")),
        binaries=tuple(files.binaries(root, search_path or os.environ.get("PATH") or DEFAULT_PATH,
                                      files.driver_bin(_in_root(root, nvml_path)))),
        ipcs=tuple(files.ipcs(root, mps_dir or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIRECTORY)),
        firmwares=tuple(files.firmwares(root, version)),
        graphics=tuple(graphics.files(root, version, entries64, libs64)),
    )


def read_cache(root: str, ldcache_path: str) -> list[ldcache.CacheEntry]:
    try:
        real = resolve_in_root(root, ldcache_path)
    except OSError as exc:
        raise NvcError("ldcache", f"{escape(ldcache_path)}: {exc.strerror.lower()}") from None
    host = os.path.join(root, real.lstrip("/")) if root != "/" else real
    entries = ldcache.read(host)
    log.info(f"read {len(entries)} entries from {host}")
    return entries


def _in_root(root: str, host: str) -> str:
    return host[len(root.rstrip("/")):] if root != "/" else host


def _nvml_library(root: str, ldcache_path: str, entries, kernel: str) -> str:
    """The ``libnvidia-ml.so.1`` to load: the one of the loaded kernel module's version.

    The loader would take the first cache entry, which may be a CUDA toolkit stub or a leftover
    of an older driver; NVML then fails with a vaguer message than the one we can give here.
    """
    candidates = []
    for entry in entries:
        if entry.key == "libnvidia-ml.so.1":
            try:
                candidates.append(resolve_in_root(root, entry.value))
            except OSError:
                continue
    if not candidates:
        where = os.path.join(root, ldcache_path.lstrip("/"))
        raise NvcError(
            "initialization",
            f"load library failed: libnvidia-ml.so.1: cannot open shared object file: not in the ld cache {escape(where)}",
        )
    for real in candidates:
        if os.path.basename(real).endswith(kernel):
            return os.path.join(root, real.lstrip("/")) if root != "/" else real
    found = ", ".join(escape(os.path.basename(c)) for c in candidates)
    raise NvcError(
        "initialization",
        f"nvml error: driver/library version mismatch: kernel module {escape(kernel)}, libraries in the ld cache: {found}",
    )


def cuda_version_text(value: int) -> str:
    return f"{value // 1000}.{(value % 100) // 10}"


def _gpu(g: dict, root: str, proc: str, caps_major: int | None) -> Gpu:
    domain, bus, device = g["bus"]
    minor = g["minor"]
    migs = []
    for m in g["migs"]:
        gi_access = f"/proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{m['gi']}/access"
        ci_access = f"/proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{m['gi']}/ci{m['ci']}/access"
        migs.append(MigDevice(
            parent=g["index"],
            index=m["index"],
            uuid=m["uuid"],
            gi=m["gi"],
            ci=m["ci"],
            gi_access=gi_access,
            ci_access=ci_access,
            gi_cap=devices.cap_node(root, caps_major, procfs.cap_minor(proc, gi_access)),
            ci_cap=devices.cap_node(root, caps_major, procfs.cap_minor(proc, ci_access)),
            name=m["name"],
            **_mig_geometry(m),
        ))
    bus_id = f"{domain:08x}:{bus:02x}:{device:02x}.0"
    return Gpu(
        index=g["index"],
        minor=minor,
        model=g["name"],
        brand=brand_name(g["brand"]),
        uuid=g["uuid"],
        bus_id=bus_id,
        arch=f"{g['cc'][0]}.{g['cc'][1]}",
        mig_capable=g["mig_capable"],
        mig_enabled=g["mig_enabled"],
        migs=tuple(migs),
        dri=graphics.dri_nodes(root, bus_id),
        memory=_count(g.get("memory")),
    )


def _count(value) -> int:
    return value if type(value) is int and 0 <= value < 1 << 62 else 0


def _mig_geometry(m: dict) -> dict:
    """A MIG device's optional facts (older caches and drivers lack them): memory, GPU instance
    profile id and placement, engine counts."""
    out = {"memory": _count(m.get("memory"))}
    placement = m.get("placement")
    if type(m.get("profile_id")) is int and isinstance(placement, list) and len(placement) == 2 \
            and all(type(v) is int and 0 <= v < 64 for v in placement) and 0 <= m["profile_id"] < 1 << 16:
        out.update(profile_id=m["profile_id"], placement_start=placement[0], placement_size=placement[1])
    engines = m.get("engines")
    if isinstance(engines, list) and len(engines) == len(ENGINES) and all(type(v) is int and 0 <= v < 1 << 16
                                                                          for v in engines):
        out.update(zip(ENGINES, engines))
    return out


ENGINES = ("multiprocessors", "copy_engines", "decoders", "encoders", "jpeg_engines", "ofa_engines")
