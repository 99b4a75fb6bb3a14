"""One scrape's facts → Prometheus metric families (pure: plain data in, prometheus_client's
``Metric`` objects out; the label values are escaped by its encoders, as the exposition formats
say: backslash, double quote and newline).

The GPU series are dcgm-exporter's: the name, the value in its unit, and the labels ``gpu``,
``UUID``, ``pci_bus_id``, ``device``, ``modelName``, ``Hostname``, the label fields the
counters file selects (``DCGM_FI_DRIVER_VERSION``...), ``GPU_I_PROFILE`` and ``GPU_I_ID`` for a
MIG device, and the pod that holds the GPU when the kubelet says (one series per holder, as
dcgm-exporter does for a shared GPU). A GPU that did not answer this scrape has no such series;
``nvcontainer_gpu_up`` says 0 for it, and 1 for the others.

The per-container series are ours (``nvcontainer_container_*``): engine, container ID and name
from ``ps``'s view, the pod's names too where the engine is Kubernetes.
"""

from __future__ import annotations

from prometheus_client.core import Metric

from .counters import Counter


def gpu_labels(gpu, hostname: str, static: dict[str, str]) -> dict[str, str]:
    return {"gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": gpu.bus_id, "device": f"nvidia{gpu.minor}",
            "modelName": gpu.model, "Hostname": hostname, **static}


def mig_labels(gpu, mig, hostname: str, static: dict[str, str]) -> dict[str, str]:
    return {**gpu_labels(gpu, hostname, static), "GPU_I_PROFILE": _profile(mig), "GPU_I_ID": str(mig.gi)}


def _profile(mig) -> str:
    """The GPU instance profile as NVIDIA writes it (1g.10gb), from the MIG device's NVML name."""
    name = mig.name or ""
    return name.rsplit(" ", 1)[-1] if " MIG " in name else name


def _static(counters: list[Counter], inventory, gpu) -> dict[str, str]:
    values = {"driver_version": inventory.driver_version, "brand": gpu.brand}
    return {c.name: values.get(c.key, "") for c in counters if c.source == "label"}


def _value(counter: Counter, entry: dict):
    if counter.source == "reading":
        return entry.get("readings", {}).get(counter.key)
    if counter.source == "gpm":
        return (entry.get("gpm") or {}).get(counter.key)
    if counter.source == "xid":
        return entry.get("xid", 0)
    return None


def _with_holders(labels: dict, holders: list[dict]) -> list[dict]:
    return [{**labels, **h} for h in holders] if holders else [labels]


def build(inventory, counters: list[Counter], entries: dict[str, dict], view: list[dict] | None,
          holders: dict[str, list[dict]] | None, hostname: str, sources: dict[str, bool]) -> list[Metric]:
    """``entries``: the sampler's answers by GPU UUID (this scrape); ``view``: ``ps``'s per-GPU
    view (None when the scan failed); ``holders``: UUID → pod label sets (None: no kubelet);
    ``sources``: name → whether it answered (``nvcontainer_source_up``)."""
    holders = holders or {}
    families = {c.name: Metric(c.name, c.help, c.type) for c in counters if c.source != "label"}
    up = Metric("nvcontainer_gpu_up", "Whether the GPU answered NVML in this scrape (1) or not (0: its "
                                      "series are missing until it does).", "gauge")
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        static = _static(counters, inventory, gpu)
        labels = gpu_labels(gpu, hostname, static)
        entry = entries.get(gpu.uuid)
        ok = entry is not None and "error" not in entry
        up.add_sample(up.name, labels, 1.0 if ok else 0.0)
        if not ok:
            continue
        for counter in counters:
            value = _value(counter, entry)
            if value is None or counter.source == "label":
                continue
            for series in _with_holders(labels, holders.get(gpu.uuid, [])):
                families[counter.name].add_sample(counter.name, series, float(value))
        migs = entry.get("migs") or {}
        for mig in gpu.migs:
            memory = migs.get(mig.uuid)
            if not memory:
                continue
            mlabels = mig_labels(gpu, mig, hostname, static)
            for counter in counters:
                if counter.source == "reading" and counter.key in memory:
                    for series in _with_holders(mlabels, holders.get(mig.uuid, [])):
                        families[counter.name].add_sample(counter.name, series, float(memory[counter.key]))
    out = [f for f in families.values() if f.samples] + [up]
    if view is not None:
        out += containers(inventory, view, hostname)
    source = Metric("nvcontainer_source_up", "Whether each source of this scrape answered: nvml (the "
                                             "sampler), containers (the ps scan), podresources (the kubelet).",
                    "gauge")
    for name, answered in sorted(sources.items()):
        source.add_sample(source.name, {"source": name, "Hostname": hostname}, 1.0 if answered else 0.0)
    return out + [source]


def _container_labels(gpu_base: dict, c: dict) -> dict:
    labels = {**gpu_base, "engine": c["engine"] or "unknown", "container_id": c["id"],
              "container_name": c["name"]}
    parts = c["name"].split("/")
    if c["engine"] == "kubernetes" and len(parts) == 3:
        labels.update(namespace=parts[0], pod=parts[1], container=parts[2])
    return labels


def containers(inventory, view: list[dict], hostname: str) -> list[Metric]:
    """Per container and GPU: memory, processes, MPS clients, whether a lease binds it; the
    host's own GPU processes and memory."""
    memory = Metric("nvcontainer_container_gpu_memory_bytes",
                    "GPU memory used by the container's processes on this GPU (bytes).", "gauge")
    procs = Metric("nvcontainer_container_gpu_processes", "The container's processes on this GPU.", "gauge")
    mps = Metric("nvcontainer_container_gpu_mps_clients", "The container's MPS client processes on this GPU.",
                 "gauge")
    lease = Metric("nvcontainer_container_gpu_lease", "1 where an nvcontainer lease binds this GPU to the "
                                                      "container (running=false: its container is gone).", "gauge")
    host_memory = Metric("nvcontainer_host_gpu_memory_bytes",
                         "GPU memory used by processes outside any container (bytes).", "gauge")
    host_procs = Metric("nvcontainer_host_gpu_processes", "GPU processes outside any container.", "gauge")
    by_uuid = {g.uuid: g for g in inventory.gpus}
    for entry in view:
        gpu = by_uuid.get(entry["uuid"])
        if gpu is None:
            continue
        base = {"gpu": str(gpu.index), "UUID": gpu.uuid, "device": f"nvidia{gpu.minor}", "Hostname": hostname}
        for c in entry["containers"]:
            labels = _container_labels(base, c)
            if c["how"] == "lease":
                lease.add_sample(lease.name, {**labels, "running": "true" if c["running"] else "false"}, 1.0)
            if not c["running"]:
                continue
            memory.add_sample(memory.name, labels, float(c["memory"] or 0))
            procs.add_sample(procs.name, labels, float(len(c["processes"])))
            mps.add_sample(mps.name, labels, float(sum("mps" in p["kinds"] for p in c["processes"])))
        known = [p["memory"] for p in entry["host_processes"] if p["memory"] is not None]
        host_memory.add_sample(host_memory.name, base, float(sum(known)))
        host_procs.add_sample(host_procs.name, base, float(len(entry["host_processes"])))
    return [memory, procs, mps, lease, host_memory, host_procs]
