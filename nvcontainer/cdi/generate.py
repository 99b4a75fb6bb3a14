"""Inventory → CDI spec, through the same plan builder the hook uses. Pure: no I/O.

The plan builder already knows what a container gets for a request: which device nodes a GPU
or MIG device needs, the driver's libraries, binaries, IPC endpoints and firmware, the
symlinks the host has for them, the directories ldconfig must scan. A CDI spec is that
knowledge cut differently: one plan with no GPU and every capability gives the edits every
device shares (CDI injects all driver files, whatever the capabilities), and one plan per GPU
and MIG device gives that device's own nodes.

Two things differ from the hook's plans. Files land at their host path, minus the driver root
(an engine cannot look inside the image to choose a library directory). And what the hook does
itself in the container is left to our CDI hooks, run by the engine's runtime:
``create-symlinks``, ``update-ldcache`` and ``disable-device-node-modification`` (the private
``/proc/driver/nvidia`` copy of the hook path is not possible in CDI; only ``params`` is
covered, which is what keeps NVML from re-creating device nodes).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter

from .. import __version__
from ..errors import NvcError, escape
from ..inventory.model import DriverFile, Gpu, Inventory, MigDevice
from ..plan.build import HostProc, build_plan
from ..plan.container import ContainerFacts
from ..plan.model import Device as PlanDevice
from ..plan.model import Plan
from ..records import record, replace
from ..request.decide import CAPABILITIES, Request
from . import yamltext
from .spec import Device, DeviceNode, Edits, Hook, Mount, Spec, check_kind, valid_device_name

STRATEGIES = ("index", "uuid", "type-index")
DEFAULT_STRATEGIES = ("index", "uuid")
# createRuntime hooks run in the runtime's namespaces with the container's host PID in the
# state (runc and crun alike), before pivot_root, with the container's mounts in place: the
# state the apply layer is built for. createContainer hooks get PID 1 (runc) or 0 (crun) and
# run inside the container's namespaces, where that PID means nothing.
HOOK_STAGE = "createRuntime"
# The hook's whole environment: without an explicit env, a runtime may hand hooks its own or
# the container's (CVE-2025-23266: an image's LD_PRELOAD ran in a createContainer hook).
HOOK_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
HOOK_PROGRAM = "nvcontainer-hook"
# A runtime without a hook timeout waits for ever (SECURITY §4.4); past the hook's own deadline,
# so the hook reports first, by the margin setup gives its registrations.
TIMEOUT_MARGIN = 30
# CDI mounts are recursive binds kept private to the container (REFERENCE §4.3).
BIND_OPTIONS = ("rbind", "rprivate")
VOID_ENV = "NVIDIA_VISIBLE_DEVICES=void"
DRIVER_ANNOTATION = "nvcontainer/driver-version"
DRIVER_COMMENT = "nvcontainer-driver-version:"


@record
class Options:
    hook_path: str
    vendor: str = "nvidia.com"
    cls: str = "gpu"
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    all_device: bool = True
    ldconfig: str = "/sbin/ldconfig"
    allow: object = None   # selection.AllowList: the node's allowed-devices (None: every device)
    deadline: float = 20.0   # the configuration's deadline: each hook's timeout is this plus TIMEOUT_MARGIN
    host_root: str | None = None   # the driver root as the host's runtime sees it (None: as we read it)
    cuda_compat: bool = True   # update-ldcache gets --host-driver-version (config cuda-compat-mode not disabled)


def options_for(config, **fields) -> Options:
    """What the node's configuration decides of a spec (its ldconfig, its deadline under each
    hook's timeout, CUDA forward compatibility unless ``cuda-compat-mode`` is disabled), with
    ``fields`` on top: every writer of a spec for this node gets them alike."""
    return Options(**{"ldconfig": config.ldconfig_program(), "deadline": config.deadline,
                      "cuda_compat": config.cuda_compat_mode != "disabled", **fields})


def generate(inv: Inventory, opts: Options) -> Spec:
    kind = check_kind(opts.vendor, opts.cls)
    unknown = [s for s in opts.strategies if s not in STRATEGIES]
    if unknown or not opts.strategies:
        raise NvcError("input", f"device name strategies: {escape(','.join(unknown) or 'none')}: "
                                f"expected {', '.join(STRATEGIES)}")
    if not opts.hook_path.startswith("/"):
        raise NvcError("input", f"hook path {escape(opts.hook_path)}: must be absolute")
    if not inv.gpus:
        raise NvcError("cdi", "no GPUs found: a CDI spec needs at least one device")
    facts = ContainerFacts(libs_dir=_main_dir(inv.libraries, "/usr/lib64"),
                           libs32_dir=_main_dir(inv.libraries32, "/usr/lib32"))
    common = build_plan(Request(gpu=True, devices=(), capabilities=CAPABILITIES), inv, facts, HostProc(), rootfs="/")
    shared = {d.path for d in common.devices}

    devices: list[Device] = []
    every: dict[str, DeviceNode] = {}
    units = list(_units(inv, opts.allow))
    if not units:
        raise NvcError("cdi", "allowed-devices permits no device on this node: a CDI spec needs at least one")
    every_link: dict[str, str] = {}
    for gpu, mig in units:
        token = f"{gpu.index}:{mig.index}" if mig else str(gpu.index)
        plan = build_plan(Request(gpu=True, devices=(token,), capabilities=CAPABILITIES), inv, facts, HostProc(),
                          rootfs="/")
        nodes = tuple(_node(d) for d in plan.devices if d.path not in shared)
        # the device's own links (its DRI nodes' by-path names), made by a hook of the device
        links = {s.link: s.target for s in plan.symlinks if s not in common.symlinks}
        hooks = (_hook(opts, "create-symlinks", *_link_args(links)),) if links else ()
        for name in dict.fromkeys(device_names(gpu, mig, opts.strategies)):
            if not valid_device_name(name):
                raise NvcError("cdi", f"device name {escape(name, 80)} is not a valid CDI name")
            devices.append(Device(name, Edits(device_nodes=nodes, hooks=hooks)))
        for node in nodes:
            every.setdefault(node.path, node)
        every_link.update(links)
    if opts.all_device and "all" not in {d.name for d in devices}:
        hooks = (_hook(opts, "create-symlinks", *_link_args(every_link)),) if every_link else ()
        devices.append(Device("all", Edits(device_nodes=tuple(every.values()), hooks=hooks)))

    root = inv.root.rstrip("/")
    mounts = _mounts(common, root, {f.name for f in inv.graphics if f.kind != "library"})
    hooks = _hooks(common, inv, opts, mounts)
    edits = Edits(
        env=(VOID_ENV,),
        device_nodes=tuple(_node(d) for d in common.devices),
        mounts=tuple(mounts.values()),
        hooks=hooks,
    )
    spec = Spec(kind=kind, devices=tuple(devices), edits=edits)
    return spec if opts.host_root is None else to_host(spec, inv.root, opts.host_root)


def host_path(path: str, view_root: str, host_root: str) -> str:
    """``path`` as read here (under ``view_root``, where the driver root is mounted in our pod)
    named as the host has it (under ``host_root``); a path outside ``view_root`` is the host's."""
    view, host = view_root.rstrip("/"), host_root.rstrip("/")
    if view and (path == view or path.startswith(view + "/")):
        return (host + path[len(view):]) or "/"
    return path


