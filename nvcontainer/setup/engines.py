"""``nvcontainer setup ENGINE``: what each container engine needs to give containers GPUs, decided
from the engine's files as they are and its version.

Engines find GPU support in different places, and ``setup`` edits each one's own configuration,
as ``nvidia-ctk runtime configure`` does: Docker's ``daemon.json`` gets the runtime ``nvidia``
(the runtime shim) with the keys and their order it had kept, and ``nvidia-container-runtime-hook``
goes on dockerd's PATH for ``--gpus``; containerd gets the runtime handler ``nvidia`` in a
drop-in of ours (:mod:`.containerd`) and one ``imports`` entry in its ``config.toml``, with
``nvidia-container-cli`` on PATH for ``ctr``/``nerdctl --gpus``; CRI-O a drop-in in
``crio.conf.d``; podman (and CRI-O with ``--hook``) a hooks.d file; a bare runc the entry for
each bundle's ``config.json``. The registration is the served one unless ``--in-process``: the
native hook client, with the socket-activated ``nvcontainer serve`` enabled.

:func:`steps` and :func:`undo` are pure given :class:`World` (what the files hold, what is on
PATH); :mod:`.perform` makes the changes, :mod:`.record` remembers them for ``--undo``.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable

from ..errors import NvcError, escape
from ..inventory.catalog import DEFAULT_PATH
from ..records import record
from . import containerd, jsonedit, record as records, tomltext, units, versions
from .install import RUNTIME, Install, hook_entry
from .model import Build, Link, RemoveFile, Steps, Systemctl, Unlink, WriteFile

ENGINES = ("runc", "docker", "containerd", "podman", "crio")
HOOK_FILE = "oci-nvcontainer-hook.json"
HOOKS_DIRS = {"podman": "/etc/containers/oci/hooks.d", "crio": "/usr/share/containers/oci/hooks.d"}
DAEMON_JSON = "/etc/docker/daemon.json"
CRIO_DROPIN = "/etc/crio/crio.conf.d/99-nvidia.toml"
LINK_DIR = "/usr/local/bin"
CDI_SPEC = units.CDI_SPEC
RESTART = {
    "docker": "systemctl restart docker (dockerd reads daemon.json, and looks for nvidia-container-runtime-hook "
              "on its PATH, only when it starts)",
    "containerd": "systemctl restart containerd (it reads its configuration only when it starts)",
    "crio": "systemctl restart crio (it reads its runtimes only when it starts)",
}
CRIO_HEADER = ("# Written by 'nvcontainer setup crio': the runtime 'nvidia' for GPU containers.\n"
               "# 'nvcontainer setup crio --undo' removes it.\n")


@record
class Options:
    engine: str
    served: bool = True                 # the served client, and the socket-activated server
    cdi: bool = False
    cdi_spec: str | None = None         # the generated spec, with --cdi
    set_as_default: bool = False
    hook: bool = False                  # crio: the hooks.d file instead of the runtime handler
    deadline: float = 30.0              # the hook's own; hooks.d timeouts are longer
    version: tuple[int, ...] | None = None
    links: bool = True                  # our programs linked onto the engines' PATH (/usr/local/bin)
    units: bool = True                  # the server's systemd units (the installer's pod serves instead)


@record
class World:
    """What the decision reads, as functions of a path (the prefix already applied)."""
    read: Callable[[str], str | None]
    expand: Callable[[str], list[str]]
    on_path: Callable[[str], str | None]      # realpath of the first NAME on a service's PATH
    units_packaged: bool = False


def world(prefix: str) -> World:
    from .perform import at, current

    def expand(pattern: str) -> list[str]:
        return sorted("/" + os.path.relpath(p, at(prefix, "/")) for p in glob.glob(at(prefix, pattern)))

    def on_path(name: str) -> str | None:
        for d in DEFAULT_PATH.split(":"):
            path = at(prefix, os.path.join(d, name))
            if os.path.lexists(path):
                return os.path.realpath(path)
        return None

    packaged = os.path.exists(at(prefix, os.path.join(units.PACKAGE_DIR, units.SERVE_SOCKET)))
    return World(read=lambda p: current(at(prefix, p)), expand=expand, on_path=on_path, units_packaged=packaged)


def hooks_json(entry: dict) -> str:
    """An OCI hooks.d file (schema 1.0.0) that runs the hook for every container: the hook itself
    decides, from the image's environment, whether there is anything to do."""
    doc = {"version": "1.0.0", "hook": entry, "when": {"always": True}, "stages": ["prestart"]}
    return json.dumps(doc, indent=2) + "\n"


