"""What a container asks for: GPUs, driver capabilities, requirements, MIG and IMEX access.

Two front ends build the same :class:`Request`: the OCI hook from the image's environment and
mounts (:func:`request_from_env`, the table of REFERENCE §6.3) and ``configure`` from its own
options (:func:`request_from_options`). The environment is written by whoever built the image, so
every value is bounded in size and count and every device id is checked against a strict grammar
before anything else sees it. Ids are *not* matched against the host's devices here; that needs
the inventory and happens when devices are selected.
"""

from __future__ import annotations

import os

from ..config.values import CAPABILITIES
from ..errors import NvcError, escape
from .visible import MAX_VALUE, VISIBLE_DEVICES, from_env, legacy_image, read, split as _split
from ..records import record
from . import free, require

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:   # annotations only: collections.abc imports collections, a start's 1 ms
    from collections.abc import Iterable, Mapping

    from ..config.model import Config
    from .oci import Mount

DEFAULT_CAPABILITIES = ("compute", "utility")

MAX_IDS = 1024
IMEX_CHANNEL_LIMIT = 1 << 20
DEVICES_ROOT = "/var/run/nvidia-container-devices"

DRIVER_CAPABILITIES = "NVIDIA_DRIVER_CAPABILITIES"
REQUIRE_PREFIX = "NVIDIA_REQUIRE_"
JETPACK_PREFIX = "NVIDIA_REQUIRE_JETPACK"   # a Tegra CSV switch, not a requirement
IMEX_CHANNELS = "NVIDIA_IMEX_CHANNELS"
MIG_CONFIG = "NVIDIA_MIG_CONFIG_DEVICES"
MIG_MONITOR = "NVIDIA_MIG_MONITOR_DEVICES"
VOLUMES_LABEL = "com.nvidia.volumes.needed"   # nvidia-docker 1 / Mesos image label
DRIVER_VOLUME = "nvidia_driver"

_HEX_ID = r"[0-9a-fA-F][0-9a-fA-F-]{0,35}"
# Patterns are strings, compiled by re on first use (and cached there): most starts match none.
_DEVICE_FORMS = (
    ("index", r"[0-9]{1,5}"),
    ("mig-index", r"[0-9]{1,5}:[0-9]{1,5}"),
    ("bus-id", r"(?:[0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}\.[0-7]"),
    ("mig-legacy", rf"(?i:MIG-GPU-){_HEX_ID}/[0-9]{{1,5}}/[0-9]{{1,5}}"),
    ("gpu-uuid", rf"(?i:GPU-){_HEX_ID}"),
    ("mig-uuid", rf"(?i:MIG-){_HEX_ID}"),
)
_DEVICE_HELP = "an index, GPU-<uuid>, a PCI bus id, MIG-<uuid>, MIG-GPU-<uuid>/<gi>/<ci> or <gpu>:<mig>"
_TRUE = ("1", "t", "T", "TRUE", "true", "True")   # Go's strconv.ParseBool
_SEMVER = (
    r"(0|[1-9][0-9]*)(?:\.(0|[1-9][0-9]*)"
    r"(?:\.(?:0|[1-9][0-9]*)(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?)?)?"
)
# what nvcontainer serve compiles before it forks (serve/server.py preload), so no request does
PATTERNS = (*(pattern for _, pattern in _DEVICE_FORMS), _SEMVER)


@record
class Request:
    """``gpu`` False: not a GPU container, leave it alone. ``devices``: ``"all"``, or the validated
    id tokens in request order; ``()`` with ``gpu`` True is the driver without any GPU (``none``).
    ``warnings`` are for the log: requests that were ignored and why.
    """

    gpu: bool
    devices: tuple[str, ...] | str = ()
    capabilities: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()
    mig_config: str | None = None
    mig_monitor: str | None = None
    imex_channels: tuple[int, ...] = ()
    driver_volume: bool = False
    warnings: tuple[str, ...] = ()

    @property
    def library_groups(self) -> frozenset[str]:
        """Library groups to inject: ``video`` needs the compute libraries, ``display`` the graphics ones."""
        groups = set(self.capabilities) - {"compat32", "display"}
        if "video" in self.capabilities:
            groups.add("compute")
        if "display" in self.capabilities:
            groups.add("graphics")
        return frozenset(groups)

    @property
    def binary_groups(self) -> frozenset[str]:
        """Only ``compute`` and ``utility`` bring binaries; ``video`` brings compute libraries, not MPS."""
        return frozenset(self.capabilities) & {"compute", "utility"}


