"""Which pod holds which GPU: the kubelet's PodResources API (v1 ``List``), as dcgm-exporter asks.

A GPU series then carries ``namespace``, ``pod`` and ``container`` (and, for a DRA claim,
``dra_claim_name``, ``dra_claim_namespace``, ``dra_driver_name``, ``dra_pool_name``,
``dra_device_name``, as dcgm-exporter labels them). Device-plugin allocations name devices by
the IDs our plugin (or NVIDIA's) advertised: a GPU or MIG UUID, an index token (``0``, ``0:1``),
either with ``::<k>`` under time-slicing; DRA allocations by the driver's device name
(``gpu-0``, ``gpu-0-mig-...``), looked up in the inventory as the DRA driver does.

:func:`attribute` is pure (a decoded response and the inventory in, UUID → holders out);
:class:`Kubelet` is the shell: one channel, each call bounded by a deadline, and whatever goes
wrong (no socket, no answer in time, a reply that does not decode) is one line when it starts
and another when it ends, and this scrape's GPU series go out without pod labels.
"""

from __future__ import annotations

import os

from ..dra import names as dra_names
from ..errors import NvcError

SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
MAX_MESSAGE = 16 << 20
DRA_DRIVERS = (dra_names.DRIVER,)


def _tokens(inv) -> dict[str, str]:
    """Every ID a device plugin may advertise for a unit → that unit's UUID."""
    out = {}
    for gpu in inv.gpus:
        out[gpu.uuid] = out[str(gpu.index)] = gpu.uuid
        for mig in gpu.migs:
            out[mig.uuid] = out[f"{gpu.index}:{mig.index}"] = mig.uuid
    return out


def attribute(response, inv) -> dict[str, list[dict]]:
    """UUID (GPU or MIG) → the label sets of the pod containers that hold it, in the kubelet's order."""
    tokens = _tokens(inv)
    out: dict[str, list[dict]] = {}

    def add(uuid: str, labels: dict) -> None:
        holders = out.setdefault(uuid, [])
        if labels not in holders:
            holders.append(labels)

    for pod in response.pod_resources:
        for c in pod.containers:
            base = {"namespace": pod.namespace, "pod": pod.name, "container": c.name}
            for devices in c.devices:
                for device_id in devices.device_ids:
                    uuid = tokens.get(device_id.split("::", 1)[0])
                    if uuid is not None:
                        add(uuid, dict(base))
            for dynamic in c.dynamic_resources:
                for claimed in dynamic.claim_resources:
                    if claimed.driver_name not in DRA_DRIVERS:
                        continue
                    try:
                        uuid = dra_names.lookup(inv, claimed.device_name).uuid
                    except NvcError:
                        continue
                    add(uuid, {**base, "dra_claim_name": dynamic.claim_name,
                               "dra_claim_namespace": dynamic.claim_namespace,
                               "dra_driver_name": claimed.driver_name, "dra_pool_name": claimed.pool_name,
                               "dra_device_name": claimed.device_name})
    return out


class Kubelet:
    """``holders(inv)``: :func:`attribute` of a fresh ``List``, or None when the kubelet did not
    answer (then ``why`` says why, once per change)."""

    def __init__(self, socket: str, say, timeout: float = 2.0):
        self.socket, self.say, self.timeout = socket, say, timeout
        self.channel = None
        self.stub = None
        self.state = "unknown"

    def _tell(self, state: str, line: str) -> None:
        if state != self.state:
            self.state = state
            self.say(line)

    def _connect(self) -> None:
        import grpc

        from .podresources import api_pb2_grpc

        self.channel = grpc.insecure_channel(
            f"unix://{self.socket}",
            options=[("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.enable_retries", 0)])
        self.stub = api_pb2_grpc.PodResourcesListerStub(self.channel)

    def holders(self, inv) -> dict[str, list[dict]] | None:
        import grpc

        from .podresources import api_pb2

        if not os.path.exists(self.socket):
            self._tell("missing", f"metrics: no kubelet PodResources socket at {self.socket}: no pod labels")
            return None
        if self.stub is None:
            self._connect()
        try:
            response = self.stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            detail = exc.details() if callable(getattr(exc, "details", None)) else ""
            name = code.name.lower() if code is not None else "error"
            self._tell(f"rpc:{name}", f"metrics: the kubelet's PodResources List failed ({name}: "
                                      f"{(detail or '').splitlines()[0][:200] if detail else 'no detail'}): "
                                      "no pod labels")
            self.close()
            return None
        except Exception as exc:   # a reply that does not decode, whatever grpc makes of it
            self._tell("garbage", f"metrics: the kubelet's PodResources reply could not be read "
                                  f"({type(exc).__name__}): no pod labels")
            self.close()
            return None
        self._tell("ok", "metrics: the kubelet's PodResources API answers: pod labels on")
        return attribute(response, inv)

    def close(self) -> None:
        channel, self.channel, self.stub = self.channel, None, None
        if channel is not None:
            channel.close()