def _runtime(inst: Install, builds: list) -> str:
    runtime = inst.runtime
    if runtime is None:
        raise NvcError("setup", f"this installation has no {RUNTIME} (the runtime shim) and no C compiler to build "
                                "it: install the nvcontainer package")
    if not inst.runtime_ready:
        builds.append(Build("runtime", runtime, inst.python))
    return runtime


def _on_path(name: str, inst: Install, w: World, o: Options) -> tuple:
    """A link that puts our ``name`` first on a service's PATH, unless it is there already."""
    ours = inst.program(name)
    if not o.links or w.on_path(name) == os.path.realpath(ours):
        return ()
    return (Link(f"{LINK_DIR}/{name}", ours),)


def _docker(o: Options, inst: Install, w: World, builds: list) -> tuple[list, list]:
    runtime = _runtime(inst, builds)
    wanted: list = [(("runtimes", "nvidia"), {"path": runtime})]
    if o.set_as_default:
        wanted.append((("default-runtime",), "nvidia"))
    if o.cdi:
        wanted.append((("features", "cdi"), True))
    old = w.read(DAEMON_JSON)
    text, keys = jsonedit.set_keys(old, DAEMON_JSON, wanted)
    if keys:
        edit = [WriteFile(DAEMON_JSON, text, old=old, own=False, keys=keys)]
    else:   # shown as unchanged
        edit = [WriteFile(DAEMON_JSON, old, old=old, own=False)] if old is not None else []
    notes = ["docker run --runtime=nvidia (or every container, with --set-as-default) goes through the runtime "
             "shim; docker run --gpus runs nvidia-container-runtime-hook from dockerd's PATH"]
    return [*_on_path("nvidia-container-runtime-hook", inst, w, o), *edit], notes


def _containerd(o: Options, inst: Install, w: World, builds: list) -> tuple[list, list]:
    runtime = _runtime(inst, builds)
    own, main = containerd.changes(w.read, w.expand, runtime, o.version, default=o.set_as_default, cdi=o.cdi)
    notes = ["Kubernetes: a RuntimeClass with handler 'nvidia' (or --set-as-default) runs pods through the "
             "runtime shim; ctr and nerdctl --gpus run nvidia-container-cli from PATH"]
    if o.version is not None and o.version < (1, 7):
        notes.append(f"containerd {versions.shown(o.version)}: the runtime handler is the Kubernetes route here "
                     "(CDI in the CRI plugin needs 1.7)")
    return [*_on_path("nvidia-container-cli", inst, w, o), own, *([main] if main else [])], notes


def _crio(o: Options, inst: Install, w: World, builds: list) -> tuple[list, list]:
    runtime = _runtime(inst, builds)
    doc: dict = {"crio": {"runtime": {"runtimes": {"nvidia": {"runtime_path": runtime, "runtime_type": "oci"}}}}}
    if o.set_as_default:
        doc["crio"]["runtime"]["default_runtime"] = "nvidia"
    text = tomltext.dumps(doc, CRIO_HEADER)
    return [WriteFile(CRIO_DROPIN, text, old=w.read(CRIO_DROPIN))], [
        "Kubernetes: a RuntimeClass with handler 'nvidia' (or --set-as-default) runs pods through the runtime shim"]


def _hooks_d(o: Options, entry: dict, w: World) -> tuple[list, list]:
    path = f"{HOOKS_DIRS[o.engine]}/{HOOK_FILE}"
    notes = [f"{o.engine} runs the hook for every container; NVIDIA_VISIBLE_DEVICES selects the GPUs"]
    if o.engine == "crio":
        notes.append(f"CRI-O reads hooks from hooks_dir in crio.conf ({HOOKS_DIRS['crio']} by default)")
    return [WriteFile(path, hooks_json(entry), old=w.read(path))], notes


def _served(o: Options, inst: Install, w: World) -> tuple[list, list, list]:
    """The server's units (written here only for an installation without the package's) and
    the systemctl calls that enable them."""
    wanted = {units.SERVE_SOCKET, units.SERVE_SERVICE} if o.served else set()
    if o.cdi:
        wanted |= {units.REFRESH_SERVICE, units.REFRESH_PATH}
    changes, calls = [], []
    if wanted and not w.units_packaged:
        for name, text in units.all_units(inst.program("nvcontainer")).items():
            if name in wanted:
                path = f"{units.LOCAL_DIR}/{name}"
                changes.append(WriteFile(path, text, old=w.read(path)))
        calls.append(Systemctl(("daemon-reload",)))
    enable = [u for u in (units.SERVE_SOCKET, units.REFRESH_PATH) if u in wanted]
    if enable:
        calls.append(Systemctl(("enable", "--now", *enable)))
    return changes, calls, []