def device_kind(token: str) -> str | None:
    """Which id form ``token`` is written in, or None if none."""
    if token.isascii() and token.isdigit() and len(token) <= 5:
        return "index"   # the first form, the one most starts ask for: without re (see oci._unusable)
    import re

    for kind, pattern in _DEVICE_FORMS:
        if re.fullmatch(pattern, token):
            return kind
    return None


def _fold(tokens: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(tokens))


def _device_ids(tokens: Iterable[str], source: str) -> tuple[str, ...]:
    ids = _fold(tokens)
    if len(ids) > MAX_IDS:
        raise NvcError("device", f"{source}: {len(ids)} device ids (at most {MAX_IDS})")
    wants_free = free.parse(ids, source)   # free / free:N (issue 26): resolved against the leases
    if wants_free is not None:
        return wants_free
    for token in ids:
        if device_kind(token) is None:
            if "=" in token and "/" in token:
                raise NvcError("device", f"{source}: '{escape(token, 80)}' is a CDI device name; "
                                         "CDI devices are given to containers by a CDI-enabled runtime, not by this hook")
            raise NvcError("device", f"{source}: '{escape(token, 80)}': unknown device (expected {_DEVICE_HELP})")
    return tuple(ids)


def _imex_ids(tokens: Iterable[str], source: str) -> tuple[int, ...]:
    ids = _fold(tokens)
    if len(ids) > MAX_IDS:
        raise NvcError("input", f"{source}: {len(ids)} IMEX channels (at most {MAX_IDS})")
    channels = []
    for token in ids:
        if not (token.isascii() and token.isdigit() and len(token) <= 7 and int(token) < IMEX_CHANNEL_LIMIT):
            raise NvcError("input", f"{source}: unsupported IMEX channel value: {escape(token, 80)}")
        channels.append(int(token))
    return tuple(dict.fromkeys(channels))


def _mig(value: str | None, which: str) -> str | None:
    if value is None or not value.strip():
        return None
    if value.strip() != "all":
        raise NvcError(which, f"only 'all' devices are currently supported, got '{escape(value, 80)}'")
    return "all"


