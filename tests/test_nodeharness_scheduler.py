"""The node harness's scheduler stand-in (tests/fixtures/nodeharness/scheduler.py) on its own:
claims allocated from slices by the shipped DeviceClasses' CEL selectors and the requests'."""

from __future__ import annotations

import pytest

from tests.fixtures.nodeharness import manifests, podspec, scheduler

DRIVER = "gpu.nvidia.com"


def gpu(i: int, product: str = "NVIDIA A100-SXM4-80GB") -> dict:
    return {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}, "index": {"int": i},
                                                "productName": {"string": product}}}


def mig(i: int, j: int, profile: str) -> dict:
    return {"name": f"gpu-{i}-mig-{j}", "attributes": {"type": {"string": "mig"}, "profile": {"string": profile},
                                                        "parentUUID": {"string": f"GPU-{i}"}}}


def slices(*devices) -> list[dict]:
    return [{"spec": {"driver": DRIVER, "pool": {"name": "node-a"}, "devices": list(devices)}}]


@pytest.fixture(scope="module")
def classes():
    return manifests.of_kind(manifests.render("dra"), "DeviceClass")


def claim(*requests, constraints=(), config=()) -> dict:
    return {"metadata": {"name": "c"}, "spec": {"devices": {"requests": list(requests),
                                                            "constraints": list(constraints), "config": list(config)}}}


def request(name: str, cls: str = "gpu.nvidia.com", *exprs: str, **extra) -> dict:
    ex = {"deviceClassName": cls, **extra}
    if exprs:
        ex["selectors"] = [{"cel": {"expression": e}} for e in exprs]
    return {"name": name, "exactly": ex}


def picked(allocation) -> list[str]:
    return [r["device"] for r in allocation["devices"]["results"]]


def test_the_class_selects_by_type_and_taken_devices_are_not_free(classes):
    pool = slices(mig(0, 1, "1g.5gb"), gpu(1), gpu(2))
    taken: set = set()
    first = scheduler.allocate(claim(request("gpu")), classes, pool, taken)
    second = scheduler.allocate(claim(request("gpu")), classes, pool, taken)
    assert picked(first) == ["gpu-1"] and picked(second) == ["gpu-2"]
    with pytest.raises(AssertionError, match="cannot allocate"):
        scheduler.allocate(claim(request("gpu")), classes, pool, taken)
    assert picked(scheduler.allocate(claim(request("m", "mig.nvidia.com")), classes, pool, set())) == ["gpu-0-mig-1"]


def test_request_selectors_with_kubernetes_string_functions(classes):
    pool = slices(gpu(0, "Tesla T4"), gpu(1), gpu(2))
    expr = ("device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$') && "
            "device.attributes['gpu.nvidia.com'].index % 2 == 0")
    assert picked(scheduler.allocate(claim(request("gpu", "gpu.nvidia.com", expr)), classes, pool, set())) == ["gpu-2"]


def test_match_attribute_keeps_the_devices_on_one_parent(classes):
    pool = slices(mig(0, 1, "1g.5gb"), mig(0, 2, "2g.10gb"), mig(1, 1, "1g.5gb"), mig(1, 2, "1g.5gb"),
                  mig(1, 3, "2g.10gb"))
    sel = "device.attributes['gpu.nvidia.com'].profile == '{}'"
    c = claim(request("a", "mig.nvidia.com", sel.format("1g.5gb")),
              request("b", "mig.nvidia.com", sel.format("1g.5gb")),
              request("c", "mig.nvidia.com", sel.format("2g.10gb")),
              constraints=[{"requests": [], "matchAttribute": "gpu.nvidia.com/parentUUID"}])
    assert picked(scheduler.allocate(c, classes, pool, set())) == ["gpu-1-mig-1", "gpu-1-mig-2", "gpu-1-mig-3"]


def test_configs_keep_their_requests_and_source(classes):
    cfg = {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"kind": "GpuConfig"}}}
    got = scheduler.allocate(claim(request("gpu"), config=[cfg]), classes, slices(gpu(0)), set())
    assert got["devices"]["config"] == [{"source": "FromClaim", **cfg}]


@pytest.mark.parametrize("req,field", [
    (request("gpu", "gpu.nvidia.com", "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('1Gi')) > 0"),
     "CEL capacity"),
    (request("gpu", adminAccess=True), "spec.devices.requests[0].exactly.adminAccess"),
    ({"name": "gpu", "firstAvailable": []}, "spec.devices.requests[0].firstAvailable"),
])
def test_what_the_stand_in_does_not_do_is_refused_by_name(classes, req, field):
    with pytest.raises(podspec.Unsupported) as err:
        scheduler.allocate(claim(req), classes, slices(gpu(0)), set())
    assert err.value.path == field


def test_a_cel_error_fails_the_allocation(classes):
    with pytest.raises(AssertionError, match="no_such"):
        scheduler.allocate(claim(request("gpu", "gpu.nvidia.com", "device.attributes['gpu.nvidia.com'].no_such == 1")),
                           classes, slices(gpu(0)), set())
