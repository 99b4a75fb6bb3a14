"""Pod labels from the kubelet's PodResources API (v1 List), against a fake kubelet served from
the same published definition: device-plugin and DRA allocations, and a kubelet that is missing,
slow, or answers garbage."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from nvcontainer.metrics import pods
from nvcontainer.metrics.podresources import api_pb2 as pr
from nvcontainer.metrics.podresources import api_pb2_grpc
from tests.test_deviceplugin_proto import check_generated
from tests.test_metrics_core import U0, U1, inventory


def test_generated_modules_match_the_proto(tmp_path):
    check_generated(tmp_path, Path("nvcontainer/metrics/podresources/api.proto"),
                    "grpc_tools.protoc -I. --python_out=. --grpc_python_out=. nvcontainer/metrics/podresources/api.proto")


# Transcribed from k8s.io/kubelet/pkg/apis/podresources/v1/api.proto, independently of ours.
CONTRACT = {
    "ListPodResourcesRequest": {}, "ListPodResourcesResponse": {"pod_resources": 1},
    "PodResources": {"name": 1, "namespace": 2, "containers": 3, "cpu_ids": 4, "memory": 5},
    "ContainerResources": {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4, "dynamic_resources": 5},
    "ContainerDevices": {"resource_name": 1, "device_ids": 2, "topology": 3},
    "DynamicResource": {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4},
    "ClaimResource": {"cdi_devices": 1, "driver_name": 2, "pool_name": 3, "device_name": 4, "share_id": 5},
    "CDIDevice": {"name": 1}, "TopologyInfo": {"nodes": 1}, "NUMANode": {"ID": 1},
}


def test_the_wire_contract():
    desc = pr.DESCRIPTOR
    assert desc.package == "v1"
    for message, fields in CONTRACT.items():
        assert {f.name: f.number for f in desc.message_types_by_name[message].fields} == fields, message
    service = desc.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister" and "List" in service.methods_by_name


def response() -> pr.ListPodResourcesResponse:
    return pr.ListPodResourcesResponse(pod_resources=[
        pr.PodResources(name="train-0", namespace="ml", containers=[
            pr.ContainerResources(name="main", devices=[
                pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[U0]),
                pr.ContainerDevices(resource_name="example.com/nic", device_ids=["eth9"])])]),
        pr.PodResources(name="shared-a", namespace="dev", containers=[
            pr.ContainerResources(name="c", devices=[pr.ContainerDevices(resource_name="nvidia.com/gpu",
                                                                         device_ids=["1::2"])])]),
        pr.PodResources(name="dra-pod", namespace="inf", containers=[
            pr.ContainerResources(name="ctr", dynamic_resources=[pr.DynamicResource(
                claim_name="single-gpu", claim_namespace="inf", claim_resources=[
                    pr.ClaimResource(driver_name="gpu.nvidia.com", pool_name="node-1", device_name="gpu-3",
                                     cdi_devices=[pr.CDIDevice(name="k8s.gpu.nvidia.com/claim=x-gpu-3")]),
                    pr.ClaimResource(driver_name="other.example.com", pool_name="p", device_name="gpu-0")])])]),
    ])


def test_attribute_device_plugin_and_dra_allocations():
    got = pods.attribute(response(), inventory())
    assert got[U0] == [{"namespace": "ml", "pod": "train-0", "container": "main"}]
    assert got[U1] == [{"namespace": "dev", "pod": "shared-a", "container": "c"},
                       {"namespace": "inf", "pod": "dra-pod", "container": "ctr", "dra_claim_name": "single-gpu",
                        "dra_claim_namespace": "inf", "dra_driver_name": "gpu.nvidia.com",
                        "dra_pool_name": "node-1", "dra_device_name": "gpu-3"}]


class FakeKubelet:
    """A PodResourcesLister on a unix socket: ``mode`` ok, slow or garbage (bytes that are not
    the message)."""

    def __init__(self, path: Path):
        self.mode = "ok"
        self.calls = 0
        self.executor = futures.ThreadPoolExecutor(max_workers=4)
        self.server = grpc.server(self.executor)
        handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
            "List": grpc.unary_unary_rpc_method_handler(
                self.list, request_deserializer=pr.ListPodResourcesRequest.FromString,
                response_serializer=self.serialize)})
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def list(self, request, context):
        self.calls += 1
        if self.mode == "slow":
            time.sleep(1.5)
        return response()

    def serialize(self, message) -> bytes:
        return b"\xff\xff\xff\xff garbage" if self.mode == "garbage" else message.SerializeToString()

    def stop(self):
        """The server and its threads gone: tests that fork in-process workers after this one
        refuse to fork from a multi-threaded process (apply/worker.py)."""
        self.server.stop(0).wait(5)
        self.executor.shutdown(wait=True)


def test_the_fake_kubelet_is_served_by_the_generated_stub_too(tmp_path):
    kubelet = FakeKubelet(tmp_path / "kubelet.sock")
    try:
        with grpc.insecure_channel(f"unix://{tmp_path / 'kubelet.sock'}") as channel:
            got = api_pb2_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(), timeout=5)
        assert got == response()
    finally:
        kubelet.stop()


def test_holders_through_missing_slow_garbage_and_back(tmp_path):
    path = tmp_path / "kubelet.sock"
    lines = []
    client = pods.Kubelet(str(path), lines.append, timeout=0.5)
    assert client.holders(inventory()) is None
    assert len(lines) == 1 and "no kubelet PodResources socket" in lines[0]
    assert client.holders(inventory()) is None and len(lines) == 1      # one line per change
    kubelet = FakeKubelet(path)
    try:
        got = client.holders(inventory())
        assert got[U0][0]["pod"] == "train-0" and "answers" in lines[-1]
        kubelet.mode = "slow"
        start = time.monotonic()
        assert client.holders(inventory()) is None
        assert time.monotonic() - start < 1.4 and "deadline_exceeded" in lines[-1]
        kubelet.mode = "garbage"
        assert client.holders(inventory()) is None
        assert "PodResources" in lines[-1] and "\n" not in lines[-1]
        kubelet.mode = "ok"
        assert client.holders(inventory())[U1][0]["pod"] == "shared-a" and "answers" in lines[-1]
        assert len(lines) == 5, lines
    finally:
        kubelet.stop()
        client.close()


def test_a_socket_that_speaks_no_grpc(tmp_path):
    path = tmp_path / "kubelet.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    stop = threading.Event()

    def babble():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            try:
                conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n\x00\x01garbage" * 10)
            except OSError:
                pass
            conn.close()

    thread = threading.Thread(target=babble, daemon=True)
    thread.start()
    lines = []
    client = pods.Kubelet(str(path), lines.append, timeout=1.0)
    try:
        assert client.holders(inventory()) is None
        assert len(lines) == 1 and "no pod labels" in lines[0] and "\n" not in lines[0]
    finally:
        stop.set()
        thread.join()
        listener.close()
        client.close()


@pytest.fixture(autouse=True)
def _quiet_grpc(monkeypatch):
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")
