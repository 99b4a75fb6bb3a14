"""Which CDI devices a container asks for, by name: ``vendor/class=device``.

Three places can carry them, read in upstream's order, the first that has any wins:
annotations with a configured prefix (``cdi.k8s.io/<anything>: nvidia.com/gpu=0,...``, set by
the device plugin through the CRI), ``/dev/null`` volume mounts under
``/var/run/nvidia-container-devices/cdi/`` (with ``accept-nvidia-visible-devices-as-volume-mounts``),
and ``NVIDIA_VISIBLE_DEVICES`` (or the swarm variables), read as the hook reads it
(:mod:`..request.visible`: ``ALL`` is ``all``, ``void`` and ``none`` ask for no CDI device) and
under the same unprivileged policy. Pure: plain data in, names out. In ``cdi`` mode an unqualified id from the
environment is a device of ``default-kind`` (``0`` is ``nvidia.com/gpu=0``); in ``auto`` mode
only an environment of nothing but CDI names asks for CDI devices, anything else is the hook's
(:mod:`..request.decide`).
"""

from __future__ import annotations

import os
import re

from ..config.model import Config
from ..errors import NvcError, escape
from ..records import record
from ..request import visible
from ..request.decide import DEVICES_ROOT, MAX_IDS, MAX_VALUE
from ..request.oci import Spec

_NAME = re.compile(r"[A-Za-z](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?/[A-Za-z](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
                   r"=[A-Za-z0-9](?:[A-Za-z0-9_.:-]{0,126}[A-Za-z0-9])?")


@record
class Asked:
    names: tuple[str, ...]          # fully qualified, in request order, once each
    source: str                     # where they came from, for messages
    warnings: tuple[str, ...] = ()


def qualified(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def _checked(names: list[str], source: str) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(names))
    if len(out) > MAX_IDS:
        raise NvcError("cdi", f"{source}: {len(out)} CDI devices (at most {MAX_IDS})")
    for name in out:
        if not qualified(name):
            raise NvcError("cdi", f"{source}: '{escape(name, 80)}' is not a CDI device name (vendor/class=device)")
    return out


def _from_annotations(spec: Spec, config: Config) -> Asked | None:
    names, keys = [], []
    for key, value in spec.annotations.items():
        if any(key.startswith(p) for p in config.cdi_annotation_prefixes):
            if len(value) > MAX_VALUE:
                raise NvcError("cdi", f"annotation {escape(key, 80)}: value longer than {MAX_VALUE} characters")
            names += visible.split(value)
            keys.append(key)
    if not keys:
        return None
    return Asked(_checked(names, f"annotation {escape(keys[0], 80)}"), "annotations")


def _from_mounts(spec: Spec, config: Config) -> Asked | None:
    if not config.accept_volume_mounts:
        return None
    prefix = f"{DEVICES_ROOT}/cdi/"
    names = []
    for m in spec.mounts:
        dest = os.path.normpath(m.destination)
        if os.path.normpath(m.source) != "/dev/null" or not dest.startswith(prefix):
            continue
        rest = dest[len(prefix):]
        if "=" not in rest:   # cdi/<vendor>/<class>/<device>
            vendor_class, _, device = rest.rpartition("/")
            rest = f"{vendor_class}={device}"
        names.append(rest)
    return Asked(_checked(names, "volume mounts"), "volume mounts") if names else None


def _from_env(spec: Spec, config: Config, mode: str) -> Asked | None:
    # the hook's reading (request.visible): ALL is all, void or none is no CDI device
    asked_for = visible.from_env(spec.environ(), config.swarm_resource)
    if asked_for.devices in (None, visible.NONE):
        return None
    tokens = [visible.ALL] if asked_for.devices == visible.ALL else list(asked_for.devices)
    if mode == "auto" and not all(qualified(t) for t in tokens):
        return None
    source = asked_for.source
    if not spec.privileged and not config.accept_envvar_unprivileged:
        return Asked((), source, (f"ignoring {source} of an unprivileged container "
                                  "(accept-nvidia-visible-devices-envvar-when-unprivileged = false)",))
    kind = config.cdi_default_kind
    return Asked(_checked([t if "=" in t else f"{kind}={t}" for t in tokens], source), source)


def asked(spec: Spec, config: Config, mode: str) -> Asked | None:
    """The CDI devices ``spec`` asks for in ``mode`` (``cdi`` or ``auto``), or None if none."""
    return _from_annotations(spec, config) or _from_mounts(spec, config) or _from_env(spec, config, mode)