def check(o: Options) -> None:
    """Refuse what cannot work, before anything is generated or read: one line, why."""
    if o.engine not in ENGINES:
        raise NvcError("input", f"unknown engine '{escape(o.engine, 40)}' (one of {', '.join(ENGINES)})")
    if o.hook and o.engine != "crio":
        raise NvcError("input", "--hook: only for crio (podman always uses its hooks.d file)")
    if o.cdi:
        problem = versions.lacks(o.engine, "cdi", o.version)
        if problem:
            raise NvcError("setup", f"--cdi: {problem}" + (
                "; the runtime handler 'nvidia' (without --cdi) is the Kubernetes route here"
                if o.engine == "containerd" else ""))
    if o.set_as_default and o.engine not in ("docker", "containerd", "crio"):
        raise NvcError("input", f"--set-as-default: {o.engine} has no default runtime to set")


def steps(o: Options, inst: Install, w: World) -> Steps:
    check(o)
    builds: list[Build] = []
    entry = hook_entry(inst, served=o.served, deadline=o.deadline)
    if o.served and inst.native_client and not inst.client_ready:
        builds.append(Build("client", inst.native_client, inst.python))
    notes = []
    if o.served and not inst.native_client:
        notes.append("the hook client registered is the Python one: there is no native client here and no C "
                     "compiler to build it (the package ships it); each start takes about 8 ms longer")
    fragments: tuple = ()
    if o.engine == "runc":
        changes: list = []
        fragments = (("each bundle's config.json", json.dumps({"hooks": {"prestart": [entry]}}, indent=2)),)
        notes.append("runc reads no configuration of its own: the hook is named in each bundle; the container's "
                     "NVIDIA_VISIBLE_DEVICES selects its GPUs")
    elif o.engine == "podman" or (o.engine == "crio" and o.hook):
        changes, more = _hooks_d(o, entry, w)
        notes += more
    else:
        changes, more = {"docker": _docker, "containerd": _containerd, "crio": _crio}[o.engine](o, inst, w, builds)
        notes += more
    unit_changes, calls, _ = _served(o, inst, w) if o.units else ([], [], [])
    cdi = [WriteFile(CDI_SPEC, o.cdi_spec, old=w.read(CDI_SPEC))] if o.cdi_spec is not None else []
    if not o.cdi:
        notes.append(f"for CDI devices, add --cdi (or run: nvcontainer cdi generate --output {CDI_SPEC})")
    # ours first, the operator's files last: a failure half-way leaves them as they were
    ordered = sorted([*changes, *unit_changes, *cdi], key=lambda c: isinstance(c, WriteFile) and not c.own)
    return Steps(engine=o.engine, changes=tuple(ordered), builds=tuple(builds), systemctl=tuple(calls),
                 fragments=fragments, notes=tuple(notes), restart=RESTART.get(o.engine, ""))


def undo(engine: str, entries: list[dict], w: World) -> Steps:
    """Take back what the record says setup did, where it is still as setup left it."""
    changes, notes = [], []
    for e in reversed(entries):
        if "link" in e:
            changes.append(Unlink(e["link"], e["target"], e.get("backup")))
            continue
        path, now = e["file"], w.read(e["file"])
        if now is None:
            notes.append(f"{path} is gone already")
            continue
        exact = records.digest(now) == e.get("wrote")
        backup = e.get("backup") if e.get("backup") and w.read(e["backup"]) is not None else None
        if exact and (backup or e.get("created")):
            changes.append(RemoveFile(path, now, restore=backup))
        elif e.get("own"):
            notes.append(f"left {path}: changed since setup wrote it")
        elif e.get("keys"):
            text, left = jsonedit.unset_keys(now, path, e["keys"])
            changes.append(WriteFile(path, text, old=now, own=False))
            notes += [f"left {key} in {path}: changed since setup set it" for key in left]
        elif e.get("imports"):
            changes.append(WriteFile(path, tomltext.remove_import(now, e["imports"], path), old=now, own=False))
    if not entries:
        notes.append(f"nothing to undo: setup has no record of changing {engine}")
    return Steps(engine=engine, changes=tuple(changes), notes=tuple(notes), restart=RESTART.get(engine, ""),
                 undo=True)

