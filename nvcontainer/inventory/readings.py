"""What NVML says a GPU is doing now: the values the metrics endpoint exports, read per device.

Only the metrics sampler (:mod:`.sampler`, a child program that dropped its privileges) calls
these; each takes the pynvml module and a device handle and returns plain numbers under our own
names (the metrics layer maps them to dcgm-exporter's). A value the driver does not give (an
NVML error of any kind) is simply absent, so one unsupported getter never costs the others.

GPM (Hopper and later): the profiling ratios are the difference between two samples of the
device's counters. The sampler keeps each GPU's last sample, so a scrape's ratios cover the time
since the previous scrape, as DCGM's do; the very first scrape takes a pair ``GPM_FIRST_GAP``
apart.
"""

from __future__ import annotations

import time

GPM_FIRST_GAP = 0.1    # seconds between the first two GPM samples of a GPU
NVLINKS = 18           # NVML_NVLINK_MAX_LINKS on the drivers that have NVLink throughput fields
FIELD_MEMORY_TEMP = 82
FIELD_NVLINK_TX, FIELD_NVLINK_RX = 138, 139   # KiB, per link

# our name → NVML_GPM_METRIC_* id, and how the ratio is scaled (NVML gives percent; DCGM ratios)
GPM_METRICS = {
    "gr_engine_active": (1, 0.01), "sm_active": (2, 0.01), "sm_occupancy": (3, 0.01),
    "tensor_active": (5, 0.01), "dram_active": (10, 0.01), "fp64_active": (11, 0.01),
    "fp32_active": (12, 0.01), "fp16_active": (13, 0.01),
    "pcie_tx_bytes": (20, float(1 << 20)), "pcie_rx_bytes": (21, float(1 << 20)),   # MiB/s → bytes/s
}


def _try(out: dict, name: str, fn, *args, scale: float | None = None) -> None:
    try:
        value = fn(*args)
    except Exception:   # an NVMLError of any kind, or a getter this pynvml lacks
        return
    out[name] = value * scale if scale is not None else value


def device(nv, h) -> dict:
    """Every per-GPU reading NVML gives for this handle."""
    out: dict = {}
    _try(out, "sm_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
    _try(out, "mem_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
    _try(out, "gpu_temp", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
    _try(out, "power_w", nv.nvmlDeviceGetPowerUsage, h, scale=0.001)
    _try(out, "energy_mj", nv.nvmlDeviceGetTotalEnergyConsumption, h)
    _try(out, "pcie_replay", nv.nvmlDeviceGetPcieReplayCounter, h)
    _try(out, "enc_util", lambda: nv.nvmlDeviceGetEncoderUtilization(h)[0])
    _try(out, "dec_util", lambda: nv.nvmlDeviceGetDecoderUtilization(h)[0])
    try:
        rates = nv.nvmlDeviceGetUtilizationRates(h)
        out["gpu_util"], out["mem_copy_util"] = int(rates.gpu), int(rates.memory)
    except Exception:
        pass
    out.update(memory(nv, h))
    try:
        corr, unc, _pending, failure = nv.nvmlDeviceGetRemappedRows(h)
        out.update(remap_correctable=corr, remap_uncorrectable=unc, remap_failure=int(bool(failure)))
    except Exception:
        pass
    out.update(_fields(nv, h))
    return out


def memory(nv, h) -> dict:
    """Framebuffer free, used and reserved in MiB (v2, which knows the reserved part; else v1)."""
    try:
        m = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
        reserved = int(m.reserved)
    except Exception:
        try:
            m = nv.nvmlDeviceGetMemoryInfo(h)
            reserved = None
        except Exception:
            return {}
    out = {"fb_free": int(m.free) >> 20, "fb_used": int(m.used) >> 20}
    if reserved is not None:
        out["fb_reserved"] = reserved >> 20
    return out


def _fields(nv, h) -> dict:
    out = {}
    try:
        (temp,) = nv.nvmlDeviceGetFieldValues(h, [FIELD_MEMORY_TEMP])
        if temp.nvmlReturn == 0:
            out["memory_temp"] = int(temp.value.uiVal)
    except Exception:
        pass
    total, seen = 0, False
    for link in range(NVLINKS):
        try:
            if not nv.nvmlDeviceGetNvLinkState(h, link):
                continue
            values = nv.nvmlDeviceGetFieldValues(h, [(FIELD_NVLINK_TX, link), (FIELD_NVLINK_RX, link)])
        except Exception:
            break
        for v in values:
            if v.nvmlReturn == 0:
                total, seen = total + int(v.value.ullVal), True
    if seen:
        out["nvlink_bandwidth_total"] = total
    return out


class Gpm:
    """One GPU's last GPM sample, kept between rounds; ``ratios`` gives the metrics since it."""

    def __init__(self, nv, h):
        self.nv, self.h = nv, h
        self.last = None
        support = nv.nvmlGpmQueryDeviceSupport(h)
        if not support.isSupportedDevice:
            raise RuntimeError("GPM not supported")

    def _sample(self):
        sample = self.nv.nvmlGpmSampleAlloc()
        try:
            self.nv.nvmlGpmSampleGet(self.h, sample)
        except Exception:
            self.nv.nvmlGpmSampleFree(sample)
            raise
        return sample

    def ratios(self) -> dict:
        nv = self.nv
        if self.last is None:
            self.last = self._sample()
            time.sleep(GPM_FIRST_GAP)
        now = self._sample()
        get = nv.c_nvmlGpmMetricsGet_t()
        get.version = nv.NVML_GPM_METRICS_GET_VERSION
        get.numMetrics = len(GPM_METRICS)
        get.sample1, get.sample2 = self.last, now
        for i, (metric, _scale) in enumerate(GPM_METRICS.values()):
            get.metrics[i].metricId = metric
        try:
            nv.nvmlGpmMetricsGet(get)
        finally:
            nv.nvmlGpmSampleFree(self.last)
            self.last = now
        out = {}
        for i, (name, (_metric, scale)) in enumerate(GPM_METRICS.items()):
            if get.metrics[i].nvmlReturn == 0:
                out[name] = float(get.metrics[i].value) * scale
        return out


def mps_clients(nv, h) -> list[dict]:
    """The processes MPS runs on this GPU for its clients (pid, used bytes); [] where none or
    where the driver does not say."""
    for suffix in ("_v3", "_v2", ""):
        fn = getattr(nv, "nvmlDeviceGetMPSComputeRunningProcesses" + suffix, None)
        if fn is None:
            continue
        try:
            return [{"pid": int(p.pid), "memory": None if p.usedGpuMemory is None else int(p.usedGpuMemory)}
                    for p in fn(h)]
        except nv.NVMLError_FunctionNotFound:
            continue
        except Exception:
            return []
    return []
