"""The DRA kubelet plugin's API modules: kept in the repository (a node needs no protoc), so
they must be exactly what grpcio-tools makes of the ``.proto`` files beside them, and those
must say what the kubelet's published definitions say (k8s.io/kubelet/pkg/apis/
pluginregistration/v1 and dra/v1, dra/v1beta1): field numbers, packages and method paths are the
wire contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvcontainer.dra.registration import api_pb2 as reg
from nvcontainer.dra.v1 import api_pb2 as v1
from nvcontainer.dra.v1beta1 import api_pb2 as v1beta1
from tests.test_deviceplugin_proto import check_generated

HOW = "docs/engines/kubernetes-dra-node.md, 'The kubelet's APIs'"


@pytest.mark.parametrize("api", ["registration", "v1", "v1beta1"])
def test_generated_modules_match_the_proto(tmp_path, api):
    check_generated(tmp_path, Path(f"nvcontainer/dra/{api}/api.proto"), HOW)


# Transcribed from the published definitions, independently of the .proto files.
REGISTRATION = {
    "PluginInfo": {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4},
    "RegistrationStatus": {"plugin_registered": 1, "error": 2},
    "RegistrationStatusResponse": {},
    "InfoRequest": {},
}
DRA = {
    "NodePrepareResourcesRequest": {"claims": 1},
    "NodePrepareResourcesResponse": {"claims": 1},
    "NodePrepareResourceResponse": {"devices": 1, "error": 2},
    "Device": {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4},
    "NodeUnprepareResourcesRequest": {"claims": 1},
    "NodeUnprepareResourcesResponse": {"claims": 1},
    "NodeUnprepareResourceResponse": {"error": 1},
    "Claim": {"namespace": 1, "uid": 2, "name": 3},
}
DRA_V1 = {**DRA, "Device": {**DRA["Device"], "share_id": 5}}
DRA_METHODS = {
    "NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
    "NodeUnprepareResources": ("NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse"),
}


def _messages(desc):
    return {name: {f.name: f.number for f in m.fields} for name, m in desc.message_types_by_name.items()}


def _services(desc):
    return {s.full_name: {m.name: (m.input_type.name, m.output_type.name) for m in s.methods}
            for s in desc.services_by_name.values()}


@pytest.mark.parametrize("module, package, contract", [
    (v1, "k8s.io.kubelet.pkg.apis.dra.v1", DRA_V1),
    (v1beta1, "k8s.io.kubelet.pkg.apis.dra.v1beta1", DRA),
])
def test_the_dra_protos_are_the_published_contract(module, package, contract):
    assert module.DESCRIPTOR.package == package
    assert _messages(module.DESCRIPTOR) == contract
    assert _services(module.DESCRIPTOR) == {f"{package}.DRAPlugin": DRA_METHODS}


def test_the_registration_proto_is_the_published_contract():
    assert reg.DESCRIPTOR.package == "pluginregistration"
    assert _messages(reg.DESCRIPTOR) == REGISTRATION
    assert _services(reg.DESCRIPTOR) == {"pluginregistration.Registration": {
        "GetInfo": ("InfoRequest", "PluginInfo"),
        "NotifyRegistrationStatus": ("RegistrationStatus", "RegistrationStatusResponse")}}


def test_wire_format_of_a_prepare_response():
    """Bytes a Go kubelet would decode: map entry (field 1) keyed by the UID, its value
    (field 2) holding a Device (field 1) whose cdi_device_ids is field 4."""
    resp = v1.NodePrepareResourcesResponse()
    resp.claims["u"].devices.add(pool_name="n", device_name="gpu-0", cdi_device_ids=["k/c=u-gpu-0"])
    device = b"\x12\x01n\x1a\x05gpu-0\x22\x0bk/c=u-gpu-0"
    value = b"\x0a" + bytes([len(device)]) + device
    entry = b"\x0a\x01u\x12" + bytes([len(value)]) + value
    assert resp.SerializeToString() == b"\x0a" + bytes([len(entry)]) + entry
