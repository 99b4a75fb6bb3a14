"""The DevicePlugin gRPC service for one resource: protobuf in, the pure decisions, protobuf out.

Handlers are built with :func:`kubelet.endpoint.unary`, whose deserializer turns a request that
is not valid protobuf into a value the handler refuses with one line and ``INVALID_ARGUMENT``;
every refusal is logged once, escaped, and the server keeps serving. The method names and message types are still the generated module's, so the wire
contract stays the one in ``v1beta1/api.proto``.
"""

from __future__ import annotations

import uuid

import grpc

from .. import log
from ..errors import escape
from ..kubelet.endpoint import Malformed, parser, unary
from .allocate import Refused, allocate
from .devices import Resource
from .preferred import preferred
from .state import HEALTHY, UNHEALTHY, PluginState
from .v1beta1 import api_pb2 as pb

SERVICE = "v1beta1.DevicePlugin"
MAX_STREAMS = 4           # ListAndWatch streams at once per resource (the kubelet keeps one)
_CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "unhealthy": grpc.StatusCode.FAILED_PRECONDITION}


def devices_message(state: PluginState, resource: Resource) -> pb.ListAndWatchResponse:
    unhealthy = state.unhealthy(resource)
    out = pb.ListAndWatchResponse()
    for d in resource.devices:
        device = out.devices.add(ID=d.id, health=UNHEALTHY if d.id in unhealthy else HEALTHY)
        if d.numa is not None:
            device.topology.nodes.add(ID=d.numa)
    return out


class DevicePluginService:
    def __init__(self, state: PluginState, resource: Resource, say):
        self.state = state
        self.resource = resource
        self.say = say
        self.streams = 0

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "GetDevicePluginOptions": unary(self.options, pb.Empty, pb.DevicePluginOptions),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self.list_and_watch, request_deserializer=parser(pb.Empty),
                response_serializer=pb.ListAndWatchResponse.SerializeToString),
            "GetPreferredAllocation": unary(self.preferred, pb.PreferredAllocationRequest,
                                            pb.PreferredAllocationResponse),
            "Allocate": unary(self.allocate, pb.AllocateRequest, pb.AllocateResponse),
            "PreStartContainer": unary(self.pre_start, pb.PreStartContainerRequest, pb.PreStartContainerResponse),
        })

    async def _refuse(self, context, method: str, code: str, message: str):
        self.say(f"{method} for {self.resource.name} refused: {message}")
        await context.abort(_CODES.get(code, grpc.StatusCode.INVALID_ARGUMENT), message)

    async def _check(self, request, context, method: str):
        if isinstance(request, Malformed):
            await self._refuse(context, method, "invalid", f"malformed request: {escape(request.why, 120)}")

    async def options(self, request, context):
        await self._check(request, context, "GetDevicePluginOptions")
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def list_and_watch(self, request, context):
        await self._check(request, context, "ListAndWatch")
        if self.streams >= MAX_STREAMS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"already {MAX_STREAMS} ListAndWatch streams for {self.resource.name}")
        self.streams += 1
        log.info(f"ListAndWatch for {self.resource.name} opened")
        try:
            seen, sent = None, None
            while not self.state.stopping:
                if seen != self.state.version:
                    seen = self.state.version
                    message = devices_message(self.state, self.resource)
                    if message != sent:      # another resource's change is not this stream's
                        sent = message
                        yield message
                await self.state.changed(seen)
        finally:
            self.streams -= 1
            log.info(f"ListAndWatch for {self.resource.name} closed")

    async def preferred(self, request, context):
        await self._check(request, context, "GetPreferredAllocation")
        out = pb.PreferredAllocationResponse()
        spread = self.state.settings.replicas > 1
        try:
            for creq in request.container_requests:
                ids = preferred(creq.available_deviceIDs, creq.must_include_deviceIDs, creq.allocation_size,
                                self.resource, self.state.topology, spread=spread)
                out.container_responses.add(deviceIDs=ids)
        except Refused as exc:
            await self._refuse(context, "GetPreferredAllocation", exc.code, exc.message)
        return out

    async def allocate(self, request, context):
        await self._check(request, context, "Allocate")
        out = pb.AllocateResponse()
        unhealthy = self.state.unhealthy(self.resource)
        try:
            for creq in request.container_requests:
                got = allocate(creq.devices_ids, self.resource, unhealthy, self.state.settings, str(uuid.uuid4()),
                               self.state.mps)
                resp = out.container_responses.add()
                resp.envs.update(dict(got.envs))
                resp.annotations.update(dict(got.annotations))
                for m in got.mounts:
                    resp.mounts.add(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                for name in got.cdi_devices:
                    resp.cdi_devices.add(name=name)
        except Refused as exc:
            await self._refuse(context, "Allocate", exc.code, exc.message)
        log.info(f"Allocate for {self.resource.name}: "
                 + "; ".join(",".join(escape(i, 80) for i in c.devices_ids) for c in request.container_requests))
        return out

    async def pre_start(self, request, context):
        await self._check(request, context, "PreStartContainer")
        return pb.PreStartContainerResponse()
