"""NVML facts, gathered in a short-lived child process.

Why a child: NVML is vendor code loaded into our address space; it can hang for seconds when
persistence mode is off, crash, or start threads. Upstream isolates it in an RPC helper for the
same reasons. Ours is a plain ``fork()``: the child drops to an unprivileged identity (``--user``,
default the kernel's overflow ids), loads ``libnvidia-ml.so.1`` from the path the driver root's
ld cache gave us, asks its questions through pynvml and writes plain JSON to a pipe. The parent
stays single-threaded (it later forks namespace workers) and bounds the wait with a deadline.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time

from ..errors import NvcError, escape

MAX_REPLY = 4 << 20
MAX_GPUS = 256
MAX_PROCESSES = 4096


def query(lib_path: str, user: tuple[int, int] | None, deadline: float = 30.0) -> dict:
    """Ask NVML about the driver and every GPU; see :func:`_collect` for the shape."""
    return _ask(lib_path, user, deadline, _collect)


def activity(lib_path: str, user: tuple[int, int] | None, deadline: float = 30.0) -> dict:
    """Ask NVML what runs on each GPU now; see :func:`_activity` for the shape. Never cached:
    ``nvcontainer ps`` shows the moment it is run."""
    return _ask(lib_path, user, deadline, _activity)


def _ask(lib_path: str, user: tuple[int, int] | None, deadline: float, collect) -> dict:
    rfd, wfd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # child
        os.close(rfd)
        code = 0
        try:
            reply = _child(lib_path, user, parent, collect)
        except BaseException as exc:  # anything at all must come back as data, not a traceback
            reply = {"error": ["initialization", f"nvml error: {escape(exc)}"]}
            code = 1
        try:
            data = json.dumps(reply).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(wfd, view):]
        finally:
            os._exit(code)
    os.close(wfd)
    try:
        data = _read_until(rfd, pid, time.monotonic() + deadline)
    finally:
        os.close(rfd)
    try:
        reply = json.loads(data)
    except ValueError:
        raise NvcError("initialization", "driver rpc error: the NVML helper died without an answer") from None
    if "error" in reply:
        raise NvcError(*reply["error"])
    return reply


def _read_until(fd: int, pid: int, end: float) -> bytes:
    chunks, size = [], 0
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise NvcError("initialization", "driver rpc error: timed out")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_REPLY:
                raise NvcError("initialization", "driver rpc error: reply too large")
            chunks.append(chunk)
    finally:
        _reap(pid)
    return b"".join(chunks)


def _reap(pid: int) -> None:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    except PermissionError:
        # The helper runs as another user and this process lacks CAP_KILL (a device plugin
        # container with only the capabilities it needs): it has answered and is exiting on
        # its own, so wait a little for it, and leave it to be reaped later if it lingers.
        _wait_briefly(pid)


def _wait_briefly(pid: int, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] != 0:
                return
        except ChildProcessError:
            return
        time.sleep(0.01)


def _child(lib_path: str, user: tuple[int, int] | None, parent: int, collect) -> dict:
    import ctypes

    # Import everything before dropping privileges: the interpreter's own files may not be
    # readable by the unprivileged identity (a Python under /root, say).
    import pynvml

    become(user, parent)
    try:
        # Loading by full path first means pynvml's own CDLL("libnvidia-ml.so.1") is satisfied
        # by this object (glibc matches loaded objects by SONAME), not by the system search path.
        ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return {"error": ["initialization", f"load library failed: {escape(exc)}"]}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"error": ["initialization", f"nvml error: {_nvml_text(exc)}"]}
    try:
        return collect(pynvml)
    except pynvml.NVMLError as exc:
        return {"error": ["detection", f"nvml error: {_nvml_text(exc)}"]}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def become(user: tuple[int, int] | None, parent: int) -> None:
    """Drop to ``user`` (when root), then die with ``parent``: in that order, as a change of
    identity clears the parent-death signal. Shared by this module's child and the metrics
    sampler (:mod:`.sampler`), so there is one way NVML's process gives up its privileges.
    prctl is imported before the drop: the unprivileged identity may not be able to read the
    installation (a package unpacked under a root-only directory; found on a real GPU node)."""
    import prctl  # noqa: F401  (_die_with_parent's, after the drop)

    if user is not None and os.geteuid() == 0:
        uid, gid = user
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _die_with_parent(parent)


def _die_with_parent(parent: int) -> None:
    """The parent may have died before the signal was armed: then getppid() names whoever
    adopted us. Compared with the parent's pid, not with 1: a container's entrypoint (the device
    plugin in its DaemonSet) is pid 1, and its children are nobody's orphans."""
    import prctl

    prctl.set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _nvml_text(exc) -> str:
    return escape(str(exc)).lower()


