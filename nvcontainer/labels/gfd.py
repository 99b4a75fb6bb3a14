"""The node labels NVIDIA's GPU Feature Discovery publishes, decided from the one inventory. Pure.

Why these and in this form: schedulers, node selectors and NVIDIA's own manifests (the MPS
daemon's ``nvidia.com/mps.capable: "true"``) select on GPU Feature Discovery's names and values,
so an operator replacing it must see the same ones (k8s-device-plugin ``docs/gpu-feature-
discovery/README.md``, REFERENCE §10): ``nvidia.com/gpu.product`` is NVML's name with spaces as
``-``, ``.memory`` MiB, ``.family`` the architecture in lower case, the CUDA and driver versions
split at the dots, and for MIG either the ``nvidia.com/gpu.*`` labels overloaded with the MIG
device (strategy ``single``) or one ``nvidia.com/mig-<profile>.*`` set per profile (``mixed``).

Where NVIDIA's labeller is not deterministic, this is: with several GPU models on one node it
writes the ``gpu.*`` set of whichever model its map iteration ends on; here the model of the
lowest-index GPU wins. Where it fails the node (MPS asked for beside a MIG-enabled GPU), here
``mps.capable`` is ``false`` and the device plugin says why.

The labels come from the inventory and the device plugin's settings only, so they always say
what the plugin advertises from the same reading; the machine type and the time are passed in.
"""

from __future__ import annotations

import re

from ..deviceplugin.devices import mig_profile, resource_name
from ..deviceplugin.settings import Settings
from ..inventory.model import Gpu, Inventory, MigDevice

VENDOR = "nvidia.com"
GPU = f"{VENDOR}/gpu"
UNKNOWN_MACHINE = "unknown"
VALUE_MAX = 63                         # Kubernetes' bound on a label value
SHARED = "-SHARED"

# compute capability major -> architecture, as NVIDIA's labeller names them; 7.x and 8.x split
_FAMILIES = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper",
             10: "blackwell", 12: "blackwell", 13: "rubin"}

# the inventory's MIG attributes -> the label suffixes
_MIG_ATTRIBUTES = (("memory_mb", "memory"), ("multiprocessors", "multiprocessors"),
                   ("slices_gi", "slices.gi"), ("slices_ci", "slices.ci"), ("copy_engines", "engines.copy"),
                   ("decoders", "engines.decoder"), ("encoders", "engines.encoder"), ("jpegs", "engines.jpeg"),
                   ("ofas", "engines.ofa"))


def sanitise(text: str) -> str:
    """Only letters, digits, ``-_.``; runs of spaces as one ``-`` (a label value's alphabet)."""
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", text).split())


def label_value(text: str, limit: int = VALUE_MAX) -> str:
    """A value Kubernetes takes for a label: sanitised, at most ``limit`` (63) characters, a
    letter or digit at each end (``-_.`` only inside), or empty. The API server refuses the
    whole node update for one value past that (a DMI product name of 70 characters did it)."""
    return sanitise(text)[:limit].strip("-_.")


def family(major: int, minor: int) -> str:
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return _FAMILIES.get(major, "undefined")


def node_labels(inv: Inventory, settings: Settings, *, machine: str | None = None,
                timestamp: int | None = None) -> dict[str, str]:
    """Every label, by name. ``machine``: the machine type (DMI product name) or None when it
    could not be read; ``timestamp``: seconds since the epoch for ``gfd.timestamp``, or None."""
    labels: dict[str, str] = {}
    if timestamp is not None:
        labels[f"{VENDOR}/gfd.timestamp"] = str(int(timestamp))
    if not inv.gpus:
        return labels
    labels[f"{GPU}.machine"] = (label_value(machine) if machine is not None else "") or UNKNOWN_MACHINE
    labels.update(_versions(inv))
    labels[f"{VENDOR}/mig.capable"] = _bool(any(g.mig_capable for g in inv.gpus))
    labels[f"{VENDOR}/mps.capable"] = _bool(settings.sharing == "mps" and not any(g.mig_enabled for g in inv.gpus))
    labels.update(_whole_gpus(inv, settings))
    if settings.mig_strategy != "none":
        labels[f"{VENDOR}/mig.strategy"] = settings.mig_strategy
        labels.update(_single(inv, settings) if settings.mig_strategy == "single" else _mixed(inv, settings))
    return {name: label_value(value) for name, value in labels.items()}   # every value, whatever its source


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _versions(inv: Inventory) -> dict[str, str]:
    parts = inv.driver_version.split(".")
    major, minor, rev = (parts + ["", ""])[:3]
    cuda_major, _, cuda_minor = inv.cuda_version.partition(".")
    return {
        f"{VENDOR}/cuda.driver.major": major,
        f"{VENDOR}/cuda.driver.minor": minor,
        f"{VENDOR}/cuda.driver.rev": rev,
        f"{VENDOR}/cuda.driver-version.major": major,
        f"{VENDOR}/cuda.driver-version.minor": minor,
        f"{VENDOR}/cuda.driver-version.revision": rev,
        f"{VENDOR}/cuda.driver-version.full": inv.driver_version,
        f"{VENDOR}/cuda.runtime.major": cuda_major,
        f"{VENDOR}/cuda.runtime.minor": cuda_minor,
        f"{VENDOR}/cuda.runtime-version.major": cuda_major,
        f"{VENDOR}/cuda.runtime-version.minor": cuda_minor,
        f"{VENDOR}/cuda.runtime-version.full": inv.cuda_version,
    }


