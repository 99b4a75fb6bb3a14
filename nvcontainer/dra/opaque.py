"""A claim's opaque device configuration, as NVIDIA's DRA driver takes it: ``GpuConfig`` and
``MigDeviceConfig`` of ``resource.nvidia.com/v1beta1``, checked field by field. Pure.

Why so strict: the parameters are written by whoever writes the claim (or its DeviceClass), and
NVIDIA's driver decodes them with a strict decoder: an unknown field or a value out of range is
an error that names it, never silently ignored (a misspelt ``mpsConfg`` must not give a pod an
unshared GPU it thinks is limited). The shapes are NVIDIA's, so claims written for its driver
work unchanged:

* ``GpuConfig``: ``sharing: {strategy: TimeSlicing | MPS, timeSlicingConfig: {interval:
  Default | Short | Medium | Long}, mpsConfig: {...}}``;
* ``MigDeviceConfig``: ``sharing: {strategy, mpsConfig}`` (no time-slice interval on MIG);
* ``mpsConfig``: ``defaultActiveThreadPercentage`` (0-100), ``defaultPinnedDeviceMemoryLimit``
  (a quantity), ``defaultPerDevicePinnedMemoryLimit`` (device index or UUID → quantity); a
  limit must come to at least 1 MiB, as NVIDIA's driver requires.

Which configuration applies to a device follows NVIDIA's driver: the class's entries, then the
claim's, the last that names the device's request (or names no request and fits the device's
type) wins; naming a request whose device is of the other type is an error.
"""

from __future__ import annotations

import math
import re

from ..errors import NvcError, escape
from ..records import record

DRIVER = "gpu.nvidia.com"
API_VERSION = "resource.nvidia.com/v1beta1"
KINDS = {"GpuConfig": "gpu", "MigDeviceConfig": "mig"}
NOT_SUPPORTED = ("VfioDeviceConfig", "ComputeDomainChannelConfig", "ComputeDomainDaemonConfig")
STRATEGIES = ("TimeSlicing", "MPS")
INTERVALS = ("Default", "Short", "Medium", "Long")
SOURCES = ("FromClass", "FromClaim")
MIB = 1 << 20
# Kubernetes' quantity grammar: a signed number, then a binary or decimal SI suffix or a signed
# decimal exponent ("+1Gi", "1.5Mi", "1500m", "1e9", "5E-3").
_QUANTITY = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)|[eE]([+-]?[0-9]+))?")
_SUFFIX = {"": (1, 1), "m": (1, 1000), "Ki": (1 << 10, 1), "Mi": (1 << 20, 1), "Gi": (1 << 30, 1),
           "Ti": (1 << 40, 1), "Pi": (1 << 50, 1), "Ei": (1 << 60, 1), "k": (10 ** 3, 1), "M": (10 ** 6, 1),
           "G": (10 ** 9, 1), "T": (10 ** 12, 1), "P": (10 ** 15, 1), "E": (10 ** 18, 1)}
QUANTITY_CHARS = 40        # longer text is no quantity anyone writes
QUANTITY_MAX = 1 << 63     # 8Ei: past any memory, and Kubernetes' own int64 value
_EXPONENT_SPAN = 60        # |exponent| past this: the value is past QUANTITY_MAX, or under 1


@record
class Sharing:
    """One device's settings. ``strategy`` "": none asked (the device is the claim's alone, or
    shared by the pods of the claim with the driver's defaults)."""

    kind: str = "gpu"                 # the config's type: "gpu" or "mig"
    strategy: str = ""                # "", "TimeSlicing" or "MPS"
    interval: str = ""                # TimeSlicing: one of INTERVALS
    active_threads: int | None = None               # MPS: percent
    pinned_limit: int | None = None                 # MPS: bytes, every device
    per_device_limits: tuple[tuple[str, int], ...] = ()   # MPS: (index or UUID, bytes)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "strategy": self.strategy, "interval": self.interval,
                "activeThreads": self.active_threads, "pinnedLimit": self.pinned_limit,
                "perDeviceLimits": [list(p) for p in self.per_device_limits]}


@record
class Entry:
    requests: tuple[str, ...]
    sharing: Sharing
    where: str                        # for messages: "config[2]"


