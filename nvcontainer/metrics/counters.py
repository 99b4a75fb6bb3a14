"""Which dcgm-exporter counters we export, and the counters file that selects them (pure).

dcgm-exporter's names, types, units and help are what NVIDIA's Grafana dashboard and every
alert written for it select on, so a series here is named, typed and scaled exactly as there
(``/work/shared/REFERENCE.md`` §11): the counters file is the same CSV (``FIELD, type, help``,
``#`` comments), and a field NVML cannot give (DCGM's own, vGPU licensing, the profiling fields
GPM has no counterpart for) is named in one line at start instead of silently missing.

Each catalogue entry says where the value comes from: ``reading`` (the sampler's per-GPU
readings), ``gpm`` (the sampler's GPM ratios, Hopper and later), ``xid`` (the last XID seen) or
``label`` (a static value carried as a label of every series, as DCGM's label fields are).
"""

from __future__ import annotations

from ..errors import NvcError, escape
from ..records import record

TYPES = ("gauge", "counter", "label")
MAX_FILE = 1 << 20


@record
class Counter:
    name: str            # the DCGM field name, which is the series name
    type: str            # gauge, counter or label
    help: str
    source: str          # reading, gpm, xid, label
    key: str             # the sampler's name for it (reading, gpm) or the label's value's name


# name → (source, key, default type, help as dcgm-exporter's default file words it)
CATALOGUE: dict[str, tuple[str, str, str, str]] = {
    "DCGM_FI_DEV_SM_CLOCK": ("reading", "sm_clock", "gauge", "SM clock frequency (in MHz)."),
    "DCGM_FI_DEV_MEM_CLOCK": ("reading", "mem_clock", "gauge", "Memory clock frequency (in MHz)."),
    "DCGM_FI_DEV_MEMORY_TEMP": ("reading", "memory_temp", "gauge", "Memory temperature (in C)."),
    "DCGM_FI_DEV_GPU_TEMP": ("reading", "gpu_temp", "gauge", "GPU temperature (in C)."),
    "DCGM_FI_DEV_POWER_USAGE": ("reading", "power_w", "gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("reading", "energy_mj", "counter",
                                             "Total energy consumption since boot (in mJ)."),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("reading", "pcie_replay", "counter", "Total number of PCIe retries."),
    "DCGM_FI_DEV_GPU_UTIL": ("reading", "gpu_util", "gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("reading", "mem_copy_util", "gauge", "Memory utilization (in %)."),
    "DCGM_FI_DEV_ENC_UTIL": ("reading", "enc_util", "gauge", "Encoder utilization (in %)."),
    "DCGM_FI_DEV_DEC_UTIL": ("reading", "dec_util", "gauge", "Decoder utilization (in %)."),
    "DCGM_FI_DEV_XID_ERRORS": ("xid", "xid", "gauge", "Value of the last XID error encountered."),
    "DCGM_FI_DEV_FB_FREE": ("reading", "fb_free", "gauge", "Framebuffer memory free (in MiB)."),
    "DCGM_FI_DEV_FB_USED": ("reading", "fb_used", "gauge", "Framebuffer memory used (in MiB)."),
    "DCGM_FI_DEV_FB_RESERVED": ("reading", "fb_reserved", "gauge", "Framebuffer memory reserved (in MiB)."),
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": ("reading", "nvlink_bandwidth_total", "counter",
                                           "Total number of NVLink bandwidth counters for all lanes."),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("reading", "remap_uncorrectable", "counter",
                                                "Number of remapped rows for uncorrectable errors"),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("reading", "remap_correctable", "counter",
                                              "Number of remapped rows for correctable errors"),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("reading", "remap_failure", "gauge", "Whether remapping of rows has failed"),
    "DCGM_FI_DRIVER_VERSION": ("label", "driver_version", "label", "Driver Version"),
    "DCGM_FI_DEV_BRAND": ("label", "brand", "label", "Device Brand"),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("gpm", "gr_engine_active", "gauge",
                                      "Ratio of time the graphics engine is active."),
    "DCGM_FI_PROF_SM_ACTIVE": ("gpm", "sm_active", "gauge", "The ratio of cycles an SM has at least 1 warp assigned."),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("gpm", "sm_occupancy", "gauge", "The ratio of number of warps resident on an SM."),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("gpm", "tensor_active", "gauge",
                                        "Ratio of cycles the tensor (HMMA) pipe is active."),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("gpm", "dram_active", "gauge",
                                 "Ratio of cycles the device memory interface is active sending or receiving data."),
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": ("gpm", "fp64_active", "gauge", "Ratio of cycles the fp64 pipes are active."),
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": ("gpm", "fp32_active", "gauge", "Ratio of cycles the fp32 pipes are active."),
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": ("gpm", "fp16_active", "gauge", "Ratio of cycles the fp16 pipes are active."),
    "DCGM_FI_PROF_PCIE_TX_BYTES": ("gpm", "pcie_tx_bytes", "gauge",
                                   "The rate of data transmitted over the PCIe bus - including both protocol "
                                   "headers and data payloads - in bytes per second."),
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("gpm", "pcie_rx_bytes", "gauge",
                                   "The rate of data received over the PCIe bus - including both protocol "
                                   "headers and data payloads - in bytes per second."),
}

