"""ResourceSlices for the fake machines, checked against NVIDIA's attribute names and formats
written by hand from the machines' specs (tests/fixtures/fakegpu/spec.py: models, brands,
compute capabilities, PCI buses, NUMA nodes, memory), not against our own output; and against
the API server's validation (tests/fixtures/kubeapi.py's checks of the published API)."""

from __future__ import annotations

import pytest

from nvcontainer.dra.publishing import publish, slices
from nvcontainer.request.selection import allow_list
from tests.fixtures.fakegpu import FakeSpec, inventory_of
from tests.fixtures.fakegpu.spec import gpu_uuid, mig_uuid
from tests.fixtures.kubeapi import validate_slice

NODE = "node-a"
DRIVER_VERSION = {"version": "550.54.14"}       # FakeSpec's driver 550.54.14
CUDA = {"version": "12.4.0"}                    # FakeSpec's cuda_version 12040



def slices_of(machine, **kw):
    inv = inventory_of(machine)
    return inv, slices.build(inv, NODE, roots=publish.pcie_roots(str(machine.sysfs), inv), **kw)


def s(value):
    return {"string": value}


def nvidia_gpu(i, product, brand, arch, cc, bus, root, memory) -> dict:
    """GPU ``i`` (minor = index on these machines) as NVIDIA's driver publishes it: its attribute
    names and formats, written here by hand, filled with the machine spec's values."""
    return {"name": f"gpu-{i}",
            "attributes": {
                "type": s("gpu"), "uuid": s(gpu_uuid(i)), "minor": {"int": i}, "index": {"int": i},
                "productName": s(product), "brand": s(brand), "architecture": s(arch),
                "cudaComputeCapability": {"version": cc}, "driverVersion": DRIVER_VERSION, "cudaDriverVersion": CUDA,
                "pcieBusID": s(bus), "resource.kubernetes.io/pciBusID": s(bus),
                "resource.kubernetes.io/pcieRoot": s(root)},
            "capacity": {"memory": {"value": memory}}}


def test_two_gpu_machine_as_nvidia_publishes_it(fake_machine):
    _, out = slices_of(fake_machine)
    assert len(out) == 1
    spec = out[0]["spec"]
    assert out[0]["apiVersion"] == "resource.k8s.io/v1" and out[0]["kind"] == "ResourceSlice"
    assert spec["driver"] == "gpu.nvidia.com" and spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert spec["devices"] == [
        nvidia_gpu(0, "NVIDIA A100-SXM4-80GB", "Nvidia", "Ampere", "8.0.0", "0000:07:00.0", "pci0000:00", "80Gi"),
        nvidia_gpu(1, "Tesla T4", "Tesla", "Turing", "7.5.0", "0000:0f:00.0", "pci0000:00", "15Gi"),
    ]
    assert validate_slice(out[0], "v1") == ""


def test_eight_gpu_machine(fake_machine_factory):
    _, out = slices_of(fake_machine_factory(FakeSpec(gpus=8)))
    assert out[0]["spec"]["devices"] == [nvidia_gpu(i, *row) for i, row in enumerate([
        ("NVIDIA A100-SXM4-80GB", "Nvidia", "Ampere", "8.0.0", "0000:07:00.0", "pci0000:00", "80Gi"),
        ("Tesla T4", "Tesla", "Turing", "7.5.0", "0000:0f:00.0", "pci0000:00", "15Gi"),
        ("NVIDIA H100 80GB HBM3", "Nvidia", "Hopper", "9.0.0", "0000:47:00.0", "pci0000:00", "81559Mi"),
        ("NVIDIA RTX A6000", "NvidiaRTX", "Ampere", "8.6.0", "0000:4e:00.0", "pci0000:00", "49140Mi"),
        ("NVIDIA A100-SXM4-80GB", "Nvidia", "Ampere", "8.0.0", "0000:87:00.0", "pci0000:80", "80Gi"),
        ("Tesla T4", "Tesla", "Turing", "7.5.0", "0000:90:00.0", "pci0000:80", "15Gi"),
        ("NVIDIA H100 80GB HBM3", "Nvidia", "Hopper", "9.0.0", "0000:b7:00.0", "pci0000:80", "81559Mi"),
        ("NVIDIA RTX A6000", "NvidiaRTX", "Ampere", "8.6.0", "0000:bd:00.0", "pci0000:80", "49140Mi"),
    ])]
    assert validate_slice(out[0], "v1") == ""


