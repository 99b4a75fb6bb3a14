"""Request IDs + the device table + the strategy → what a container gets. Pure.

Why this is the one place IDs from the kubelet are read: they come over a socket, and although
the kubelet only repeats what we advertised, a bug, a stale checkpoint after a reconfiguration or
anything else that can reach the socket may send anything. So every ID is bounded, looked up in
the table (never parsed into a path, an index or a shell word) and reported escaped; what goes
into the response is built from the table's own values only.

The response tells the runtime which GPUs the container has, in the ways NVIDIA's plugin does
(``device-list-strategy``; several may be combined):

* ``envvar``: ``NVIDIA_VISIBLE_DEVICES=<ids>``, for a runtime that runs the hook;
* ``volume-mounts``: ``/dev/null`` mounted at ``/var/run/nvidia-container-devices/<id>`` and
  ``NVIDIA_VISIBLE_DEVICES`` pointing there, which an image cannot forge (the hook needs
  ``accept-nvidia-visible-devices-as-volume-mounts = true``);
* ``cdi-annotations``: ``cdi.k8s.io/…`` annotations naming CDI devices, for CRI-O and containerd;
* ``cdi-cri``: the CRI's own ``CDIDevices`` field (the kubelet from 1.29, or 1.28 with its feature
  gate; containerd 2, CRI-O).

Time-sliced replicas ``<id>::<k>`` name the same GPU; the container is given each GPU once.
With ``sharing = "mps"`` a container gets one replica, and with it what the GPU's MPS daemon
needs (:mod:`.mps`): the pipe directory and ``/dev/shm`` mounted, ``CUDA_MPS_PIPE_DIRECTORY``
and the client limits.
"""

from __future__ import annotations

from ..errors import escape
from ..records import record
from ..request.decide import DEVICES_ROOT, VISIBLE_DEVICES
from . import mps
from .devices import Advertised, Resource
from .settings import Settings

MAX_IDS = 1024                 # more than any node has devices (64 GPUs x 7 MIG x replicas is checked)
MAX_ID_TEXT = 128
ANNOTATION_NAME = "nvcontainer-device-plugin_"
DEV_NULL = "/dev/null"


class Refused(Exception):
    """A request the plugin will not answer: ``code`` is ``invalid`` (malformed, unknown IDs) or
    ``unhealthy`` (a device the plugin says is unhealthy); ``message`` is safe to log and send."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@record
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = True


@record
class ContainerResponse:
    envs: tuple[tuple[str, str], ...] = ()
    mounts: tuple[MountSpec, ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    cdi_devices: tuple[str, ...] = ()


def look_up(ids, resource: Resource, what: str = "device") -> list[Advertised]:
    """The table's entries for ``ids`` (duplicates once, in order), or :class:`Refused` naming the
    first ID that is not a string, too long, or not advertised by ``resource``."""
    ids = list(ids)
    if len(ids) > MAX_IDS:
        raise Refused("invalid", f"{len(ids)} {what} IDs in one request (at most {MAX_IDS})")
    found: dict[str, Advertised] = {}
    for device_id in ids:
        if not isinstance(device_id, str) or len(device_id) > MAX_ID_TEXT:
            raise Refused("invalid", f"{what} ID {escape(device_id, 80)}: not a device ID")
        entry = resource.by_id.get(device_id)
        if entry is None:
            raise Refused("invalid", f"unknown {what} {escape(device_id, 80)} for {resource.name}")
        found.setdefault(device_id, entry)
    return list(found.values())


def allocate(ids, resource: Resource, unhealthy: frozenset[str], settings: Settings,
             response_id: str, shares: dict | None = None) -> ContainerResponse:
    """The answer for one container's ``devices_ids``. ``unhealthy``: IDs now advertised as
    Unhealthy; ``response_id`` (unique per response) keys the CDI annotation; ``shares``: GPU
    UUID → :class:`mps.Share` with ``sharing = "mps"``."""
    entries = look_up(ids, resource)
    if not entries:
        raise Refused("invalid", f"no device IDs in the request for {resource.name}")
    bad = [e.id for e in entries if e.id in unhealthy]
    if bad:
        raise Refused("unhealthy", f"device {escape(bad[0], 80)} of {resource.name} is unhealthy"
                                   + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    if settings.replicas > 1 and settings.fail_requests_greater_than_one and len(entries) > 1:
        raise Refused("invalid", f"request for {len(entries)} shared {resource.name} devices: at most 1 "
                                 "(fail-requests-greater-than-one)")
    share = None
    if shares:
        if len(entries) > 1:
            raise Refused("invalid", f"request for {len(entries)} {resource.name} replicas with sharing = mps: "
                                     "at most 1 (a container talks to one GPU's MPS daemon)")
        share = shares.get(entries[0].unit.gpu.uuid)
        if share is None:
            raise Refused("invalid", f"device {escape(entries[0].id, 80)} is not shared by MPS")
    tokens = list(dict.fromkeys(e.unit.token(settings.device_id_strategy) for e in entries))
    strategies = settings.device_list_strategy
    envs: dict[str, str] = {}
    mounts: list[MountSpec] = []
    annotations: dict[str, str] = {}
    cdi: list[str] = []
    if "envvar" in strategies:
        envs[VISIBLE_DEVICES] = ",".join(tokens)
    if "volume-mounts" in strategies:
        envs[VISIBLE_DEVICES] = DEVICES_ROOT
        mounts = [MountSpec(f"{DEVICES_ROOT}/{t}", DEV_NULL) for t in tokens]
    names = [f"{settings.cdi_kind}={t}" for t in tokens]
    if "cdi-annotations" in strategies:
        annotations[f"{settings.cdi_annotation_prefix}{ANNOTATION_NAME}{response_id}"] = ",".join(names)
    if "cdi-cri" in strategies:
        cdi = names
    if share is not None:
        envs.update(mps.client_env(share))
        mounts += [MountSpec(inside, host, read_only=False)
                   for inside, host in mps.client_mounts(share, settings.mps_root)]
    return ContainerResponse(tuple(envs.items()), tuple(mounts), tuple(annotations.items()), tuple(cdi))
