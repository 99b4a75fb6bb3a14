"""The installer's settings, from its options and from the environment NVIDIA's toolkit installer
reads, so a DaemonSet written for ``nvidia-ctk-installer`` keeps its meaning here.

Why NVIDIA's names: the GPU Operator's values (``toolkit.env``) and operators' own manifests set
``RUNTIME``, ``CONTAINERD_SET_AS_DEFAULT``, ``RUNTIME_RESTART_MODE`` and the rest; an installer
that ignored them would do something else than what its manifest says, without a word. Each
setting has one canonical variable and the per-engine aliases NVIDIA reads; a value that is not
understood is one line naming the variable, before anything on the host is touched.

Pure: a mapping of variables and a mapping of given options in, :class:`Settings` out.
"""

from __future__ import annotations

import os

from ..errors import NvcError, escape
from ..records import record, replace

ENGINES = ("containerd", "crio", "docker")
RESTART_MODES = ("signal", "systemd", "none")
DEFAULT_INSTALL_DIR = "/usr/local/nvcontainer"
# where the programs go when the default's file system is read-only (Bottlerocket-like roots)
FALLBACK_DIRS = ("/opt/nvcontainer", "/var/lib/nvcontainer/install")
READY_FILE = "/run/nvcontainer/validations/toolkit-ready"
LOCK_FILE = "/run/nvcontainer/installer.lock"
CDI_OUTPUT = "/var/run/cdi/nvidia.yaml"
SOCKETS = {"containerd": "/run/containerd/containerd.sock", "crio": "/var/run/crio/crio.sock",
           "docker": "/var/run/docker.sock"}
CONFIGS = {"containerd": "/etc/containerd/config.toml", "crio": "/etc/crio/crio.conf.d/99-nvidia.toml",
           "docker": "/etc/docker/daemon.json"}
DROP_INS = {"containerd": "/etc/containerd/conf.d/99-nvidia.toml", "crio": "/etc/crio/crio.conf.d/99-nvidia.toml"}
# the paths NVIDIA's installer defaults to, accepted as meaning "the engine's usual files"
NVIDIA_DEFAULTS = {("crio", "config"): ("/etc/crio/crio.conf",)}
RESTART_DEFAULTS = {"containerd": "signal", "crio": "systemd", "docker": "signal"}
UNITS = {"containerd": "containerd", "crio": "crio", "docker": "docker"}

# setting -> the variables that give it, the first one found wins; "{E}" is the engine's name as
# NVIDIA spells it in its per-engine variables (CONTAINERD_, DOCKER_, CRIO_)
VARIABLES = {
    "runtime": ("RUNTIME",),
    "host_root": ("HOST_ROOT_MOUNT",),
    "install_dir": ("TOOLKIT_INSTALL_DIR", "NVCONTAINER_INSTALL_DIR"),
    "config": ("RUNTIME_CONFIG", "{E}_CONFIG"),
    "drop_in": ("RUNTIME_DROP_IN_CONFIG", "RUNTIME_DROP_IN_CONFIG_HOST_PATH"),
    "socket": ("RUNTIME_SOCKET", "{E}_SOCKET"),
    "restart_mode": ("RUNTIME_RESTART_MODE", "{E}_RESTART_MODE"),
    "runtime_name": ("NVIDIA_RUNTIME_NAME", "{E}_RUNTIME_CLASS", "{E}_RUNTIME_NAME"),
    "set_as_default": ("NVIDIA_RUNTIME_SET_AS_DEFAULT", "{E}_SET_AS_DEFAULT"),
    "cdi": ("RUNTIME_ENABLE_CDI", "CDI_ENABLED"),
    "no_cleanup": ("NO_CLEANUP_ON_EXIT",),
    "no_runtime_config": ("NO_RUNTIME_CONFIG",),
    "no_daemon": ("NO_DAEMON",),
    "driver_root": ("NVIDIA_DRIVER_ROOT", "DRIVER_ROOT"),
    "ready_file": ("NVCONTAINER_READY_FILE",),
    "source": ("NVCONTAINER_SOURCE",),
    "serve": ("NVCONTAINER_SERVE",),
    "cdi_refresh": ("NVCONTAINER_CDI_REFRESH",),
    "restart_timeout": ("RUNTIME_RESTART_TIMEOUT",),
}
BOOLEANS = {"set_as_default", "cdi", "no_cleanup", "no_runtime_config", "no_daemon", "serve"}
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