def test_mig_machine(fake_machine_factory):
    # GPU 0 (A100 80GB) in MIG mode with 1g.10gb (GI profile 19, 1 slice, 10 GiB, 14 SMs, 1 copy
    # engine) at slice 0, 2g.20gb (14, 2 slices, 20 GiB, 28 SMs, 2 copy engines, 1 decoder) at 2,
    # 1g.10gb at 4; GPU 1 (T4) whole.
    spec = FakeSpec(gpus=2, mig=True, mig_devices=3, mig_profiles=("1g.10gb", "2g.20gb"))
    _, out = slices_of(fake_machine_factory(spec))
    devices = out[0]["spec"]["devices"]
    assert [d["name"] for d in devices] == [
        "gpu-0-mig-1g10gb-19-0", "gpu-0-mig-2g20gb-14-2", "gpu-0-mig-1g10gb-19-4", "gpu-1"]
    assert devices[1] == {
        "name": "gpu-0-mig-2g20gb-14-2",
        "attributes": {
            "type": s("mig"), "uuid": s(mig_uuid(0, 2, 0)), "parentUUID": s(gpu_uuid(0)), "profile": s("2g.20gb"),
            "index": {"int": 1}, "parentIndex": {"int": 0},
            "productName": s("NVIDIA A100-SXM4-80GB"), "brand": s("Nvidia"), "architecture": s("Ampere"),
            "cudaComputeCapability": {"version": "8.0.0"}, "driverVersion": DRIVER_VERSION, "cudaDriverVersion": CUDA,
            "pcieBusID": s("0000:07:00.0"), "resource.kubernetes.io/pciBusID": s("0000:07:00.0"),
            "resource.kubernetes.io/pcieRoot": s("pci0000:00")},
        "capacity": {"multiprocessors": {"value": "28"}, "copyEngines": {"value": "2"}, "decoders": {"value": "1"},
                     "encoders": {"value": "0"}, "jpegEngines": {"value": "0"}, "ofaEngines": {"value": "0"},
                     "memory": {"value": "20Gi"}, "memorySlice2": {"value": "1"}, "memorySlice3": {"value": "1"}},
    }
    assert devices[0]["capacity"] == {
        "multiprocessors": {"value": "14"}, "copyEngines": {"value": "1"}, "decoders": {"value": "0"},
        "encoders": {"value": "0"}, "jpegEngines": {"value": "0"}, "ofaEngines": {"value": "0"},
        "memory": {"value": "10Gi"}, "memorySlice0": {"value": "1"}}
    assert validate_slice(out[0], "v1") == ""


def test_allowed_devices_hold_back(fake_machine_factory):
    inv = inventory_of(fake_machine_factory(FakeSpec(gpus=8)))
    out = slices.build(inv, NODE, allow=allow_list(inv, ("1", "3")))
    assert [d["name"] for d in out[0]["spec"]["devices"]] == ["gpu-1", "gpu-3"]


def test_unhealthy_withdrawn_or_tainted(fake_machine):
    inv = inventory_of(fake_machine)
    bad = {gpu_uuid(1): "XID 79"}
    assert [d["name"] for d in slices.build(inv, NODE, unhealthy=bad)[0]["spec"]["devices"]] == ["gpu-0"]
    tainted = slices.build(inv, NODE, unhealthy=bad, taint=True)[0]["spec"]["devices"]
    assert tainted[1]["taints"] == [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]
    assert "taints" not in tainted[0]
    assert slices.taint_for("GPU is lost") == {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"}
    assert slices.taint_for("no heartbeat in 5 s")["key"] == "gpu.nvidia.com/unmonitored"


@pytest.mark.parametrize("text, want", [("8.0", "8.0.0"), ("12.4", "12.4.0"), ("550.54.14", "550.54.14"),
                                        ("535.104.05", "535.104.5"), ("9", "9.0.0"), ("1.2.3.4", "1.2.3+4"),
                                        ("", ""), ("abc", "")])
def test_semver(text, want):
    assert slices.semver(text) == want


@pytest.mark.parametrize("value, want", [(80 << 30, "80Gi"), (81559 << 20, "81559Mi"), (1 << 40, "1Ti"),
                                         (1000, "1000"), (1536, "1536"), (3072, "3Ki"), (0, "0")])
def test_binary_quantity(value, want):
    assert slices.binary_quantity(value) == want


def test_more_than_128_devices_split_into_slices_of_one_pool():
    from nvcontainer.inventory.model import Gpu, Inventory

    gpus = tuple(Gpu(index=i, minor=i, model="X", brand="Nvidia", uuid=f"GPU-{i}", bus_id=f"00000000:{i:02x}:00.0",
                     arch="9.0") for i in range(130))
    out = slices.build(Inventory(root="/", driver_version="550.54.14", cuda_version="12.4", gpus=gpus), NODE)
    assert [len(x["spec"]["devices"]) for x in out] == [128, 2]
    assert {x["spec"]["pool"]["resourceSliceCount"] for x in out} == {2}
    assert [x["metadata"]["name"] for x in out] == ["node-a-gpu.nvidia.com-0", "node-a-gpu.nvidia.com-1"]
