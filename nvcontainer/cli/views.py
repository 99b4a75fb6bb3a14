"""Renderings of the inventory for ``info`` and ``list``: pure functions from data to text.

The text and CSV forms are byte-for-byte what nvidia-container-cli prints (REFERENCE §1.2,
§1.3) because operators parse them; the JSON forms are ours and documented in the man page.
"""

from __future__ import annotations

import json

from ..errors import NvcError
from ..inventory.model import Inventory
from ..records import record
from ..request.selection import AllowList, Selection

_INFO_FIELDS = ("Device Index", "Device Minor", "Model", "Brand", "GPU UUID", "Bus Location", "Architecture")


def _gpu_values(g) -> tuple:
    return (g.index, g.minor, g.model, g.brand, g.uuid, g.bus_id, g.arch)


def _line(label: str, value) -> str:
    return f"{label + ':':<15} {value}\n"


def info_text(inv: Inventory) -> str:
    out = [_line("NVRM version", inv.driver_version), _line("CUDA version", inv.cuda_version)]
    for g in inv.gpus:
        out.append("\n")
        out += [_line(label, value) for label, value in zip(_INFO_FIELDS, _gpu_values(g))]
    return "".join(out)


def info_csv(inv: Inventory) -> str:
    out = ["NVRM version,CUDA version\n", f"{inv.driver_version},{inv.cuda_version}\n", "\n"]
    out.append(",".join(_INFO_FIELDS) + "\n")
    out += [",".join(str(v) for v in _gpu_values(g)) + "\n" for g in inv.gpus]
    return "".join(out)


def info_json(inv: Inventory, allow: AllowList | None = None) -> str:
    """``held_back``: the node's ``allowed-devices`` keeps this GPU (whole) or MIG device from
    containers. A GPU allowed only through some of its MIG devices is not held back."""
    data = {
        "driver_version": inv.driver_version,
        "cuda_version": inv.cuda_version,
        "gpus": [
            {
                "index": g.index,
                "minor": g.minor,
                "model": g.model,
                "brand": g.brand,
                "uuid": g.uuid,
                "bus_id": g.bus_id,
                "architecture": g.arch,
                "mig_enabled": g.mig_enabled,
                "held_back": allow is not None and not allow.touches(g),
                "mig_devices": [
                    {"index": m.index, "uuid": m.uuid, "gpu_instance": m.gi, "compute_instance": m.ci,
                     "held_back": allow is not None and not allow.permits(g, m)}
                    for m in g.migs
                ],
            }
            for g in inv.gpus
        ],
    }
    return json.dumps(data, indent=2) + "\n"


@record
class ListOptions:
    devices: bool = False
    libraries: bool = False
    binaries: bool = False
    ipcs: bool = False
    firmwares: bool = False
    compat32: bool = False
    mig_config: bool = False
    mig_monitor: bool = False
    imex_channels: tuple[int, ...] = ()
    no_persistenced: bool = False
    no_fabricmanager: bool = False
    no_gsp_firmware: bool = False
    graphics: bool = False
    display: bool = False


def list_sections(inv: Inventory, sel: Selection, opts: ListOptions) -> dict[str, list[str]]:
    """What ``list`` prints, by section, in upstream's order (REFERENCE §1.3)."""
    devices: list[str] = []
    if opts.devices:
        devices += [n.path for n in inv.ctl_devices]
        devices += [g.node.path for g in sel.gpus]
        if not (opts.mig_config or opts.mig_monitor):
            for m in sel.migs:
                # both access files, then the nodes behind them (upstream's order)
                devices += [m.gi_access, m.ci_access]
                devices += [cap.path for cap in (m.gi_cap, m.ci_cap) if cap is not None]
    imex = [f"/dev/nvidia-caps-imex-channels/channel{c}" for c in opts.imex_channels]
    mig = []
    capable = [g for g in sel.gpus if g.mig_capable]
    for wanted, path, cap in (
        (opts.mig_config, inv.mig.config, inv.mig.config_cap),
        (opts.mig_monitor, inv.mig.monitor, inv.mig.monitor_cap),
    ):
        if not wanted or not path or not capable:   # upstream: only for selected MIG-capable GPUs
            continue
        mig.append(path)
        if cap is not None:
            mig.append(cap.path)
        for g in capable:
            mig.append(f"/proc/driver/nvidia/capabilities/gpu{g.minor}")
            if inv.caps_major is not None:
                mig.append("/dev/nvidia-caps")
                prefix = f"gpu{g.minor}/"
                mig += [f"/dev/nvidia-caps/nvidia-cap{minor}" for name, minor in inv.mig_minors if name.startswith(prefix)]
    binaries = [b.path for b in inv.binaries] if opts.binaries else []
    libraries = [lib.path for lib in inv.libraries] if opts.libraries else []
    libraries32 = [lib.path for lib in inv.libraries32] if opts.libraries and opts.compat32 else []
    ipcs = [i.path for i in inv.ipcs if _wanted(i, opts)] if opts.ipcs else []
    firmwares = [f.path for f in inv.firmwares] if opts.firmwares and not opts.no_gsp_firmware else []
    graphics = []
    if opts.graphics or opts.display:   # not upstream's: a section of our own, last
        if opts.devices:
            graphics += [n.path for g in sel.whole_gpus() for n in g.dri]
        # files at the path loaders look them up and the container gets them; libraries as they are
        graphics += [f.path if f.kind == "library" else f.name for f in inv.graphics
                     if f.group == "graphics" or opts.display]
    return {
        "devices": devices,
        "imex_channels": imex,
        "mig": mig,
        "binaries": binaries,
        "libraries": libraries,
        "libraries32": libraries32,
        "ipcs": ipcs,
        "firmwares": firmwares,
        "graphics": graphics,
    }


def _wanted(ipc, opts: ListOptions) -> bool:
    """``--no-persistenced`` / ``--no-fabricmanager`` drop the sockets, as in ``configure``."""
    if opts.no_persistenced and ipc.name == "persistenced":
        return False
    if opts.no_fabricmanager and ipc.name == "fabricmanager":
        return False
    return True


def list_text(sections: dict[str, list[str]]) -> str:
    return "".join(f"{p}\n" for paths in sections.values() for p in paths)


def held_back_paths(held: Selection) -> list[str]:
    """The device nodes of held-back GPUs and the access files of held-back MIG devices."""
    return [g.node.path for g in held.gpus] + [m.ci_access for m in held.migs]


def list_json(sections: dict[str, list[str]], held_back: list[str] = ()) -> str:
    """The sections, and ``held_back``: what ``allowed-devices`` keeps from containers (the text
    form has no room for it without breaking upstream's one-path-a-line format)."""
    return json.dumps({**sections, "held_back": list(held_back)}, indent=2) + "\n"


def check_mig_option(name: str, value: str | None) -> bool:
    """``--mig-config`` / ``--mig-monitor`` accept only ``all``, as upstream."""
    if value is None:
        return False
    if value != "all":
        raise NvcError(f"{name}", "only 'all' devices are currently supported")
    return True
