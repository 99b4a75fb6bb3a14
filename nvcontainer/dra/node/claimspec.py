"""A prepared claim as a transient CDI spec, and back. Pure: text in, text out.

Why a spec per claim: the kubelet answers NodePrepareResources with CDI names, and the runtime
resolves them in the spec directories when the pod's containers start, maybe much later, maybe
twice (two pods sharing the claim). Names scoped by the claim's UID (vendor
``k8s.gpu.nvidia.com``, class ``claim``, device ``<claimUID>-<device>``, as NVIDIA's driver)
cannot collide with another claim's or with the node's own ``nvidia.com/gpu`` spec, and
unpreparing the claim is deleting one file.

The edits are the ones ``nvcontainer cdi generate`` makes, from the same generator: the
generator is asked for a spec of only the claim's devices (an allow-list of them), named by
UUID, and the devices are renamed. So the driver's files, the control nodes and our CDI hooks
are the spec's common edits, and each device carries its own nodes.

The spec is YAML with the claim's record (namespace, name, UID, devices, sharing settings) as
one JSON comment line: the checkpoint can be rebuilt from the spec directory alone, and the
spec keeps ``cdiVersion`` at what its content needs (an annotation would raise it to 0.6.0,
past what podman 4.3 reads).
"""

from __future__ import annotations

import json
import re

from ...cdi import generate, yamltext
from ...cdi.spec import Spec
from ...documents import json_value
from ...errors import NvcError, escape
from ...records import replace
from ...request.selection import AllowList

VENDOR = "k8s.gpu.nvidia.com"
CLASS = "claim"
KIND = f"{VENDOR}/{CLASS}"
PREFIX = f"{VENDOR}-{CLASS}_"
SUFFIX = ".yaml"
RECORD = "nvcontainer-dra-claim:"
MAX_RECORD = 1 << 16
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")   # whole: fullmatch ("x\n" passed ^...$)


def check_uid(uid: str) -> str:
    """Claim UIDs are Kubernetes UIDs (RFC 4122 text); anything else is refused before it
    becomes part of a file or device name."""
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise NvcError("input", f"claim UID {escape(str(uid), 80)}: not a UID")
    return uid


def file_name(uid: str) -> str:
    return f"{PREFIX}{check_uid(uid)}{SUFFIX}"


def uid_of(name: str) -> str | None:
    """The claim UID a spec file of ours is named for, or None for any other file."""
    if name.startswith(PREFIX) and name.endswith(SUFFIX):
        uid = name[len(PREFIX):-len(SUFFIX)]
        return uid if _UID.fullmatch(uid) else None
    return None


def cdi_name(uid: str, device: str) -> str:
    return f"{KIND}={uid}-{device}"


def build(inv, claim, opts: generate.Options) -> Spec:
    """The spec of one resolved claim (:class:`claims.Claim`, at least one unit)."""
    allow = AllowList(gpus=frozenset(u.gpu.index for u in claim.units if u.mig is None),
                      migs=frozenset((u.mig.parent, u.mig.index) for u in claim.units if u.mig is not None))
    base = generate.generate(inv, replace(opts, vendor=VENDOR, cls=CLASS, strategies=("uuid",), all_device=False,
                                          allow=allow))
    by_uuid = {d.name: d for d in base.devices}
    devices = []
    for unit in dict((u.device, u) for u in claim.units).values():
        device = by_uuid.get(unit.uuid)
        if device is None:
            raise NvcError("cdi", f"device {escape(unit.device, 80)} ({unit.uuid}): no CDI edits for it")
        devices.append(replace(device, name=f"{claim.uid}-{unit.device}"))
    return replace(base, devices=tuple(devices))


def render(spec: Spec, entry: dict, driver_version: str) -> str:
    """The spec's YAML, with ``entry`` (the claim's record, ``PreparedClaim.to_json()``) as its
    comment."""
    comments = ["Written by nvcontainer dra-driver for one prepared ResourceClaim; removed when the kubelet "
                "unprepares it.", f"{generate.DRIVER_COMMENT} {driver_version}",
                f"{RECORD} {json.dumps(entry, sort_keys=True, separators=(',', ':'))}"]
    return yamltext.dump(spec.to_dict(), comments)


def record_of(text: str) -> dict | None:
    """The claim's record from a spec's text (its JSON, for ``PreparedClaim.from_json``), or None
    when it has none (or a damaged one)."""
    for line in text.splitlines()[:8]:
        line = line.lstrip("# ").rstrip()
        if line.startswith(RECORD):
            try:
                entry = json_value(line[len(RECORD):], "record", cap=MAX_RECORD)
            except NvcError:
                return None
            return entry if isinstance(entry, dict) else None
    return None
