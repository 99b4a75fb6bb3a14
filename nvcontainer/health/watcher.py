"""The health watcher: a child program that holds NVML's event set and reports what it sees.

    python -I -m nvcontainer.health.watcher   (a JSON request on stdin; JSON lines on stdout)

Why a separate program: NVML is vendor code that starts threads, can hang in the driver and can
crash, and the plugin is a multi-threaded gRPC server, where ``fork()`` without ``exec`` is not
safe. So the plugin starts this module with ``subprocess`` (an ``exec``: nothing of the server's
threads or locks comes along), with a fixed environment and no inherited descriptors, and treats
it as disposable: if it stops beating, it is killed and started again later.

It reads one JSON object from stdin: ``{"library": path of libnvidia-ml.so.1, "gpus": [GPU
UUIDs], "user": [uid, gid] or null, "interval": seconds}``, drops to ``user``, loads NVML from
that path, registers every GPU for NVML's events and writes one JSON object per line:

* ``{"ev": "ready", "unwatched": {uuid: why}}`` once the event set is armed;
* ``{"ev": "topology", "nvlink": [[uuid, uuid, links]], "pcie": [[uuid, uuid, level]]}`` once;
* ``{"ev": "event", "gpu": uuid, "type": n, "data": n, "gi": n, "ci": n}`` for each NVML event;
* ``{"ev": "beat", "lost": [uuid, ...]}`` every ``interval``: it is alive, and these GPUs did not
  answer a query (or NVML could not find them when it started);
* ``{"ev": "error", "why": text}`` before it exits on an NVML failure.

It decides nothing: which events matter is the plugin's business (``health.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time

from ..documents import json_value
from ..errors import NvcError
from ..inventory import nvml

MAX_REQUEST = 1 << 20
MAX_GPUS = 256
EVENT_MASK = 0x1 | 0x2 | 0x8        # single-bit ECC, double-bit ECC, XID critical (as upstream)
MAX_LINKS = 36                      # NVML_NVLINK_MAX_LINKS


def main() -> int:
    parent = os.getppid()
    try:
        request = json_value(sys.stdin.buffer.read(MAX_REQUEST + 1), "request", cap=MAX_REQUEST)
        library, gpus = request["library"], request["gpus"][:MAX_GPUS]
        user, interval = request.get("user"), float(request["interval"])
        if not (isinstance(library, str) and all(isinstance(g, str) for g in gpus) and 0.01 <= interval <= 60):
            raise ValueError("bad request")
    except NvcError as exc:
        return _fail(f"bad request: {exc.detail}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return _fail(f"bad request: {exc}")
    try:
        return _watch(library, gpus, user, interval, parent)
    except BrokenPipeError:
        return 0
    except Exception as exc:   # anything at all comes back as one line, never a traceback
        return _fail(f"{type(exc).__name__}: {exc}")


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _fail(why: str) -> int:
    try:
        _emit({"ev": "error", "why": why[:500]})
    except OSError:
        pass
    return 1


def _watch(library: str, uuids: list[str], user, interval: float, parent: int) -> int:
    import ctypes

    import pynvml as nv   # imported before dropping privileges: the interpreter's files may be root's

    # the one way NVML's process gives up its privileges, then dies with the plugin
    nvml.become(None if user is None else (int(user[0]), int(user[1])), parent)
    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)   # pynvml's own CDLL then finds this object
    nv.nvmlInit()
    handles = {}
    unwatched = {}
    missing = []          # GPUs NVML cannot find (lost before we started): lost in every beat
    for uuid in uuids:
        try:
            handles[uuid] = nv.nvmlDeviceGetHandleByUUID(uuid)
        except nv.NVMLError as exc:
            unwatched[uuid] = str(exc)
            missing.append(uuid)
    try:
        events = nv.nvmlEventSetCreate()
    except nv.NVMLError as exc:      # a driver without the event API (NVIDIA's plugins: health checks off)
        _emit({"ev": "no-events", "why": f"nvmlEventSetCreate: {exc}"})
        return 0
    for uuid, handle in handles.items():
        try:
            supported = nv.nvmlDeviceGetSupportedEventTypes(handle)
            nv.nvmlDeviceRegisterEvents(handle, EVENT_MASK & supported, events)
        except nv.NVMLError as exc:
            unwatched[uuid] = str(exc)
    _emit({"ev": "ready", "unwatched": unwatched})
    _emit(_topology(nv, handles))
    by_address = {}
    last_beat = 0.0
    wait_ms = max(10, int(interval * 1000))
    while True:
        now = time.monotonic()
        if now - last_beat >= interval:
            _emit({"ev": "beat", "lost": missing + _lost(nv, handles)})
            last_beat = now
        try:
            data = nv.nvmlEventSetWait_v2(events, max(10, min(wait_ms, int((last_beat + interval - now) * 1000))))
        except nv.NVMLError as exc:
            if exc.value == nv.NVML_ERROR_TIMEOUT:
                continue
            return _fail(f"nvmlEventSetWait: {exc}")
        address = ctypes.cast(data.device, ctypes.c_void_p).value
        uuid = by_address.get(address)
        if uuid is None:
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(data.device))
            except nv.NVMLError:
                uuid = ""
            by_address[address] = uuid
        _emit({"ev": "event", "gpu": uuid, "type": data.eventType, "data": data.eventData,
               "gi": data.gpuInstanceId, "ci": data.computeInstanceId})


def _lost(nv, handles: dict) -> list[str]:
    lost = []
    for uuid, handle in handles.items():
        try:
            nv.nvmlDeviceGetPciInfo(handle)
        except nv.NVMLError:
            lost.append(uuid)
    return lost


def _topology(nv, handles: dict) -> dict:
    """NVLinks between watched GPUs, and the PCIe common ancestor of every pair."""
    by_bus = {}
    for uuid, handle in handles.items():
        try:
            by_bus[_bus(nv.nvmlDeviceGetPciInfo(handle).busId)] = uuid
        except nv.NVMLError:
            pass
    links: dict[tuple[str, str], int] = {}
    for uuid, handle in handles.items():
        for link in range(MAX_LINKS):
            try:
                if not nv.nvmlDeviceGetNvLinkState(handle, link):
                    continue
                remote = by_bus.get(_bus(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
            except nv.NVMLError:
                break
            if remote is not None and remote != uuid:
                key = (min(uuid, remote), max(uuid, remote))
                links[key] = links.get(key, 0) + 1
    pcie = []
    items = list(handles.items())
    for i, (a, ha) in enumerate(items):
        for b, hb in items[i + 1:]:
            try:
                pcie.append([a, b, nv.nvmlDeviceGetTopologyCommonAncestor(ha, hb)])
            except nv.NVMLError:
                pass
    # each link is seen from both ends
    return {"ev": "topology", "nvlink": [[a, b, n // 2 or n] for (a, b), n in sorted(links.items())],
            "pcie": pcie}


def _bus(value) -> str:
    return _text(value).lower()


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


if __name__ == "__main__":
    sys.exit(main())
