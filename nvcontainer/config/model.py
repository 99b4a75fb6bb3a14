"""The operator's settings as the code uses them: one immutable :class:`Config`.

Where the values come from (the configuration file, the global command-line options) and how
each is checked lives beside this module (:mod:`.load`, :mod:`.values`); everything else only
reads a :class:`Config`.
"""

from __future__ import annotations

import os

from ..records import field, record, replace
from .values import CAPABILITIES, absolute, path, user as user_value


@record
class Config:
    root: str = "/"
    ldcache: str = "/etc/ld.so.cache"
    debug: str | None = None
    user: str | None = None
    ldconfig: str = "@/sbin/ldconfig"
    no_cgroups: bool = False
    supported_driver_capabilities: tuple[str, ...] = CAPABILITIES
    disable_require: bool = False
    swarm_resource: tuple[str, ...] = ()
    accept_envvar_unprivileged: bool = True
    accept_volume_mounts: bool = False
    cuda_compat_mode: str = "ldconfig"
    deadline: float = 20   # well under the 60 s timeout of the shipped registrations
    cache_dir: str = "/run/nvcontainer"
    driver_volume_dir: str = "/var/lib/nvcontainer/volumes"
    allowed_devices: tuple[str, ...] | None = None
    exclusive_gpus: bool = False          # explicit requests take leases and are refused a held GPU
    lease_wait_seconds: float = 0         # how long free:N waits for GPUs to come free
    device_plugin: dict | None = field(default=None, hash=False)   # raw [device-plugin] table
    # the runtime shim (nvidia-container-runtime)
    runtime_debug: str | None = None
    runtimes: tuple[str, ...] = ("runc", "crun")
    mode: str = "auto"
    cdi_spec_dirs: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")
    cdi_default_kind: str = "nvidia.com/gpu"
    cdi_annotation_prefixes: tuple[str, ...] = ("cdi.k8s.io/",)
    hook_path: str | None = None          # unset: the served client where setup installed it, else the hook
    ignore_imex_channel_requests: bool = False
    # where the values came from (not part of the settings: equal configs compare equal)
    source: str | None = field(default=None, compare=False)       # the file read, if any
    origins: tuple[tuple[str, str], ...] = field(default=(), compare=False)   # field -> file or option
    inert: tuple[str, ...] = field(default=(), compare=False)     # upstream keys set here to no effect
    note: str | None = field(default=None, compare=False)         # which file won, when both exist

    def origin(self, name: str) -> str:
        """Where field ``name``'s value came from: a file, a command-line option, or "default"."""
        return dict(self.origins).get(name, "default")

    def report(self) -> list[str]:
        """Lines for the --debug trace and doctor: the file read, which one won, and every
        upstream key that is accepted here but changes nothing."""
        lines = [f"configuration: {self.source or 'none found, defaults'}"]
        if self.note:
            lines.append(self.note)
        lines += [f"{self.source}: {what}" for what in self.inert]
        return lines

    def with_overrides(self, *, root: str | None = None, ldcache: str | None = None,
                       debug: str | None = None, user: str | None = None) -> "Config":
        """This config with the global command-line options that were given (not None) applied."""
        changes = {}
        if root is not None:
            changes["root"] = absolute(root, "--root")
        if ldcache is not None:
            changes["ldcache"] = absolute(ldcache, "--ldcache")
        if debug is not None:
            changes["debug"] = path(debug, "--debug")
        if user is not None:
            changes["user"] = user_value(user, "--user")
        if not changes:
            return self
        origins = dict(self.origins) | {name: f"--{name}" for name in changes}
        return replace(self, **changes, origins=tuple(origins.items()))

    def ldconfig_program(self) -> str:
        """The host path of the ldconfig a run executes: :func:`host_ldconfig` of ``ldconfig``."""
        return host_ldconfig(self.ldconfig).removeprefix("@")


LDCONFIG = "/sbin/ldconfig"
LDCONFIG_REAL = "/sbin/ldconfig.real"


def host_ldconfig(value: str, exists=os.path.exists) -> str:
    """``value`` (``@PATH`` or a bare host path), with /sbin/ldconfig read as /sbin/ldconfig.real
    where the host has that, as nvidia-container-toolkit normalises it.

    Why: on Ubuntu, /sbin/ldconfig is a shell script that execs the binary beside it. Only a
    static binary runs in the sandbox (no interpreter of the host is taken into the container),
    so the default would refuse every GPU container there with "not an ELF file"."""
    if value.removeprefix("@") == LDCONFIG and exists(LDCONFIG_REAL):
        return value.replace(LDCONFIG, LDCONFIG_REAL, 1)
    return value
