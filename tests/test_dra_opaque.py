"""A claim's opaque configuration and allocation, read as NVIDIA's DRA driver reads them: the
shapes of ``resource.nvidia.com/v1beta1`` GpuConfig and MigDeviceConfig, strictly (an unknown
field or a value out of range is refused naming the field), and which entry applies to which
device. Pure: no machine needed."""

from __future__ import annotations

import time

import pytest

from nvcontainer.dra import claims, opaque
from nvcontainer.errors import NvcError
from nvcontainer.inventory.model import Gpu, MigDevice

API = "resource.nvidia.com/v1beta1"
GPU0 = Gpu(index=0, minor=0, model="A100", brand="Nvidia", uuid="GPU-0", bus_id="00000000:07:00.0", arch="8.0")
GPU1 = Gpu(index=1, minor=1, model="A100", brand="Nvidia", uuid="GPU-1", bus_id="00000000:08:00.0", arch="8.0")
MIG = MigDevice(parent=1, index=0, uuid="MIG-1", gi=1, ci=0, gi_access="", ci_access="")
TABLE = {"gpu-0": (GPU0, None), "gpu-1": (GPU1, None), "gpu-1-mig-1g10gb-19-0": (GPU1, MIG)}


def gpu_config(**sharing):
    return {"apiVersion": API, "kind": "GpuConfig", **({"sharing": sharing} if sharing else {})}


def config(params, requests=(), source="FromClaim", driver="gpu.nvidia.com"):
    return {"source": source, "requests": list(requests), "opaque": {"driver": driver, "parameters": params}}


def claim(results, configs=None, uid="u1", **meta):
    return {"metadata": {"uid": uid, "name": "c", "namespace": "ns", **meta},
            "status": {"allocation": {"devices": {"results": results, "config": configs or []}}}}


def result(device, request="gpu", pool="node-a", driver="gpu.nvidia.com"):
    return {"request": request, "driver": driver, "pool": pool, "device": device}


def test_time_slicing_and_mps_shapes():
    assert opaque.parse(gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"})) == \
        opaque.Sharing(kind="gpu", strategy="TimeSlicing", interval="Long")
    assert opaque.parse(gpu_config(strategy="TimeSlicing")).interval == "Default"
    mps = opaque.parse(gpu_config(strategy="MPS", mpsConfig={
        "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi",
        "defaultPerDevicePinnedMemoryLimit": {"0": "2048M"}}))
    assert (mps.active_threads, mps.pinned_limit, mps.per_device_limits) == (50, 10 << 30, (("0", 2048 * 10 ** 6),))
    mig = opaque.parse({"apiVersion": API, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}})
    assert (mig.kind, mig.strategy) == ("mig", "MPS")


@pytest.mark.parametrize("params, field", [
    (gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long", "extra": 1}), "timeSlicingConfig.extra"),
    ({**gpu_config(), "metadata": {}}, "parameters.metadata"),
    (gpu_config(strategy="MPS", mpsConfg={}), "sharing.mpsConfg"),
    (gpu_config(strategy="Fabric"), "sharing.strategy"),
    (gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Forever"}), "timeSlicingConfig.interval"),
    (gpu_config(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 101}), "defaultActiveThreadPercentage"),
    (gpu_config(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": -1}), "defaultActiveThreadPercentage"),
    (gpu_config(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "100Ki"}),
     "defaultPinnedDeviceMemoryLimit"),
    (gpu_config(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "lots"}),
     "defaultPinnedDeviceMemoryLimit"),
    (gpu_config(strategy="MPS", timeSlicingConfig={}), "timeSlicingConfig"),
    (gpu_config(strategy="TimeSlicing", mpsConfig={}), "mpsConfig"),
    ({"apiVersion": API, "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing",
                                                                "timeSlicingConfig": {}}}, "timeSlicingConfig"),
    ({"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}, "apiVersion"),
    ({"apiVersion": API, "kind": "VfioDeviceConfig"}, "kind"),
    # the kind is named before its fields are: each kind has its own fields
    ({"apiVersion": API, "kind": "VfioDeviceConfig", "iommu": {}}, "kind: kind VfioDeviceConfig is not supported"),
    ({"apiVersion": API, "kind": "FancyConfig", "fancy": 1}, "kind: kind FancyConfig is not supported"),
    (gpu_config(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "9Ei"}),
     "defaultPinnedDeviceMemoryLimit: 9Ei: out of range"),
    (gpu_config(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "-1Gi"}),
     "defaultPinnedDeviceMemoryLimit: -1Gi: must be at least 1Mi"),
    (gpu_config(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": float("inf")}),
     "defaultPinnedDeviceMemoryLimit: inf: out of range"),
])
def test_bad_parameters_are_refused_naming_the_field(params, field):
    with pytest.raises(NvcError) as err:
        opaque.parse(params)
    assert field in err.value.detail, err.value.detail


def test_quantities():
    assert opaque.quantity("1Gi") == 1 << 30
    assert opaque.quantity("1.5Mi") == 3 << 19
    assert opaque.quantity("1e6") == 10 ** 6
    assert opaque.quantity(1048576) == 1 << 20
    # signed, as Kubernetes writes them: a sign on the number and on the exponent; milli
    assert opaque.quantity("+1Gi") == 1 << 30
    assert opaque.quantity("-1Mi") == -(1 << 20)
    assert opaque.quantity("1E+3") == 1000
    assert opaque.quantity("5e-3") == 1          # rounded up, as Kubernetes' Value() does
    assert opaque.quantity("1500m") == 2
    assert opaque.quantity("1.") == 1 and opaque.quantity(".5k") == 500
    for bad in ("", "1GB", "Mi", "++1", "1e", "1e1.5", "1Gi\n1", "\uff11Gi", True, None):
        with pytest.raises(ValueError, match="not a quantity"):
            opaque.quantity(bad)


def test_a_quantity_is_bounded_before_it_is_computed():
    """``1e10000000`` is ten characters and was computed as a ten-million-digit integer (16 s on
    the event loop, every claim stopped meanwhile): refused at once, as is everything past 8Ei."""
    assert opaque.quantity("8Ei") == opaque.QUANTITY_MAX                       # at the bound
    assert opaque.quantity(str(opaque.QUANTITY_MAX)) == opaque.QUANTITY_MAX
    for past in ("1e10000000", "1e30000000", "1e61", "9Ei", str(opaque.QUANTITY_MAX + 1), "8.0000000001Ei",
                 opaque.QUANTITY_MAX + 1, 1e300, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="out of range"):
            opaque.quantity(past)
    assert opaque.quantity("1e-10000000") == 1 and opaque.quantity("0e10000000") == 0   # tiny, zero: no power
    assert opaque.quantity("1" + "0" * 18) == 10 ** 18
    longest = "0" * (opaque.QUANTITY_CHARS - 1) + "1"
    assert opaque.quantity(longest) == 1                                        # length at the bound
    with pytest.raises(ValueError, match="not a quantity"):
        opaque.quantity("0" + longest)                                          # one past
    started = time.monotonic()
    with pytest.raises(NvcError, match="defaultPinnedDeviceMemoryLimit: 1e10000000: out of range"):
        opaque.parse(gpu_config(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "1e10000000"}))
    assert time.monotonic() - started < 0.5