def to_host(spec: Spec, view_root: str, host_root: str) -> Spec:
    """Every host-side path of ``spec`` (mount sources, device nodes' host paths) named as the
    host's runtime sees it. Why: a plugin in a pod reads the driver where its DaemonSet mounts
    it (``/driver-root``), but the spec is read by the node's runtime, for which only the host's
    own paths exist (NVIDIA's ``--nvidia-driver-root`` / ``--container-driver-root`` split)."""
    def edits(e: Edits) -> Edits:
        nodes = tuple(replace(n, host_path=host_path(n.host_path, view_root, host_root)) if n.host_path else n
                      for n in e.device_nodes)
        mounts = tuple(replace(m, host_path=host_path(m.host_path, view_root, host_root)) for m in e.mounts)
        return replace(e, device_nodes=nodes, mounts=mounts)

    if view_root.rstrip("/") == host_root.rstrip("/"):
        return spec
    return replace(spec, edits=edits(spec.edits),
                   devices=tuple(replace(d, edits=edits(d.edits)) for d in spec.devices))


def hook_timeout(opts: Options) -> int:
    return math.ceil(opts.deadline) + TIMEOUT_MARGIN


def device_names(gpu: Gpu, mig: MigDevice | None, strategies) -> list[str]:
    """A GPU is ``0``, ``GPU-<uuid>``, ``gpu0``; a MIG device ``0:1``, ``MIG-<uuid>``, ``mig0:1``."""
    out = []
    for strategy in strategies:
        if strategy == "index":
            out.append(f"{gpu.index}:{mig.index}" if mig else str(gpu.index))
        elif strategy == "uuid":
            out.append(mig.uuid if mig else gpu.uuid)
        else:
            out.append(f"mig{gpu.index}:{mig.index}" if mig else f"gpu{gpu.index}")
    return out


