"""containerd: the runtime handler ``nvidia`` (and CDI) in a drop-in of ours, imported by one line.

containerd's ``config.toml`` is the operator's, with comments: ``setup`` adds one entry to its
``imports`` (a textual edit, :mod:`.tomltext`) and writes everything else to
``/etc/containerd/conf.d/99-nvidia.toml``. In containerd 1.x an imported file that names a
plugin replaces that plugin's whole section, not key by key (containerd#5837), and a
``runtimes`` table replaces the default one (the built-in ``runc`` handler included). So the
drop-in carries the CRI section as containerd would otherwise have it, taken from
``config.toml`` and its other imports in containerd's order, plus: the default runtime when
the file did not define it, the handler ``nvidia`` (a copy of the default runc handler, its
``SystemdCgroup`` included, whose ``BinaryName`` is the runtime shim), and with ``--cdi``
``enable_cdi``. Changing a CRI setting in ``config.toml`` later means running ``setup`` again;
``doctor`` says when the copy is out of date (:func:`stale`).

Pure: the files' text in (through ``read``/``expand``), the new texts out.
"""

from __future__ import annotations

import copy
import os

from ..errors import NvcError, escape
from . import tomltext
from .model import WriteFile

MAIN = "/etc/containerd/config.toml"
DROPIN = "/etc/containerd/conf.d/99-nvidia.toml"
RUNC = "io.containerd.runc.v2"
CRI = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
CDI_DIRS = ["/etc/cdi", "/var/run/cdi"]
HEADER = ("# Written by 'nvcontainer setup containerd' (imported by {main}): the runtime handler\n"
          "# 'nvidia' for GPU containers. containerd before 2.0 lets an imported file replace the\n"
          "# whole CRI section, so this holds a copy of the CRI section of {main}: change CRI\n"
          "# settings there and run 'nvcontainer setup containerd' again ('nvcontainer doctor' says\n"
          "# when this copy is out of date). 'nvcontainer setup containerd --undo' removes it.\n")


def layout(main: dict, version: tuple[int, ...] | None, where: str) -> int:
    """The configuration version to write: the main file's (2 or 3), else containerd's own."""
    declared = main.get("version")
    if declared in (2, 3):
        return declared
    if declared is None and not main:
        return 3 if version and version[0] >= 2 else 2
    raise NvcError("setup", f"{escape(where)}: config version {escape(str(declared or 1))}: setup writes version 2 "
                            "(containerd 1.x) or 3 (2.x) drop-ins; migrate the file first "
                            "(containerd config migrate, or start from containerd config default)")


def _imports(main: dict, main_path: str, expand) -> list[str]:
    """The files ``main`` imports, globs expanded as containerd does (sorted), ours left out."""
    files = []
    for pattern in main.get("imports", []) if isinstance(main.get("imports"), list) else []:
        if not isinstance(pattern, str):
            continue
        if not os.path.isabs(pattern):
            pattern = os.path.join(os.path.dirname(main_path), pattern)
        files += [f for f in expand(pattern) if f != DROPIN]
    return files


def effective_cri(main: dict, key: str, main_path: str, read, expand) -> dict:
    """The CRI section containerd 1.x would use without our drop-in: the last file (the main
    one, then its imports in order) that names the plugin wins whole."""
    section = main.get("plugins", {}).get(key, {})
    for path in _imports(main, main_path, expand):
        text = read(path)
        if text is None:
            continue
        found = tomltext.parse(text, path).get("plugins", {}).get(key)
        if isinstance(found, dict):
            section = found
    return copy.deepcopy(section) if isinstance(section, dict) else {}


def dropin(cri: dict, runtime: str, *, default: bool, cdi: bool) -> dict:
    """The CRI section of our drop-in: ``cri`` plus the handler ``nvidia`` (and its options)."""
    cri = copy.deepcopy(cri)
    core = cri.setdefault("containerd", {})
    runtimes = core.setdefault("runtimes", {})
    default_name = core.get("default_runtime_name", "runc")
    if default_name == "runc" and "runc" not in runtimes:
        runtimes["runc"] = {"runtime_type": RUNC}
    base = runtimes.get(default_name, {})
    nvidia = copy.deepcopy(base) if base.get("runtime_type", RUNC) == RUNC else {}
    nvidia["runtime_type"] = RUNC
    nvidia.setdefault("options", {})["BinaryName"] = runtime
    runtimes["nvidia"] = nvidia
    if default:
        core["default_runtime_name"] = "nvidia"
    if cdi:
        cri["enable_cdi"] = True
        cri.setdefault("cdi_spec_dirs", list(CDI_DIRS))
    return cri


def covered(main: dict, main_path: str) -> bool:
    """Whether ``main`` imports our drop-in already (by name or by a glob)."""
    return DROPIN in _imports({"imports": main.get("imports", [])}, main_path, lambda p: _matches(p))


def _matches(pattern: str) -> list[str]:
    import fnmatch

    return [DROPIN] if fnmatch.fnmatch(DROPIN, pattern) else []


def changes(read, expand, runtime: str, version: tuple[int, ...] | None, *, default: bool, cdi: bool) -> tuple:
    """(drop-in write, main-file write or None): what registering the handler takes."""
    main_text = read(MAIN)
    main = tomltext.parse(main_text, MAIN) if main_text is not None else {}
    ver = layout(main, version, MAIN)
    key = CRI[ver]
    cri = dropin(effective_cri(main, key, MAIN, read, expand), runtime, default=default, cdi=cdi)
    text = tomltext.dumps({"version": ver, "plugins": {key: cri}}, HEADER.format(main=MAIN))
    own = WriteFile(DROPIN, text, old=read(DROPIN))
    if covered(main, MAIN):
        return own, None
    base = main_text if main_text is not None else f"version = {ver}\n"
    edited = tomltext.add_import(base, DROPIN, MAIN)
    return own, WriteFile(MAIN, edited, old=main_text, own=False, imports=DROPIN)


def stale(read, expand) -> str | None:
    """Why our drop-in no longer matches ``config.toml`` (None: it does, or there is none): what
    setup would write now, with the drop-in's own choices, against what is there."""
    text, main_text = read(DROPIN), read(MAIN)
    if text is None or main_text is None or not text.startswith(HEADER.format(main=MAIN).splitlines()[0]):
        return None
    try:
        main = tomltext.parse(main_text, MAIN)
        key = CRI[layout(main, None, MAIN)]
        mine = tomltext.parse(text, DROPIN)["plugins"][key]
        runtime = mine["containerd"]["runtimes"]["nvidia"]["options"]["BinaryName"]
        default = mine["containerd"].get("default_runtime_name") == "nvidia"
        expect = dropin(effective_cri(main, key, MAIN, read, expand), runtime, default=default,
                        cdi=mine.get("enable_cdi") is True)
    except NvcError as exc:
        return exc.detail
    except (KeyError, TypeError, AttributeError):
        return f"{DROPIN} is not the drop-in setup writes"
    if mine != expect:
        return f"its CRI section differs from {MAIN}'s (changed since setup)"
    return None