def test_the_last_matching_entry_wins_class_before_claim():
    configs = [config(gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Short"})),
               config(gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}), source="FromClass"),
               config(gpu_config(strategy="MPS"), requests=["shared"]),
               config({"anything": "else"}, driver="other.example.com")]
    got = claims.resolve(claim([result("gpu-0"), result("gpu-1", "shared")], configs), "ns", "c", "u1",
                         "node-a", TABLE)
    assert [(u.device, u.sharing.strategy, u.sharing.interval) for u in got.units] == \
        [("gpu-0", "TimeSlicing", "Short"), ("gpu-1", "MPS", "")]


def test_a_gpu_config_named_for_a_mig_device_is_refused():
    configs = [config(gpu_config(strategy="TimeSlicing"), requests=["mig"])]
    with pytest.raises(NvcError, match="cannot apply GpuConfig to device gpu-1-mig-1g10gb-19-0"):
        claims.resolve(claim([result("gpu-1-mig-1g10gb-19-0", "mig")], configs), "ns", "c", "u1", "node-a", TABLE)
    # not named: a GpuConfig for every request does not touch the MIG device
    got = claims.resolve(claim([result("gpu-1-mig-1g10gb-19-0", "mig")], [config(gpu_config(strategy="MPS"))]),
                         "ns", "c", "u1", "node-a", TABLE)
    assert got.units[0].sharing == opaque.Sharing(kind="mig")


def test_only_this_drivers_results_in_this_nodes_pool():
    got = claims.resolve(claim([result("gpu-0"), result("gpu-1", pool="node-b"), result("nic-0", driver="net.x"),
                                result("gpu-1-mig-1g10gb-19-0", "mig")]), "ns", "c", "u1", "node-a", TABLE)
    assert [(u.device, u.uuid) for u in got.units] == [("gpu-0", "GPU-0"), ("gpu-1-mig-1g10gb-19-0", "MIG-1")]


@pytest.mark.parametrize("obj, message", [
    (claim([result("gpu-7")]), "device gpu-7 is not on node node-a"),
    (claim([result("gpu-0")], uid="other"), "its UID is other"),
    (claim([result("gpu-0")], deletionTimestamp="2026-01-01T00:00:00Z"), "is being deleted"),
    ({"metadata": {"uid": "u1"}, "status": {}}, "not allocated yet"),
    (claim([result("gpu-0"), result("gpu-1")],
           [config(gpu_config(strategy="MPS", mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"5": "1Gi"}}))]),
     "defaultPerDevicePinnedMemoryLimit: 5: names no device"),
    (claim([result("gpu-0")],     # "²".isdigit() is True, and int("²") raises
           [config(gpu_config(strategy="MPS", mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"²": "1Gi"}}))]),
     "defaultPerDevicePinnedMemoryLimit: ²: names no device"),
    (claim([result("gpu-0")],
           [config(gpu_config(strategy="MPS", mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"9" * 5000: "1Gi"}}))]),
     "defaultPerDevicePinnedMemoryLimit: 999"),
])
def test_claims_this_node_cannot_prepare(obj, message):
    with pytest.raises(NvcError) as err:
        claims.resolve(obj, "ns", "c", "u1", "node-a", TABLE)
    assert message in err.value.detail and "ns/c" in err.value.detail


def test_an_unhealthy_device_is_refused_naming_it():
    with pytest.raises(NvcError, match=r"device gpu-1 \(GPU-1\) is unhealthy: XID 79"):
        claims.resolve(claim([result("gpu-1")]), "ns", "c", "u1", "node-a", TABLE, unhealthy={"GPU-1": "XID 79"})