def _units(inv: Inventory, allow=None):
    """Every GPU and MIG device, or those the node's allow-list permits: a spec offers what the
    hook would hand out, so an engine resolving a CDI name cannot get around allowed-devices."""
    for gpu in inv.gpus:
        if allow is None or allow.permits(gpu):
            yield gpu, None
        for mig in gpu.migs:
            if allow is None or allow.permits(gpu, mig):
                yield gpu, mig


def _main_dir(libs: tuple[DriverFile, ...], default: str) -> str:
    """Where most driver libraries live (libcuda's directory when there is one): the directory
    the plan's symlinks go to."""
    for lib in libs:
        if lib.name == "libcuda.so":
            return os.path.dirname(lib.path)
    counts = Counter(os.path.dirname(lib.path) for lib in libs)
    return counts.most_common(1)[0][0] if counts else default


def _node(d: PlanDevice) -> DeviceNode:
    return DeviceNode(path=d.path, host_path=d.source, type="c", major=d.major, minor=d.minor)


def _in_container(source: str, root: str) -> str:
    return source[len(root):] if root and source.startswith(root + "/") else source


def _mounts(plan: Plan, root: str, same_path: set[str]) -> dict[str, Mount]:
    """The plan's mounts of driver files, by plan target, each at its host path minus the root,
    but for the Vulkan, EGL and Xorg files (``same_path``), which go where loaders look for
    them, as the plan has them (the host file may be a link to somewhere else).
    The plan's ``/proc`` binds are the hook path's private procfs copy, which CDI has not."""
    out: dict[str, Mount] = {}
    for m in plan.mounts:
        if m.target.startswith("/proc/"):
            continue
        container = m.target if m.target in same_path else _in_container(m.source, root)
        out[m.target] = Mount(m.source, container, m.options + BIND_OPTIONS)
    return out


def _hook(opts: Options, *args: str) -> Hook:
    return Hook(HOOK_STAGE, opts.hook_path, (HOOK_PROGRAM, *args), HOOK_ENV, hook_timeout(opts))


def _link_args(links: dict[str, str]) -> list[str]:
    return [arg for link, target in links.items() for arg in ("--link", f"{target}::{link}")]


def _hooks(plan: Plan, inv: Inventory, opts: Options, mounts: dict[str, Mount]) -> tuple[Hook, ...]:
    hooks = []
    links = _links(plan, mounts)
    if links:
        hooks.append(_hook(opts, "create-symlinks", *_link_args({link: target for target, link in links})))
    folders = list(plan.ldconfig.directories if plan.ldconfig else ())
    folders += [os.path.dirname(lib.path) for lib in (*inv.libraries, *inv.libraries32)]
    ld_args = [arg for folder in dict.fromkeys(folders) for arg in ("--folder", folder)]
    compat = ("--host-driver-version", inv.driver_version) if opts.cuda_compat else ()
    hooks.append(_hook(opts, "update-ldcache", *ld_args, "--ldconfig-path", opts.ldconfig, *compat))
    hooks.append(_hook(opts, "disable-device-node-modification"))
    return tuple(hooks)


def _links(plan: Plan, mounts: dict[str, Mount]) -> list[tuple[str, str]]:
    """The plan's symlinks as (target, link) pairs, each link moved into the directory where the
    file it finally points to is mounted (the plan puts every link in one library directory;
    a library kept in a subdirectory on the host, vdpau/, is mounted there)."""
    by_link = {s.link: s.target for s in plan.symlinks}

    def final_dir(path: str) -> str | None:
        for _ in range(8):   # a link to a link to the file, at most a few steps
            if path in mounts:
                return os.path.dirname(mounts[path].container_path)
            if path not in by_link:
                return None
            path = os.path.join(os.path.dirname(path), by_link[path])
        return None

    out = []
    for s in plan.symlinks:
        where = final_dir(s.link) or os.path.dirname(s.link)
        out.append((s.target, os.path.join(where, os.path.basename(s.link))))
    return out


def render(spec: Spec, fmt: str, driver_version: str) -> str:
    """The spec as text, with the driver version it was made for: a comment in YAML (keeping
    ``cdiVersion`` low), an annotation in JSON, which has no comments (that needs 0.6.0)."""
    if fmt == "json":
        noted = replace(spec, annotations=(*spec.annotations, (DRIVER_ANNOTATION, driver_version)))
        return json.dumps(noted.to_dict(), indent=2) + "\n"
    comments = [f"Generated by nvcontainer {__version__} (nvcontainer cdi generate). Regenerate after a driver "
                "or GPU change.", f"{DRIVER_COMMENT} {driver_version}"]
    return yamltext.dump(spec.to_dict(), comments)