@record
class Settings:
    runtime: str = "containerd"
    host_root: str = "/host"           # where the host's / is mounted in the installer's container
    install_dir: str = DEFAULT_INSTALL_DIR   # on the host
    config: str = ""                   # the engine's main file, on the host
    drop_in: str = ""
    socket: str = ""
    restart_mode: str = ""
    runtime_name: str = "nvidia"
    set_as_default: bool = True        # NVIDIA's default
    cdi: bool = False
    no_cleanup: bool = False
    no_runtime_config: bool = False
    no_daemon: bool = False
    driver_root: str = "/"             # on the host
    ready_file: str = READY_FILE
    source: str = ""                   # the tree to install; "" = this installation's
    serve: bool = False                # run the installed server from the installer's process
    cdi_refresh: float = 60.0          # seconds between CDI spec refreshes
    restart_timeout: float = 60.0      # seconds the engine has to come back

    def on_host(self, path: str) -> str:
        """Where a host path is from the installer's view (under the host root's mount)."""
        return os.path.join(self.host_root, path.lstrip("/"))


def _bool(name: str, value: str) -> bool:
    low = value.strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise NvcError("input", f"{name}='{escape(value, 40)}': not a boolean (true or false)")


def _number(name: str, value: str) -> float:
    try:
        n = float(value)
    except ValueError:
        n = -1.0
    if not 0 < n <= 86400:
        raise NvcError("input", f"{name}='{escape(value, 40)}': not a number of seconds (0 to 86400)")
    return n


def _absolute(name: str, value: str) -> str:
    if not value.startswith("/") or "\n" in value or any(p == ".." for p in value.split("/")):
        raise NvcError("input", f"{name}='{escape(value, 80)}': not an absolute path without '..'")
    return os.path.normpath(value)


def _from_env(env: dict[str, str], engine: str) -> dict[str, tuple[str, str]]:
    """setting -> (variable, value) for each setting the environment gives."""
    prefix = {"containerd": "CONTAINERD", "docker": "DOCKER", "crio": "CRIO"}.get(engine, "")
    found = {}
    for key, names in VARIABLES.items():
        for name in names:
            name = name.replace("{E}", prefix)
            if name in env:
                found[key] = (name, env[name])
                break
    return found


def settings(env: dict[str, str], options: dict[str, object]) -> Settings:
    """Options (``--runtime`` ...; None = not given) over the environment over the defaults."""
    engine = options.get("runtime") or env.get("RUNTIME", "containerd")
    if engine not in ENGINES:
        raise NvcError("input", f"RUNTIME='{escape(str(engine), 40)}': one of {', '.join(ENGINES)}")
    given: dict[str, tuple[str, object]] = {k: v for k, v in _from_env(env, engine).items()}
    for key, value in options.items():
        if value is not None:
            given[key] = ("--" + key.replace("_", "-"), value)
    values: dict[str, object] = {"runtime": engine}
    for key, (name, value) in given.items():
        if key == "runtime":
            continue
        if key in BOOLEANS:
            values[key] = value if isinstance(value, bool) else _bool(name, str(value))
        elif key in ("cdi_refresh", "restart_timeout"):
            values[key] = _number(name, str(value))
        elif key == "restart_mode":
            if value not in RESTART_MODES:
                raise NvcError("input", f"{name}='{escape(str(value), 40)}': one of {', '.join(RESTART_MODES)}")
            values[key] = value
        elif key == "runtime_name":
            if value != "nvidia":
                raise NvcError("input", f"{name}='{escape(str(value), 40)}': nvcontainer registers the runtime "
                                        "handler 'nvidia' only (the RuntimeClass of deploy/kubernetes names it)")
            values[key] = value
        else:
            values[key] = _absolute(name, str(value))
    s = Settings(**values)
    fixed = {"config": CONFIGS[engine], "drop_in": DROP_INS.get(engine, "")}
    for key, path in fixed.items():   # setup writes the engines' usual files (NVIDIA's defaults too)
        value = getattr(s, key)
        if value and value != path and value not in NVIDIA_DEFAULTS.get((engine, key), ()):
            name = given[key][0]
            raise NvcError("input", f"{name}='{escape(value, 80)}': nvcontainer writes {engine}'s "
                                    f"{'drop-in' if key == 'drop_in' else 'configuration'} at {path or 'none'} only")
    return replace(s, config=fixed["config"], drop_in=fixed["drop_in"], socket=s.socket or SOCKETS[engine],
                   restart_mode=s.restart_mode or RESTART_DEFAULTS[engine])