# dcgm-exporter's default-counters.csv as shipped, less the vGPU licence status (no NVML
# counterpart on a node that runs containers), plus SM_ACTIVE (GPM gives it for free)
DEFAULT = ("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_GPU_TEMP",
           "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
           "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL",
           "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED",
           "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
           "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DRIVER_VERSION",
           "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
           "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES")


def default() -> list[Counter]:
    return [_counter(name, CATALOGUE[name][2], CATALOGUE[name][3]) for name in DEFAULT]


def _counter(name: str, typ: str, help_text: str) -> Counter:
    source, key, _type, _help = CATALOGUE[name]
    return Counter(name=name, type=typ, help=help_text, source=source, key=key)


def parse(text: str, where: str = "counters file") -> tuple[list[Counter], list[str]]:
    """The counters a dcgm-exporter CSV selects, and the names in it this exporter cannot give.
    A malformed line, a type other than gauge/counter/label, or a name given twice is an error
    naming the line; an unknown name is not (a newer file on an older exporter keeps working)."""
    chosen: list[Counter] = []
    missing: list[str] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(",", 2)
        if len(parts) < 3 or not parts[0].strip():
            raise NvcError("input", f"{where} line {number}: expected 'FIELD, type, help', got {escape(line[:120])}")
        name, typ, help_text = parts[0].strip(), parts[1].strip().lower(), parts[2].strip()
        if not (name.isascii() and name.replace("_", "").isalnum()):
            raise NvcError("input", f"{where} line {number}: {escape(name[:120])} is not a field name")
        if typ not in TYPES:
            raise NvcError("input", f"{where} line {number}: {escape(name)}: type {escape(typ[:40])} "
                                    "is not one of gauge, counter, label")
        if name in seen:
            raise NvcError("input", f"{where} line {number}: {name} repeats line {seen[name]}")
        seen[name] = number
        if name not in CATALOGUE:
            missing.append(name)
            continue
        if (typ == "label") != (CATALOGUE[name][0] == "label"):
            raise NvcError("input", f"{where} line {number}: {name} is a "
                                    f"{'label' if CATALOGUE[name][0] == 'label' else 'value'}, not a {typ}")
        chosen.append(_counter(name, typ, help_text or CATALOGUE[name][3]))
    return chosen, missing


def load(path: str | None) -> tuple[list[Counter], list[str]]:
    """The counters of the file at ``path`` (bounded read), or the default set."""
    if not path:
        return default(), []
    from .files import read_text

    return parse(read_text(path, MAX_FILE, "counters file"), f"counters file {escape(path)}")
