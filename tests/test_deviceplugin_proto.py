"""The Device Plugin API modules: kept in the repository (a node needs no protoc), so they must be
exactly what grpcio-tools makes of ``v1beta1/api.proto``, and that file must say what the
kubelet's published definition says (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto):
the field numbers and the method paths are the wire contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("nvcontainer/deviceplugin/v1beta1/api.proto")
GENERATED = ("api_pb2.py", "api_pb2_grpc.py")


def test_generated_modules_match_the_proto(tmp_path):
    check_generated(tmp_path, PROTO, "README, 'Device plugin'")


def check_generated(tmp_path, proto: Path, how: str) -> None:
    """grpcio-tools run on ``proto`` (a path from the repository's root) makes exactly the
    modules kept beside it."""
    pytest.importorskip("grpc_tools")
    (tmp_path / proto.parent).mkdir(parents=True)
    shutil.copy(ROOT / proto, tmp_path / proto)
    res = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.",
                          str(proto)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for name in GENERATED:
        assert (tmp_path / proto.parent / name).read_bytes() == (ROOT / proto.parent / name).read_bytes(), \
            f"{name} is stale: regenerate it ({how})"


# Transcribed from the published definition, independently of api.proto: message -> field -> number.
CONTRACT = {
    "DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
    "RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
    "Empty": {},
    "ListAndWatchResponse": {"devices": 1},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "Device": {"ID": 1, "health": 2, "topology": 3},
    "PreStartContainerRequest": {"devices_ids": 1},
    "PreStartContainerResponse": {},
    "PreferredAllocationRequest": {"container_requests": 1},
    "ContainerPreferredAllocationRequest": {"available_deviceIDs": 1, "must_include_deviceIDs": 2,
                                            "allocation_size": 3},
    "PreferredAllocationResponse": {"container_responses": 1},
    "ContainerPreferredAllocationResponse": {"deviceIDs": 1},
    "AllocateRequest": {"container_requests": 1},
    "ContainerAllocateRequest": {"devices_ids": 1},
    "CDIDevice": {"name": 1},
    "AllocateResponse": {"container_responses": 1},
    "ContainerAllocateResponse": {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5},
    "Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
    "DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
}
METHODS = {
    "v1beta1.Registration": {"Register": ("RegisterRequest", "Empty", False)},
    "v1beta1.DevicePlugin": {
        "GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "GetPreferredAllocation": ("PreferredAllocationRequest", "PreferredAllocationResponse", False),
        "Allocate": ("AllocateRequest", "AllocateResponse", False),
        "PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    },
}


def test_the_proto_is_the_published_contract():
    desc = pb.DESCRIPTOR
    assert desc.package == "v1beta1"
    messages = {name: {f.name: f.number for f in m.fields} for name, m in desc.message_types_by_name.items()}
    assert messages == CONTRACT
    services = {
        s.full_name: {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in s.methods}
        for s in desc.services_by_name.values()
    }
    assert services == METHODS


def test_wire_format_of_an_allocate_response():
    """Bytes a Go kubelet would decode: field 5 (cdi_devices) holding field 1 (name)."""
    resp = pb.ContainerAllocateResponse()
    resp.cdi_devices.add(name="nvidia.com/gpu=0")
    assert resp.SerializeToString() == b"\x2a\x12\x0a\x10nvidia.com/gpu=0"
