"""The layout of nvidia-container-toolkit's ``/etc/nvidia-container-runtime/config.toml``: which
key of which table sets which :class:`~.model.Config` field, and which of upstream's keys are
accepted here without an effect.

Why a table of its own: operators replacing NVIDIA's stack keep the file they have. Every key of
upstream's file is known here: a key that nvcontainer uses sets its field (checked by
:mod:`.values`, the error naming ``table.key``); a key that has no effect here (``load-kmods``,
``no-pivot``, ``[nvidia-ctk] path``, most ``[features]``) is accepted and reported, by the
``--debug`` trace, ``nvcontainer config`` and ``doctor``, never silently taken for a setting.
Anything else, a misspelt key or a table nobody declared, is an error, as in the rest of the file:
a room that needs a table of its own (nvcontainer's settings are ``[nvcontainer]``) adds it to
:data:`TABLES` with its keys; no table is accepted by pattern.
"""

from __future__ import annotations

from .. import jsontext
from . import values

RUNTIME = "nvidia-container-runtime"
CDI_MODE = "nvidia-container-runtime.modes.cdi"
LEGACY_MODE = "nvidia-container-runtime.modes.legacy"

# table ("" for the top level) -> key -> (Config field, checker)
TABLES: dict[str, dict[str, tuple]] = {
    "": {
        "disable-require": ("disable_require", values.boolean),
        "swarm-resource": ("swarm_resource", values.env_names),
        "accept-nvidia-visible-devices-envvar-when-unprivileged": ("accept_envvar_unprivileged", values.boolean),
        "accept-nvidia-visible-devices-as-volume-mounts": ("accept_volume_mounts", values.boolean),
        "supported-driver-capabilities": ("supported_driver_capabilities", values.capabilities),
    },
    "nvidia-container-cli": {
        "root": ("root", values.absolute),
        "ldcache": ("ldcache", values.absolute),
        "debug": ("debug", values.absolute),
        "user": ("user", values.user),
        "ldconfig": ("ldconfig", values.ldconfig),
        "no-cgroups": ("no_cgroups", values.boolean),
    },
    RUNTIME: {
        "debug": ("runtime_debug", values.absolute),
        "runtimes": ("runtimes", values.programs),
        "mode": ("mode", values.mode),
    },
    CDI_MODE: {
        "spec-dirs": ("cdi_spec_dirs", values.absolute_list),
        "default-kind": ("cdi_default_kind", values.cdi_kind),
        "annotation-prefixes": ("cdi_annotation_prefixes", values.annotation_prefixes),
    },
    LEGACY_MODE: {
        "cuda-compat-mode": ("cuda_compat_mode", values.compat_mode),
    },
    "nvidia-container-runtime-hook": {
        "path": ("hook_path", values.program),
    },
    "features": {
        "ignore-imex-channel-requests": ("ignore_imex_channel_requests", values.boolean),
    },
    # nvcontainer's own settings, which upstream's file has no place for
    "nvcontainer": {
        "deadline": ("deadline", values.deadline),
        "cache-dir": ("cache_dir", values.absolute),
        "driver-volume-dir": ("driver_volume_dir", values.absolute),
        "allowed-devices": ("allowed_devices", values.device_tokens),
        "exclusive-gpus": ("exclusive_gpus", values.boolean),
        "lease-wait-seconds": ("lease_wait_seconds", values.wait_seconds),
    },
}

# Tables kept raw for the room that owns them, which checks them key by key (the device plugin's
# settings: :mod:`nvcontainer.deviceplugin.settings`): the hook reads this file on every start and
# must neither pay for nor fail on settings it never uses.
RAW: dict[str, str] = {"device-plugin": "device_plugin"}

# Upstream's keys that change nothing here, and why (said whenever one is set).
INERT: dict[str, dict[str, str]] = {
    "nvidia-container-cli": {
        "path": "nvcontainer does the CLI's work itself",
        "environment": "no CLI program is run with an environment",
        "load-kmods": "nvcontainer never loads kernel modules",
        "no-pivot": "the ldconfig sandbox needs no pivot choice",
    },
    RUNTIME: {
        "log-level": "the debug trace has one level",
    },
    "nvidia-container-runtime.modes.csv": {
        "mount-spec-path": "Tegra CSV mode is not supported",
        "compat-container-root": "Tegra CSV mode is not supported",
    },
    "nvidia-container-runtime.modes.jit-cdi": {
        "nvcdi-feature-flags": "no CDI spec is generated at container start",
        "nvcdi-disable-hooks": "no CDI spec is generated at container start",
    },
    "nvidia-container-runtime-hook": {
        "skip-mode-detection": "the hook does not check the runtime's mode",
    },
    "nvidia-ctk": {
        "path": "nvcontainer's commands replace nvidia-ctk's",
    },
    "features": {
        "allow-cuda-compat-libs-from-container": "cuda-compat-mode alone decides",
        "allow-ldconfig-from-container": "an image's ldconfig is never run",
        "allow-unknown-oci-spec-fields": "unknown OCI spec fields are always left as they are",
        "disable-cuda-compat-lib-hook": "there is no such hook; cuda-compat-mode decides",
        "disable-imex-channel-creation": "IMEX channels are never created",
        "no-additional-gids-for-device-nodes": "device nodes are bound from the host as they are",
    },
}

# nvcontainer's earlier layout: every key at the top level of /etc/nvcontainer/config.toml.
# Still read, in either file, so existing installs keep working; a key set both ways is an error.
FLAT: dict[str, tuple[str, str]] = {
    **{key: ("nvidia-container-cli", key) for key in TABLES["nvidia-container-cli"]},
    "cuda-compat-mode": (LEGACY_MODE, "cuda-compat-mode"),
    **{key: ("nvcontainer", key) for key in TABLES["nvcontainer"]},
}


def is_table(path: str) -> bool:
    """Whether ``path`` is a table of the layout, or a table holding one (``nvidia-container-runtime.modes``)."""
    return any(t == path or t.startswith(path + ".") for t in (*TABLES, *INERT) if t)


def where(table: str, key: str) -> str:
    """How a key is named in messages: ``key`` at the top level, else ``table.key``."""
    return f"{table}.{key}" if table else key


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return jsontext.dumps(value)   # a TOML basic string for what these settings hold


def render(config) -> str:
    """The effective settings in the toolkit's layout, each with where its value came from (a
    file, a command-line option or the default); an unset setting is a comment. Pure."""
    head = [f"# {line}" for line in config.report()]
    lines = head + ["# (from: where each value came from)"]
    for table, keys in TABLES.items():
        if table:
            lines += ["", f"[{table}]"]
        for key, (name, _check) in keys.items():
            value = getattr(config, name)
            origin = config.origin(name)
            if value is None:
                lines.append(f"# {key} is unset ({UNSET[name]})  # from: {origin}")
            else:
                lines.append(f"{key} = {_toml(value)}  # from: {origin}")
    for table, name in RAW.items():
        raw = getattr(config, name)
        if raw is not None:
            lines += ["", f"[{table}]  # from: {config.origin(name)}; checked by the command that uses it"]
            lines += [f"{key} = {_toml(value)}" for key, value in raw.items()]
    return "\n".join(lines) + "\n"


UNSET = {
    "debug": "no trace",
    "user": "NVML loads as the kernel's overflow ids",
    "runtime_debug": "no trace",
    "hook_path": "the served client where setup --serve built it, else nvidia-container-runtime-hook",
    "allowed_devices": "every device",
}