def _resource(name: str, product_parts: list[str], count: int, settings: Settings | None) -> dict[str, str]:
    """product, count, replicas and sharing-strategy of one resource; ``settings`` None: a
    resource the plugin does not share (a MIG-enabled GPU's whole-GPU labels)."""
    replicas = 0 if settings is None else settings.replicas
    product = "-".join(sanitise(p) for p in product_parts if p)
    if replicas > 1 and not settings.rename_shared:     # the suffix kept whole, the model cut if need be
        product = label_value(product, VALUE_MAX - len(SHARED)) + SHARED
    return {
        f"{name}.product": product,
        f"{name}.count": str(count),
        f"{name}.replicas": str(replicas),
        f"{name}.sharing-strategy": settings.sharing if replicas > 1 else "none",
    }


def _whole_gpus(inv: Inventory, settings: Settings) -> dict[str, str]:
    """The ``nvidia.com/gpu.*`` set of the lowest-index GPU's model: MIG-enabled GPUs' models
    first, unshared, then those without MIG, which win over them as in NVIDIA's labeller."""
    labels: dict[str, str] = {}
    for mig_enabled in (True, False):
        group = [g for g in inv.gpus if g.mig_enabled == mig_enabled]
        if not group:
            continue
        first = group[0]
        count = sum(1 for g in group if g.model == first.model)
        labels.update(_resource(GPU, [first.model], count, None if mig_enabled else settings))
        if first.memory:
            labels[f"{GPU}.memory"] = str(first.memory >> 20)
        labels.update(_architecture(first))
    return labels


def _architecture(gpu: Gpu) -> dict[str, str]:
    major, _, minor = gpu.arch.partition(".")
    if not (major + minor).isascii() or not major.isdigit() or not minor.isdigit() or int(major) == 0:
        return {}
    return {f"{GPU}.family": family(int(major), int(minor)), f"{GPU}.compute.major": major,
            f"{GPU}.compute.minor": minor}


def _mig_set(name: str, gpu: Gpu, mig: MigDevice, count: int, settings: Settings) -> dict[str, str]:
    profile = resource_name(mig_profile(mig)).removeprefix(f"{VENDOR}/mig-")
    labels = _resource(name, [gpu.model, "MIG", profile], count, settings)
    attributes = dict(mig.attributes)
    for field, suffix in _MIG_ATTRIBUTES:
        if field in attributes:
            labels[f"{name}.{suffix}"] = str(attributes[field])
    return labels


def _by_profile(inv: Inventory) -> dict[str, tuple[Gpu, MigDevice, int]]:
    """profile -> (its first GPU, its first MIG device, how many), in GPU and MIG index order."""
    found: dict[str, tuple[Gpu, MigDevice, int]] = {}
    for gpu in inv.gpus:
        for mig in gpu.migs:
            profile = mig_profile(mig)
            first_gpu, first_mig, count = found.get(profile, (gpu, mig, 0))
            found[profile] = (first_gpu, first_mig, count + 1)
    return found


def _single(inv: Inventory, settings: Settings) -> dict[str, str]:
    enabled = [g for g in inv.gpus if g.mig_enabled]
    if not enabled:
        return {}
    profiles = _by_profile(inv)
    if any(not g.migs for g in enabled) or len(enabled) != len(inv.gpus) or len(profiles) != 1:
        return {f"{GPU}.product": "-".join([sanitise(enabled[0].model), "MIG", "INVALID"]),
                f"{GPU}.count": "0", f"{GPU}.replicas": "0", f"{GPU}.sharing-strategy": "",
                f"{GPU}.memory": "0"}
    (gpu, mig, count), = profiles.values()
    return _mig_set(GPU, gpu, mig, count, settings)


def _mixed(inv: Inventory, settings: Settings) -> dict[str, str]:
    labels: dict[str, str] = {}
    for profile, (gpu, mig, count) in _by_profile(inv).items():
        labels.update(_mig_set(resource_name(profile), gpu, mig, count, settings))
    return labels
