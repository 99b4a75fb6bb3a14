"""The shim's decision: a bundle's ``config.json`` bytes, the operator's settings and what the
host offers → the new ``config.json`` bytes, or None to leave the file as it is.

Pure apart from the readers it is handed (:class:`World`), which it calls only when the answer
needs them: the driver inventory for a legacy GPU request, the CDI spec directories when CDI
devices are asked for. A container that asks for nothing is answered from its spec alone, and
its file is not written (byte for byte as the engine wrote it).

Modes (``[nvidia-container-runtime] mode``): ``legacy`` decides as the hook does
(:func:`..request.decide.request_from_env`), adds the hook and the plan's device nodes and rules
(:mod:`.legacy`); ``cdi`` resolves CDI names (:mod:`.cdinames`) against the spec directories,
checks the spec as ``nvcontainer cdi check`` does, applies its edits (:mod:`.cdiedits`) and takes
out any NVIDIA prestart hook, as upstream does; ``auto`` is ``cdi`` when CDI names are asked for,
else ``legacy``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config.model import Config
from ..errors import NvcError, escape
from ..records import record
from ..request import oci
from ..request import free
from ..request.decide import request_from_env
from . import cdinames, specdict

if TYPE_CHECKING:
    from ..cdi.store import SpecFile

# The planning and CDI modules are imported only for a container that needs them: the Python
# half runs for every container the native front could not rule out, most of them asking for
# nothing.


@record
class CdiView:
    """The spec directories as the shim sees them at this create."""
    specs: tuple["SpecFile", ...]
    problems: tuple[str, ...]                          # files that could not be used, one line each
    stale: Callable[["SpecFile"], str | None]          # why a spec is stale, or None
    probe: Callable[[str], tuple[str, int, int] | None]


@record
class World:
    hook: Callable[[], dict]            # the prestart entry legacy mode adds, found on demand
    inventory: Callable[[], object]     # the driver inventory, read on demand
    cdi: Callable[[], CdiView]          # the CDI spec directories, read on demand
    # CDI mode's free:N: lease(count, asked) → the GPU indexes leased (pending until the init
    # starts), unlease() gives them back, binder() the prestart entry that binds the lease
    lease: Callable[[int, str], tuple[int, ...]] | None = None
    unlease: Callable[[], None] | None = None
    binder: Callable[[], dict] | None = None


@record
class Edit:
    data: bytes | None                  # the new config.json; None: leave it as it is
    mode: str                           # the mode that decided: legacy or cdi
    summary: str                        # one line for the trace
    warnings: tuple[str, ...] = ()


def edit(data: bytes, bundle: str, config: Config, world: World) -> Edit:
    original = oci.spec_object(data)
    spec = oci.parse_spec(data, bundle)
    asked = cdinames.asked(spec, config, config.mode) if config.mode != "legacy" else None
    if config.mode == "cdi" or asked is not None:
        if asked is None or not asked.names:
            return Edit(None, "cdi", "no CDI device asked for", asked.warnings if asked else ())
        obj = oci.spec_object(data)
        leased = _leased(asked, config, world)
        if leased is None:
            summary = _cdi(obj, asked, world.cdi())
            return Edit(_changed(original, obj), "cdi", summary, asked.warnings)
        try:
            summary = _cdi(obj, leased, world.cdi())
            from .legacy import add_prestart

            add_prestart(obj, world.binder())
        except BaseException:
            world.unlease()   # the create stops here: the GPUs are free again
            raise
        return Edit(_changed(original, obj), "cdi", f"{summary}; leased for {asked.names[0]}", asked.warnings)
    request = request_from_env(spec.environ(), config, privileged=spec.privileged, mounts=spec.mounts,
                               annotations=spec.annotations)
    if not request.gpu:
        return Edit(None, "legacy", "not a GPU container", request.warnings)
    for path in (("hooks", "prestart"), ("linux", "devices"), ("linux", "resources", "devices")):
        specdict.check(original, *path)
    if free.asked(request.devices) is not None:
        # free:N: which GPUs is decided with the lease, at prestart, once the container's init
        # exists; the hook then gives the nodes and rules (the lease must not outlive the init)
        from . import legacy

        obj = oci.spec_object(data)
        hook = world.hook()
        legacy.add_hook(obj, hook)
        return Edit(_changed(original, obj), "legacy", f"hook {hook['path']}; GPUs leased at prestart "
                                                       f"({request.devices[0]})", request.warnings)
    from ..plan.build import HostProc, build_plan
    from ..plan.container import ContainerFacts
    from ..plan.gather import options_from_config
    from . import legacy

    # the library directories do not matter for which device nodes a request gets
    facts = ContainerFacts(libs_dir="/usr/lib64", libs32_dir="/usr/lib32")
    plan = build_plan(request, world.inventory(), facts, HostProc(), options_from_config(config), rootfs=spec.rootfs)
    obj = oci.spec_object(data)
    hook = world.hook()
    legacy.apply(obj, hook, plan)
    nodes = ", ".join(d.path for d in plan.devices) if plan.cgroups else "none (no-cgroups)"
    return Edit(_changed(original, obj), "legacy", f"hook {hook['path']}; device nodes and rules: {nodes}",
                plan.warnings)


def _leased(asked: cdinames.Asked, config: Config, world: World) -> cdinames.Asked | None:
    """``<default-kind>=free:N`` asked: the names of the N GPUs leased for it (by index, as
    ``nvcontainer cdi generate`` names them); None when nothing free is asked."""
    parts = [name.split("=", 1) for name in asked.names]
    wanted = free.parse([device for _, device in parts], asked.source)   # the hook's reading of the form
    if wanted is None:
        return None
    kind = parts[0][0]
    if kind != config.cdi_default_kind:
        raise NvcError("cdi", f"{asked.source}: {escape(asked.names[0], 80)}: free GPUs are leased as "
                              f"{config.cdi_default_kind} devices")
    count = free.asked(wanted)
    indexes = world.lease(count, f"free:{count}")
    return cdinames.Asked(tuple(f"{kind}={i}" for i in indexes), asked.source, asked.warnings)


def _changed(original: dict, obj: dict) -> bytes | None:
    if obj == original:
        return None
    return json.dumps(obj, separators=(",", ":")).encode()


def _cdi(obj: dict, asked: cdinames.Asked, view: CdiView) -> str:
    from ..cdi import store
    from . import cdiedits, legacy

    names = {n.name: n for n in store.resolve_names(list(view.specs))}
    files = {s.path: s for s in view.specs}
    used: dict[str, "SpecFile"] = {}
    for name in asked.names:
        found = names.get(name)
        if found is None:
            why = f"; {view.problems[0]}" if view.problems else ""
            raise NvcError("cdi", f"unresolvable CDI device {escape(name)} (from {asked.source}): no spec in the "
                                  f"spec directories defines it{why}")
        if found.conflicts:
            raise NvcError("cdi", f"CDI device {escape(name)} is defined twice at the same priority: "
                                  f"{escape(found.path)} and {escape(found.conflicts[0])}")
        spec_file = files[found.path]
        if spec_file.path not in used:
            stale = view.stale(spec_file)
            if stale:
                raise NvcError("cdi", stale)
            used[spec_file.path] = spec_file
        kind = spec_file.spec["kind"]
        device = next(d for d in spec_file.spec["devices"] if f"{kind}={d['name']}" == name)
        cdiedits.apply(obj, device.get("containerEdits") or {}, f"{escape(spec_file.path)}: device {escape(name)}",
                       view.probe)
    for spec_file in used.values():
        cdiedits.apply(obj, spec_file.spec.get("containerEdits") or {}, f"{escape(spec_file.path)}: containerEdits",
                       view.probe)
    hooks = obj.get("hooks")
    if isinstance(hooks, dict) and hooks.get("prestart") is not None:
        prestart = specdict.items(specdict.table(obj, "hooks"), "prestart", "config.json: hooks")
        prestart[:] = [h for h in prestart if not legacy.is_gpu_hook(h)]
    return f"CDI devices {', '.join(asked.names)} from {', '.join(used)}"
