"""The metrics sampler: a child program that holds NVML open and answers one round per request.

    python -I -m nvcontainer.inventory.sampler   (JSON lines on stdin and stdout)

Why a resident program and not :mod:`.nvml`'s short-lived child: a scrape comes every few
seconds, and NVML's start costs up to a second on a node without persistence mode; GPM ratios and
the last XID need state kept between rounds. Why a program (fork and exec) and not a fork: the
metrics server is threaded. It drops its privileges as :mod:`.nvml`'s child does
(:func:`.nvml.become`), asks the per-GPU questions of :mod:`.readings` and, for the processes,
the same :func:`.nvml.gpu_activity` as ``nvcontainer ps``.

The first line on stdin: ``{"library": path, "user": [uid, gid] or null, "gpus": [the GPUs'
UUIDs in NVML's index order, the inventory's]}``; nothing is asked of a GPU before its turn in a
round (a hung one must not hang the start). Then each line
``{"skip": [uuid, ...]}`` asks for one round: a line per GPU, written as soon as that GPU has
answered, ``{"gpu": uuid, "readings": {...}, "gpm": {...}, "migs": {uuid: {...}}, "activity":
{...}, "mps": [...], "xid": n}`` or ``{"gpu": uuid, "error": text}`` (that GPU fell off the bus),
then ``{"end": true}``. A GPU in ``skip`` is not asked (the parent saw it hang). One GPU hung in
the driver stops the round there: the parent sees which one by what came back and kills this
program at its deadline.
"""

from __future__ import annotations

import json
import os
import sys

MAX_REQUEST = 1 << 16
MAX_GPUS = 256
XID_EVENT = 0x8        # nvmlEventTypeXidCriticalError


def main() -> int:
    parent = os.getppid()
    try:
        request = json.loads(sys.stdin.buffer.readline(MAX_REQUEST))
        library, user, gpus = request["library"], request.get("user"), request["gpus"][:MAX_GPUS]
        if not isinstance(library, str) or not (user is None or (isinstance(user, list) and len(user) == 2)) \
                or not all(isinstance(g, str) for g in gpus):
            raise ValueError("bad request")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return _fail(f"bad request: {exc}")
    try:
        return _serve(library, user, gpus, parent)
    except BrokenPipeError:
        return 0
    except Exception as exc:   # anything at all comes back as one line, never a traceback
        return _fail(f"{type(exc).__name__}: {exc}")


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _fail(why: str) -> int:
    try:
        _emit({"error": why[:500]})
    except OSError:
        pass
    return 1


def _serve(library: str, user, uuids: list[str], parent: int) -> int:
    import ctypes

    import pynvml as nv   # imported before dropping privileges: the interpreter's files may be root's

    from . import nvml, readings

    nvml.become(None if user is None else (int(user[0]), int(user[1])), parent)
    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)   # pynvml's own CDLL then finds this object
    nv.nvmlInit()
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(min(nv.nvmlDeviceGetCount(), len(uuids)))]
    xids = _Xids(nv)
    gpms: dict[str, object] = {}
    _emit({"ready": len(handles)})
    for line in sys.stdin.buffer:
        try:
            skip = set(json.loads(line[:MAX_REQUEST]).get("skip", ()))
        except (ValueError, AttributeError, TypeError):
            return _fail("bad request line")
        last = xids.drain()
        for uuid, h in zip(uuids, handles):
            if uuid in skip:
                continue
            xids.register(uuid, h)
            _emit(_one(nv, readings, nvml, uuid, h, gpms, last.get(uuid, 0)))
        _emit({"end": True})
    return 0


def _one(nv, readings, nvml, uuid: str, h, gpms: dict, xid: int) -> dict:
    try:
        nv.nvmlDeviceGetPciInfo(h)   # a GPU off the bus answers GPU_IS_LOST here, first
    except nv.NVMLError as exc:
        gpms.pop(uuid, None)
        return {"gpu": uuid, "error": _text(str(exc)).lower()}
    entry = {"gpu": uuid, "readings": readings.device(nv, h), "xid": xid,
             "activity": nvml.gpu_activity(nv, h), "mps": readings.mps_clients(nv, h)}
    gpm = gpms.get(uuid)
    if gpm is None:
        try:
            gpm = gpms[uuid] = readings.Gpm(nv, h)
        except Exception:
            gpm = gpms[uuid] = False
    if gpm:
        try:
            entry["gpm"] = gpm.ratios()
        except Exception:
            gpms.pop(uuid, None)
    entry["migs"] = _migs(nv, readings, h)
    return entry


def _migs(nv, readings, h) -> dict:
    out = {}
    try:
        count = nv.nvmlDeviceGetMaxMigDeviceCount(h)
        current, _pending = nv.nvmlDeviceGetMigMode(h)
    except Exception:
        return out
    if current != nv.NVML_DEVICE_MIG_ENABLE:
        return out
    for slot in range(min(count, 64)):
        try:
            m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
            out[_text(nv.nvmlDeviceGetUUID(m))] = readings.memory(nv, m)
        except Exception:
            continue
    return out


class _Xids:
    """The last XID per GPU, from an NVML event set drained at each round (0: none seen)."""

    def __init__(self, nv):
        self.nv, self.last, self.by_address, self.tried = nv, {}, {}, set()
        self.events = None
        try:
            self.events = nv.nvmlEventSetCreate()
        except Exception:
            return

    def register(self, uuid: str, h) -> None:
        """At the GPU's first turn (once, whether NVML lets it or not)."""
        import ctypes

        if self.events is None or uuid in self.tried:
            return
        self.tried.add(uuid)
        try:
            if self.nv.nvmlDeviceGetSupportedEventTypes(h) & XID_EVENT:
                self.nv.nvmlDeviceRegisterEvents(h, XID_EVENT, self.events)
                self.by_address[ctypes.cast(h, ctypes.c_void_p).value] = uuid
        except Exception:
            pass

    def drain(self) -> dict:
        import ctypes

        if self.events is None:
            return self.last
        for _ in range(1024):
            try:
                data = self.nv.nvmlEventSetWait_v2(self.events, 0)
            except Exception:   # NVML_ERROR_TIMEOUT: nothing pending
                break
            uuid = self.by_address.get(ctypes.cast(data.device, ctypes.c_void_p).value)
            if uuid is not None and data.eventType & XID_EVENT:
                self.last[uuid] = int(data.eventData)
        return self.last


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


if __name__ == "__main__":
    sys.exit(main())