def _collect(nv) -> dict:
    """Plain data: driver version, CUDA version (int, e.g. 12040) and one dict per GPU."""
    gpus = []
    count = nv.nvmlDeviceGetCount()
    for index in range(min(count, MAX_GPUS)):
        h = nv.nvmlDeviceGetHandleByIndex(index)
        pci = nv.nvmlDeviceGetPciInfo(h)
        cc = nv.nvmlDeviceGetCudaComputeCapability(h)
        gpu = {
            "index": index,
            "minor": nv.nvmlDeviceGetMinorNumber(h),
            "name": _text(nv.nvmlDeviceGetName(h)),
            "brand": nv.nvmlDeviceGetBrand(h),
            "uuid": _text(nv.nvmlDeviceGetUUID(h)),
            "bus": [pci.domain, pci.bus, pci.device],
            "cc": list(cc),
            "mig_capable": False,
            "mig_enabled": False,
            "migs": [],
        }
        try:
            current, _pending = nv.nvmlDeviceGetMigMode(h)
            gpu["mig_capable"] = True
            gpu["mig_enabled"] = current == nv.NVML_DEVICE_MIG_ENABLE
        except nv.NVMLError:
            pass
        memory = _memory(nv, h)
        if memory:
            gpu["memory"] = memory
        if gpu["mig_enabled"]:
            gpu["migs"] = _migs(nv, h)
        try:   # for doctor: persistence set with nvidia-smi -pm 1 serves as well as the daemon
            gpu["persistence"] = nv.nvmlDeviceGetPersistenceMode(h) == nv.NVML_FEATURE_ENABLED
        except nv.NVMLError:
            gpu["persistence"] = None
        gpus.append(gpu)
    return {
        "driver_version": _text(nv.nvmlSystemGetDriverVersion()),
        "cuda_version": nv.nvmlSystemGetCudaDriverVersion(),
        "gpus": gpus,
    }


def _activity(nv) -> dict:
    """Per GPU (by UUID): its running processes (pid, used memory in bytes or None, compute or
    graphics, SM utilisation in percent or None) and its utilisation rates (None where the
    driver does not sample them)."""
    return {"gpus": [gpu_activity(nv, nv.nvmlDeviceGetHandleByIndex(index))
                     for index in range(min(nv.nvmlDeviceGetCount(), MAX_GPUS))]}


def gpu_activity(nv, h) -> dict:
    """One GPU's entry of :func:`_activity` (the metrics sampler asks it per GPU too)."""
    procs: dict[int, dict] = {}
    for kind, getter in (("compute", "nvmlDeviceGetComputeRunningProcesses"),
                         ("graphics", "nvmlDeviceGetGraphicsRunningProcesses")):
        for p in _versioned(nv, getter, h)[:MAX_PROCESSES]:
            seen = procs.setdefault(int(p.pid), {"pid": int(p.pid), "memory": None, "kinds": [], "sm": None})
            seen["kinds"].append(kind)
            if p.usedGpuMemory is not None:
                seen["memory"] = max(seen["memory"] or 0, int(p.usedGpuMemory))
    try:
        for sample in nv.nvmlDeviceGetProcessUtilization(h, 0)[:MAX_PROCESSES]:
            seen = procs.get(int(sample.pid))
            if seen is not None:   # one sample per pid and period; keep the largest
                seen["sm"] = max(seen["sm"] or 0, int(sample.smUtil))
    except nv.NVMLError:
        pass
    gpu = {"uuid": _text(nv.nvmlDeviceGetUUID(h)), "processes": list(procs.values()),
           "utilization": None, "memory_utilization": None}
    try:
        rates = nv.nvmlDeviceGetUtilizationRates(h)
        gpu["utilization"], gpu["memory_utilization"] = int(rates.gpu), int(rates.memory)
    except nv.NVMLError:
        pass
    return gpu


def _versioned(nv, name: str, h) -> list:
    """The _v3 entry point, else _v2 (drivers before 510); nothing where neither answers."""
    for suffix in ("_v3", "_v2"):
        try:
            return getattr(nv, name + suffix)(h)
        except nv.NVMLError_FunctionNotFound:
            continue
        except nv.NVMLError:
            return []
    return []


def _migs(nv, h) -> list[dict]:
    migs = []
    for slot in range(min(nv.nvmlDeviceGetMaxMigDeviceCount(h), 64)):
        try:
            m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)
        except nv.NVMLError:
            continue
        mig = {
            "index": len(migs),
            "uuid": _text(nv.nvmlDeviceGetUUID(m)),
            "name": _text(nv.nvmlDeviceGetName(m)),
            "gi": nv.nvmlDeviceGetGpuInstanceId(m),
            "ci": nv.nvmlDeviceGetComputeInstanceId(m),
        }
        memory = _memory(nv, m)
        if memory:
            mig["memory"] = memory
        try:   # the GPU instance's profile and placement: DRA's device names (dra/names.py)
            info = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceGetGpuInstanceById(h, mig["gi"]))
            mig["profile_id"] = int(info.profileId)
            mig["placement"] = [int(info.placement.start), int(info.placement.size)]
        except nv.NVMLError:
            pass
        try:
            a = nv.nvmlDeviceGetAttributes(m)
            mig["engines"] = [int(v) for v in (a.multiprocessorCount, a.sharedCopyEngineCount, a.sharedDecoderCount,
                                               a.sharedEncoderCount, a.sharedJpegCount, a.sharedOfaCount)]
            mig["attributes"] = [[name, int(getattr(a, field))] for name, field in _ATTRIBUTES]   # node labels
        except nv.NVMLError:
            pass
        migs.append(mig)
    return migs


def _memory(nv, handle) -> int:
    """Total framebuffer bytes; 0 when NVML does not say (DRA's capacity, MPS's per-client limit)."""
    try:
        return int(nv.nvmlDeviceGetMemoryInfo(handle).total)
    except nv.NVMLError:
        return 0


# nvmlDeviceAttributes_t's fields, as the inventory names them
_ATTRIBUTES = (("memory_mb", "memorySizeMB"), ("multiprocessors", "multiprocessorCount"),
               ("slices_gi", "gpuInstanceSliceCount"), ("slices_ci", "computeInstanceSliceCount"),
               ("copy_engines", "sharedCopyEngineCount"), ("decoders", "sharedDecoderCount"),
               ("encoders", "sharedEncoderCount"), ("jpegs", "sharedJpegCount"), ("ofas", "sharedOfaCount"))


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