class _Env:
    """Bounded access to the image environment."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env

    def get(self, name: str) -> str | None:
        value = self.env.get(name)
        if value is not None and len(value) > MAX_VALUE:
            raise NvcError("input", f"{escape(name, 80)}: value longer than {MAX_VALUE} characters")
        return value

    def __contains__(self, name: str) -> bool:
        return name in self.env


def _mount_requests(mounts: Iterable["Mount"]) -> tuple[list[str], list[str]]:
    """Device names and IMEX channels requested as ``/dev/null`` mounts under DEVICES_ROOT."""
    devices: list[str] = []
    imex: list[str] = []
    seen = set()
    for m in mounts:
        if os.path.normpath(m.source) != "/dev/null":
            continue
        dest = os.path.normpath(m.destination)
        if dest in seen or not dest.startswith(DEVICES_ROOT + "/"):
            continue
        seen.add(dest)
        name = dest[len(DEVICES_ROOT) + 1:]
        if len(devices) + len(imex) >= MAX_IDS:
            raise NvcError("device", f"volume mounts: more than {MAX_IDS} device requests")
        if name.startswith("imex/"):
            imex.append(name[len("imex/"):])
        elif name.startswith("cdi/"):
            raise NvcError("device", f"volume mount {escape(dest, 120)}: CDI device requests need a CDI-enabled "
                                     "runtime, not this hook")
        else:
            devices.append(name)
    return devices, imex


def _capabilities(env: _Env, config: "Config", legacy: bool) -> tuple[str, ...]:
    supported = config.supported_driver_capabilities
    value = env.get(DRIVER_CAPABILITIES)
    if value is None and legacy:
        return tuple(sorted(supported))
    wanted = _split(value or "")
    if not wanted:
        return tuple(sorted(set(supported) & set(DEFAULT_CAPABILITIES)))
    # an unknown name is an error even beside "all" (upstream lets "all" hide it)
    if any(c not in supported and c != "all" for c in wanted):
        raise NvcError("input", f"unsupported capabilities found in '{escape(value, 120)}' "
                                f"(allowed '{','.join(sorted(supported))}')")
    if "all" in wanted:
        return tuple(sorted(supported))
    return tuple(sorted(set(wanted)))


def _legacy_requirement(cuda_version: str) -> str:
    """``cuda>=MAJOR.MINOR`` from an old image's CUDA_VERSION, read as Go's semver reads it."""
    import re

    m = re.fullmatch(_SEMVER, cuda_version[1:] if cuda_version.startswith("v") else cuda_version)
    if not m or int(m.group(1)) >= 1 << 32 or int(m.group(2) or 0) >= 1 << 32:
        raise NvcError("input", f"CUDA_VERSION: invalid version '{escape(cuda_version, 80)}'")
    return f"cuda>={int(m.group(1))}.{int(m.group(2) or 0)}"


def _requirements(env: _Env, config: "Config", legacy: bool) -> tuple[str, ...]:
    disabled = config.disable_require or env.get("NVIDIA_DISABLE_REQUIRE") in _TRUE
    if disabled:
        return ()
    names = sorted(n for n in env.env if n.startswith(REQUIRE_PREFIX) and not n.startswith(JETPACK_PREFIX))
    if len(names) + legacy > require.MAX_EXPRESSIONS:
        raise NvcError("requirement", f"too many requirements: {len(names) + legacy} {REQUIRE_PREFIX}* "
                                      f"variables (at most {require.MAX_EXPRESSIONS})")
    exprs = []
    for name in names:
        value = env.get(name) or ""   # a name of env.env: never None
        if value.strip():   # an empty requirement asks for nothing
            try:
                require.parse(value)
            except NvcError as exc:
                raise NvcError(exc.category, f"{name}: {exc.detail}") from None
            exprs.append(value)
    if legacy:
        exprs.append(_legacy_requirement(env.get("CUDA_VERSION") or ""))   # legacy: it is set
    return tuple(exprs)


def _wants_driver_volume(annotations: Mapping[str, str]) -> bool:
    value = annotations.get(VOLUMES_LABEL)
    if not isinstance(value, str) or len(value) > MAX_VALUE:
        return False
    return DRIVER_VOLUME in value.replace(",", " ").split()


def request_from_env(environ: Mapping[str, str], config: "Config", *, privileged: bool,
                     mounts: Iterable["Mount"] = (), annotations: Mapping[str, str] | None = None) -> Request:
    """The request an image's environment and mounts make, under the operator's ``config``.

    Nothing but the device list is read from a container that turns out not to be a GPU
    container, so malformed NVIDIA_* values cannot break containers that never asked for a GPU.

    The legacy label ``com.nvidia.volumes.needed=nvidia_driver`` (an annotation) makes a GPU
    container that gets the consolidated driver volume instead of per-file injection; its GPUs
    are still the ones NVIDIA_VISIBLE_DEVICES names (set by the Mesos agent), none without it.
    The label comes from the image, so it is refused exactly when the environment is.
    """
    env = _Env(environ)
    volume = _wants_driver_volume(annotations or {})
    warnings: list[str] = []
    legacy = legacy_image(environ)
    unprivileged_refused = not privileged and not config.accept_envvar_unprivileged
    policy = "accept-nvidia-visible-devices-envvar-when-unprivileged = false"

    mount_devices, mount_imex = _mount_requests(mounts) if config.accept_volume_mounts else ([], [])
    if mount_devices:
        decision, source, env_asked = read(mount_devices), "volume mounts", False
    else:
        visible = from_env(environ, config.swarm_resource)
        decision, source, env_asked = visible.devices, visible.source, True
    if decision is not None and env_asked and unprivileged_refused:
        warnings.append(f"ignoring {source} of an unprivileged container ({policy})")
        decision = None
    if volume and unprivileged_refused:
        warnings.append(f"ignoring {VOLUMES_LABEL} of an unprivileged container ({policy})")
        volume = False
    if decision is None and volume:
        decision = "none"
    if decision is None:
        return Request(gpu=False, warnings=tuple(warnings))
    devices = decision if decision == "all" else () if decision == "none" else _device_ids(decision, source)

    for name in (MIG_CONFIG, MIG_MONITOR):
        if env.get(name) and not privileged:
            raise NvcError("input", f"cannot set {name[len('NVIDIA_'):]} in non privileged container")
    mig_config = _mig(env.get(MIG_CONFIG), "mig-config")
    mig_monitor = _mig(env.get(MIG_MONITOR), "mig-monitor")

    imex: tuple[int, ...]
    if config.ignore_imex_channel_requests:   # [features] ignore-imex-channel-requests
        imex = ()
    elif mount_imex:
        imex = _imex_ids(mount_imex, "volume mounts")
    else:
        imex_value = env.get(IMEX_CHANNELS)
        imex_decision = read(_split(imex_value or ""))
        imex = ()
        if imex_decision == "all":
            warnings.append(f"ignoring {IMEX_CHANNELS}=all: name the channels")
        elif isinstance(imex_decision, tuple):
            if unprivileged_refused:
                warnings.append(f"ignoring {IMEX_CHANNELS} of an unprivileged container ({policy})")
            else:
                imex = _imex_ids(imex_decision, IMEX_CHANNELS)

    return Request(
        gpu=True,
        devices=devices,
        capabilities=_capabilities(env, config, legacy),
        requirements=_requirements(env, config, legacy),
        mig_config=mig_config,
        mig_monitor=mig_monitor,
        imex_channels=imex,
        driver_volume=volume,
        warnings=tuple(warnings),
    )


def request_from_options(*, devices: Iterable[str] = (), capabilities: Iterable[str] = (),
                         requirements: Iterable[str] = (), mig_config: str | None = None,
                         mig_monitor: str | None = None, imex_channels: Iterable[str] = ()) -> Request:
    """The request ``configure``'s options make.

    ``devices`` and ``imex_channels`` are the values of the repeatable ``--device`` and
    ``--imex-channel`` options, each a comma list. ``capabilities`` names the flags given:
    compute, utility, video, graphics, display, ngx, compat32. No ``--device`` is a driver-only
    container. ``all`` ends the device list, as upstream's parser does.
    """
    tokens: list[str] = []
    for value in devices:
        tokens += _split(value)
    selected: tuple[str, ...] | str = ()
    folded = [t.lower() for t in tokens]
    if "all" in folded:   # compared without case, as upstream's parser does
        selected = "all"
        tokens = tokens[:folded.index("all")]
    ids = _device_ids(tokens, "--device")
    caps = set(capabilities)
    unknown = caps - set(CAPABILITIES)
    if unknown:
        raise NvcError("input", f"unknown capability '{escape(sorted(unknown)[0], 40)}'")
    imex_tokens: list[str] = []
    for value in imex_channels:
        imex_tokens += _split(value)
    exprs = tuple(requirements)
    require.parse_all(exprs)
    return Request(
        gpu=True,
        devices=selected if selected == "all" else ids,
        capabilities=tuple(sorted(caps)),
        requirements=exprs,
        mig_config=_mig(mig_config, "mig-config"),
        mig_monitor=_mig(mig_monitor, "mig-monitor"),
        imex_channels=_imex_ids(imex_tokens, "--imex-channel"),
    )