def entries(configs, driver: str = DRIVER) -> list[Entry]:
    """The allocation's ``devices.config`` list → this driver's entries, class ones first."""
    if configs is None:
        return []
    if not isinstance(configs, list):
        raise NvcError("input", "status.allocation.devices.config: not a list")
    by_source: dict[str, list[Entry]] = {s: [] for s in SOURCES}
    for i, item in enumerate(configs):
        where = f"config[{i}]"
        _object(item, where, ("source", "requests", "opaque"))
        source = item.get("source")
        if source not in SOURCES:
            raise NvcError("input", f"{where}.source: {_show(source)}: expected {' or '.join(SOURCES)}")
        opaque = item.get("opaque")
        if opaque is None:
            raise NvcError("input", f"{where}: only opaque parameters are supported by this driver")
        _object(opaque, f"{where}.opaque", ("driver", "parameters"))
        if opaque.get("driver") != driver:
            continue                  # a request may be satisfiable by several drivers
        requests = item.get("requests") or []
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            raise NvcError("input", f"{where}.requests: not a list of names")
        sharing = parse(opaque.get("parameters"), f"{where}.opaque.parameters")
        by_source[source].append(Entry(tuple(requests), sharing, where))
    return by_source["FromClass"] + by_source["FromClaim"]


def parse(params, where: str = "parameters") -> Sharing:
    """One ``GpuConfig`` or ``MigDeviceConfig`` object."""
    if not isinstance(params, dict):
        raise NvcError("input", f"{where}: not an object")
    if params.get("apiVersion") != API_VERSION:
        raise NvcError("input", f"{where}.apiVersion: {_show(params.get('apiVersion'))}: expected {API_VERSION}")
    kind = params.get("kind")          # before the fields: each kind has its own
    if kind in NOT_SUPPORTED:
        raise NvcError("input", f"{where}.kind: kind {kind} is not supported by nvcontainer's driver")
    if kind not in KINDS:
        raise NvcError("input", f"{where}.kind: kind {_show(kind)} is not supported: expected GpuConfig or "
                                "MigDeviceConfig")
    _object(params, where, ("apiVersion", "kind", "sharing"))
    sharing = params.get("sharing")
    if sharing is None:
        return Sharing(kind=KINDS[kind])
    here = f"{where}.sharing"
    mig = kind == "MigDeviceConfig"
    _object(sharing, here, ("strategy", "mpsConfig") if mig else ("strategy", "timeSlicingConfig", "mpsConfig"))
    strategy = sharing.get("strategy")
    if strategy not in STRATEGIES:
        raise NvcError("input", f"{here}.strategy: {_show(strategy)}: expected {' or '.join(STRATEGIES)}")
    if strategy == "TimeSlicing":
        if sharing.get("mpsConfig") is not None:
            raise NvcError("input", f"{here}.mpsConfig: cannot be used with the TimeSlicing strategy")
        interval = "Default"
        ts = sharing.get("timeSlicingConfig")
        if ts is not None:
            _object(ts, f"{here}.timeSlicingConfig", ("interval",))
            interval = ts.get("interval", "Default")
            if interval not in INTERVALS:
                raise NvcError("input", f"{here}.timeSlicingConfig.interval: {_show(interval)}: expected "
                                        f"{', '.join(INTERVALS)}")
        return Sharing(kind=KINDS[kind], strategy=strategy, interval="" if mig else interval)
    if sharing.get("timeSlicingConfig") is not None:
        raise NvcError("input", f"{here}.timeSlicingConfig: cannot be used with the MPS strategy")
    return _mps(sharing.get("mpsConfig"), f"{here}.mpsConfig", KINDS[kind])


def _mps(mps, where: str, kind: str) -> Sharing:
    if mps is None:
        return Sharing(kind=kind, strategy="MPS")
    _object(mps, where, ("defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit",
                         "defaultPerDevicePinnedMemoryLimit"))
    threads = mps.get("defaultActiveThreadPercentage")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= 100):
        raise NvcError("input", f"{where}.defaultActiveThreadPercentage: {_show(threads)}: expected an integer "
                                "from 0 to 100")
    limit = mps.get("defaultPinnedDeviceMemoryLimit")
    if limit is not None:
        limit = _limit(limit, f"{where}.defaultPinnedDeviceMemoryLimit")
    per = mps.get("defaultPerDevicePinnedMemoryLimit") or {}
    if not isinstance(per, dict):
        raise NvcError("input", f"{where}.defaultPerDevicePinnedMemoryLimit: not a map of device to quantity")
    limits = tuple((str(k), _limit(v, f"{where}.defaultPerDevicePinnedMemoryLimit.{escape(str(k), 60)}"))
                   for k, v in sorted(per.items()))
    return Sharing(kind=kind, strategy="MPS", active_threads=threads, pinned_limit=limit, per_device_limits=limits)


