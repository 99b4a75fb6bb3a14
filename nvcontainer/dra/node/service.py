"""The gRPC services the kubelet calls: the plugin watcher's Registration (``GetInfo``,
``NotifyRegistrationStatus``) and DRAPlugin (``NodePrepareResources``,
``NodeUnprepareResources``) in both versions kubelets 1.32-1.34 speak, v1beta1 and v1.

Why both versions from one code: v1 and v1beta1 are the same messages under two package names
(v1 adds an optional ``share_id``); the kubelet picks the newest service the plugin names at
registration, so a 1.32 kubelet calls v1beta1 and a 1.34 one v1. One class serves either,
given the generated module. Each claim gets its own entry in the answer: one that fails is an
``error`` string naming it (the kubelet retries it), the others are prepared; an RPC error is
kept for a request that is not a valid message at all.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from ... import log
from ...errors import NvcError, escape
from ...kubelet.endpoint import Malformed, unary
from ..registration import api_pb2 as reg
from ..v1 import api_pb2 as v1
from ..v1beta1 import api_pb2 as v1beta1

PLUGIN_TYPE = "DRAPlugin"
VERSIONS = {"v1.DRAPlugin": v1, "v1beta1.DRAPlugin": v1beta1}
MAX_CLAIMS = 1024


class Registration:
    """What the plugin watcher asks of the registration socket."""

    def __init__(self, driver: str, endpoint: str, say):
        self.driver = driver
        self.endpoint = endpoint
        self.say = say
        self.registered = None            # the last status the kubelet sent

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler("pluginregistration.Registration", {
            "GetInfo": unary(self.get_info, reg.InfoRequest, reg.PluginInfo),
            "NotifyRegistrationStatus": unary(self.notify, reg.RegistrationStatus, reg.RegistrationStatusResponse),
        })

    async def get_info(self, request, context):
        return reg.PluginInfo(type=PLUGIN_TYPE, name=self.driver, endpoint=self.endpoint,
                              supported_versions=list(VERSIONS))

    async def notify(self, request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {escape(request.why, 120)}")
        if request.plugin_registered:
            if self.registered is not True:
                self.say(f"registered with the kubelet as {self.driver}")
        else:
            self.say(f"the kubelet refused the registration: {escape(request.error, 300)}")
        self.registered = request.plugin_registered
        return reg.RegistrationStatusResponse()


class DraService:
    """NodePrepareResources and NodeUnprepareResources of one API version over a
    :class:`prepare.Preparer`."""

    def __init__(self, preparer, pb, say):
        self.preparer = preparer
        self.pb = pb
        self.say = say

    def handler(self) -> grpc.GenericRpcHandler:
        pb = self.pb
        return grpc.method_handlers_generic_handler(f"{pb.DESCRIPTOR.package}.DRAPlugin", {
            "NodePrepareResources": unary(self.prepare, pb.NodePrepareResourcesRequest,
                                          pb.NodePrepareResourcesResponse),
            "NodeUnprepareResources": unary(self.unprepare, pb.NodeUnprepareResourcesRequest,
                                            pb.NodeUnprepareResourcesResponse),
        })

    async def _claims(self, request, context, method: str):
        if isinstance(request, Malformed):
            message = f"malformed request: {escape(request.why, 120)}"
        elif len(request.claims) > MAX_CLAIMS:
            message = f"more than {MAX_CLAIMS} claims in one call"
        else:
            return list(request.claims)
        self.say(f"{method} refused: {message}")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    async def prepare(self, request, context):
        claims = await self._claims(request, context, "NodePrepareResources")
        left = context.time_remaining()
        deadline = time.monotonic() + left if left is not None else None
        out = self.pb.NodePrepareResourcesResponse()
        results = await asyncio.gather(*(
            self._one("prepare", self.preparer.prepare(c.namespace, c.name, c.uid, deadline), c) for c in claims))
        for claim, (error, devices) in zip(claims, results):
            entry = out.claims[claim.uid]
            if error:
                entry.error = error
                continue
            for d in devices:
                device = entry.devices.add(request_names=[d.request], pool_name=d.pool,
                                           device_name=d.device, cdi_device_ids=list(d.cdi))
                if d.share_id and "share_id" in device.DESCRIPTOR.fields_by_name:
                    device.share_id = d.share_id
            log.info(f"prepared {claim.namespace}/{claim.name} ({claim.uid}): "
                     f"{', '.join(d.device for d in devices) or 'no device of this node'}")
        return out

    async def unprepare(self, request, context):
        claims = await self._claims(request, context, "NodeUnprepareResources")
        out = self.pb.NodeUnprepareResourcesResponse()
        results = await asyncio.gather(*(
            self._one("unprepare", self.preparer.unprepare(c.namespace, c.name, c.uid), c) for c in claims))
        for claim, (error, _) in zip(claims, results):
            out.claims[claim.uid].error = error
            if not error:
                log.info(f"unprepared {claim.namespace}/{claim.name} ({claim.uid})")
        return out

    async def _one(self, what: str, call, claim) -> tuple[str, object]:
        """("", result) or (the one-line error for the claim's entry, None): the claims of one
        call are done side by side, and one that fails, even unexpectedly, fails alone."""
        label = f"{escape(claim.namespace, 80)}/{escape(claim.name, 120)}"
        try:
            return "", await call
        except NvcError as exc:
            error = exc.detail
        except Exception as exc:      # a bug must cost the claim, not the call or the plugin
            error = f"claim {label}: internal error: {type(exc).__name__}: {escape(str(exc), 200)}"
        self.say(f"{what} {label} failed: {error}")
        return error, None
