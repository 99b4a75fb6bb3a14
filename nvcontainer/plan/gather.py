"""The ``configure`` code path shared by the CLI and the OCI hook: gather, decide, (apply).

Gathering is the only I/O before the plan exists: the driver inventory, the host's
``/proc/driver/nvidia`` files and the container's rootfs facts. The rootfs is opened through
``/proc/PID/root`` when a PID is given, so paths are resolved in the container's own mount view,
and always with in-root resolution, so the image's symlinks never lead outside it.
"""

from __future__ import annotations

import os

from .. import log
from ..config.model import Config, host_ldconfig
from ..errors import NvcError, escape
from ..fs.inroot import open_in_root
from ..inventory import procfs
from .build import HostProc, PlanOptions, build_plan
from .container import read_container
from .model import Plan
from ..request.decide import Request


def host_proc(proc: str = "/proc") -> HostProc:
    base = os.path.join(proc, procfs.DRIVER_DIR)
    return HostProc(
        version=procfs.read_text(os.path.join(base, "version")),
        params=procfs.read_text(os.path.join(base, "params")),
        registry=procfs.read_text(os.path.join(base, "registry")),
        gpu_dirs=tuple(procfs.gpu_bus_dirs(proc)),
    )


def check_rootfs(rootfs: str) -> str:
    if not rootfs.startswith("/") or os.path.normpath(rootfs) == "/":
        raise NvcError("input", f"invalid rootfs directory: {escape(rootfs)}")
    return os.path.normpath(rootfs)


def open_rootfs(rootfs: str, pid: int | None) -> int:
    """An O_PATH fd of the rootfs, as the container's mount namespace sees it."""
    try:
        if pid is None:
            return os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        base = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return open_in_root(base, rootfs, os.O_PATH | os.O_DIRECTORY)
        finally:
            os.close(base)
    except OSError as exc:
        where = f"/proc/{pid}/root{rootfs}" if pid else rootfs
        raise NvcError("container", f"cannot open rootfs {escape(where)}: {str(exc.strerror).lower()}") from None


def owner(pid: int | None, rootfs_fd: int) -> tuple[int, int]:
    """The container's owner: of ``/proc/PID`` (supervised) or of the rootfs (standalone)."""
    try:
        st = os.stat(f"/proc/{pid}") if pid else os.fstat(rootfs_fd)
    except OSError as exc:
        raise NvcError("container", f"cannot stat /proc/{pid}: {str(exc.strerror).lower()}") from None
    return st.st_uid, st.st_gid


def plan_for(request: Request, config: Config, rootfs: str, pid: int | None,
             options: PlanOptions, inventory=None) -> Plan:
    rootfs = check_rootfs(rootfs)
    if not request.gpu:
        for w in request.warnings:
            log.warning(w)
        return Plan(gpu=False, rootfs=rootfs, pid=pid)
    if inventory is None:
        from ..inventory.cache import cached_inventory

        inventory = cached_inventory(config)
    fd = open_rootfs(rootfs, pid)
    try:
        container = read_container(fd)
        who = owner(pid, fd)
    finally:
        os.close(fd)
    plan = build_plan(request, inventory, container, host_proc(), options, rootfs=rootfs, pid=pid, owner=who)
    for w in plan.warnings:
        log.warning(w)
    log.info(f"plan: {len(plan.mounts)} mounts, {len(plan.devices)} devices, {len(plan.symlinks)} symlinks")
    return plan


def options_from_config(config: Config, **flags) -> PlanOptions:
    return PlanOptions(
        no_cgroups=config.no_cgroups or flags.get("no_cgroups", False),
        no_devbind=flags.get("no_devbind", False),
        no_persistenced=flags.get("no_persistenced", False),
        no_fabricmanager=flags.get("no_fabricmanager", False),
        no_gsp_firmware=flags.get("no_gsp_firmware", False),
        ldconfig=host_ldconfig(flags.get("ldconfig") or config.ldconfig),
        cuda_compat_mode=flags.get("cuda_compat_mode") or config.cuda_compat_mode,
        allowed_devices=config.allowed_devices,
        driver_volume_dir=config.driver_volume_dir,
    )