def quantity(value) -> int:
    """A Kubernetes quantity (``40Gi``, ``+512M``, ``1e9``, a number) in bytes, rounded up.

    Bounded before it is computed: the text is at most QUANTITY_CHARS long and an exponent
    is never raised to (``1e10000000`` is ten characters and would be a ten-million-digit
    integer, computed on the event loop); a value past QUANTITY_MAX either way is refused.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("not a quantity")
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) > QUANTITY_MAX:
            raise ValueError("out of range")
        return math.ceil(value)
    if isinstance(value, int):
        if abs(value) > QUANTITY_MAX:
            raise ValueError("out of range")
        return value
    if len(value) > QUANTITY_CHARS:
        raise ValueError("not a quantity")
    m = _QUANTITY.fullmatch(value.strip())
    if not m:
        raise ValueError("not a quantity")
    sign, number, suffix, exponent = m.groups()
    whole, _, frac = number.partition(".")
    numerator = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
    denominator = 10 ** len(frac)
    if exponent is not None:
        power = int(exponent)
        if numerator and power > _EXPONENT_SPAN:
            raise ValueError("out of range")
        power = max(power, -_EXPONENT_SPAN)   # under 1 either way: rounds up to 1 (or 0)
        scale_num, scale_den = (10 ** power, 1) if power >= 0 else (1, 10 ** -power)
    else:
        scale_num, scale_den = _SUFFIX[suffix or ""]
    amount = -(-numerator * scale_num // (denominator * scale_den))
    if amount > QUANTITY_MAX:
        raise ValueError("out of range")
    return -amount if sign == "-" else amount


def _limit(value, where: str) -> int:
    try:
        amount = quantity(value)
    except ValueError as err:
        if str(err) == "out of range":
            raise NvcError("input", f"{where}: {_show(value)}: out of range (at most 8Ei)") from None
        raise NvcError("input", f"{where}: {_show(value)}: not a quantity (e.g. 10Gi)") from None
    if amount < MIB:
        raise NvcError("input", f"{where}: {_show(value)}: must be at least 1Mi")
    return amount


def choose(items: list[Entry], request: str, device: str, kind: str) -> Sharing:
    """The entry that applies to one allocated device (``kind``: "gpu" or "mig"), or the
    default (no sharing asked)."""
    parent = request.split("/", 1)[0]
    for entry in reversed(items):
        if request in entry.requests or parent in entry.requests:
            if entry.sharing.kind != kind:
                config = "GpuConfig" if entry.sharing.kind == "gpu" else "MigDeviceConfig"
                what = "a MIG device" if kind == "mig" else "a GPU"
                raise NvcError("input", f"{entry.where}: cannot apply {config} to device {escape(device, 80)} "
                                        f"(request {escape(request, 80)}), {what}")
            return entry.sharing
        if not entry.requests and entry.sharing.kind == kind:
            return entry.sharing
    return Sharing(kind=kind)


def check_devices(sharing: Sharing, uuids: list[str], where: str) -> None:
    """MPS per-device limits must name devices of the claim: an index into ``uuids`` or one of
    them (NVIDIA's driver refuses other keys too)."""
    for key, _ in sharing.per_device_limits:
        index = device_index(key)
        if key in uuids or (index is not None and index < len(uuids)):
            continue
        raise NvcError("input", f"{where}.defaultPerDevicePinnedMemoryLimit: {escape(key, 60)}: names no device "
                                f"of the claim (an index below {len(uuids)} or a UUID)")


def device_index(key: str) -> int | None:
    """A per-device limit's key as a device index, or None: ASCII digits only (``"²"`` passes
    ``isdigit`` and then ``int`` raises), and few of them (no claim has a million devices)."""
    if len(key) <= 6 and key.isascii() and key.isdigit():
        return int(key)
    return None


def _object(value, where: str, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, dict):
        raise NvcError("input", f"{where}: not an object")
    unknown = sorted(k for k in value if k not in allowed)
    if unknown:
        raise NvcError("input", f"{where}.{escape(str(unknown[0]), 60)}: unknown field")


def _show(value) -> str:
    return escape(repr(value) if not isinstance(value, str) else value, 60)
