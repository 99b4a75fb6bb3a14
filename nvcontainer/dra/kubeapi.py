"""The API server, as the DRA driver needs it: one ResourceClaim read, this node's ResourceSlices
written (owned by its Node). Plain dicts in and out.

Why lightkube (a small, maintained client: httpx, its own models, no code generation at
import): it reads a kubeconfig (``--kubeconfig``, ``$KUBECONFIG``) and the in-cluster service
account the way kubectl does (tokens, client certificates, exec plugins, the cluster CA), and
builds the resource paths; the official ``kubernetes`` package does the same with a generated
class per API version and a start-up several times longer. What we need of it is small, so it
is used at one level: configuration, authentication, paths, TLS; the bodies are the plain JSON
the API server speaks, in whichever of ``resource.k8s.io/v1``, ``v1beta2`` and ``v1beta1`` it
serves (Kubernetes 1.34 serves all three, 1.33 the two betas, 1.32 only ``v1beta1``).

Why the deadlines: the kubelet gives a prepare a fixed time, and a publisher must not hang on
a dead API server while the GPUs' health changes. Every attempt has its own timeout, failures
that may pass (no connection, a timeout, 429, 5xx) are retried with a doubling pause, and
nothing goes on past the ``deadline`` the caller passes (a :func:`time.monotonic` value). A
failure is one :class:`NvcError` line naming the call and the last reason.

Why the deadline reaches every socket operation (:mod:`.deadline`): httpx's timeouts are per
read, so a server that trickles its answer a byte a second kept a call with a 3 s deadline
reading for as long as it liked, and seven such claims held every worker thread of the plugin.
Each connect, write and read is given what is left of the call's deadline at most. And a body is
read to MAX_BODY bytes and no further (a fast 128 MiB answer was read whole), uncompressed
(asked so: a small gzip answer can inflate without bound), and parsed by the one bounded JSON
reader (:mod:`nvcontainer.documents`): an answer that is not a JSON object of the kind asked
for (an HTML page from a proxy, an array) is refused with a line, not taken for a claim.
"""

from __future__ import annotations

import os
import random
import re
import time

from .. import documents
from ..errors import NvcError, escape
from . import deadline as bounded
from .names import DRIVER

GROUP = "resource.k8s.io"
VERSIONS = ("v1", "v1beta2", "v1beta1")       # newest first: the first the server serves is used
DEFAULT_TIMEOUT = 10.0                          # one attempt
DEFAULT_BUDGET = 30.0                           # a call, when the caller gives no deadline
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 2.0
RETRIED = frozenset({408, 429, 500, 502, 503, 504})
MAX_BODY = 3 << 20          # bytes of one answer: etcd keeps an object of 1.5 MiB at most, the API server takes 3 MiB
PAGE = 500                  # slices a list page asks for (this node's, this driver's: a few)
CHUNK = 1 << 16

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

# What this module asks of the API server: (resource, verb). The RBAC test derives the
# ClusterRole's rules from the calls below and checks them against this table and the manifest.
USED = frozenset({("resourceclaims", "get"), ("nodes", "get"), ("resourceslices", "list"),
                  ("resourceslices", "create"), ("resourceslices", "update"), ("resourceslices", "delete")})


def _resources(version: str):
    from lightkube.generic_resource import create_global_resource, create_namespaced_resource

    return (create_namespaced_resource(GROUP, version, "ResourceClaim", "resourceclaims"),
            create_global_resource(GROUP, version, "ResourceSlice", "resourceslices"))


def load_config(kubeconfig: str | None = None, *, service_account: str | None = None):
    """The client configuration: ``kubeconfig`` if given, else the in-cluster service account
    when running in a pod, else ``$KUBECONFIG`` or ``~/.kube/config``."""
    from lightkube.config.kubeconfig import KubeConfig
    from lightkube.core.exceptions import ConfigError
    from yaml import YAMLError

    try:
        if kubeconfig:
            return KubeConfig.from_file(kubeconfig)
        if service_account is not None:
            return KubeConfig.from_service_account(service_account)
        return KubeConfig.from_env()
    except (ConfigError, YAMLError, OSError, KeyError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        where = escape(kubeconfig or service_account or os.environ.get("KUBECONFIG", "in-cluster"), 120)
        why = "nested too deeply" if isinstance(exc, RecursionError) else _why(exc)
        raise NvcError("kubernetes", f"kubeconfig {where}: {why}") from None


class KubeApi:
    """``get_claim`` and the slice calls. Thread-safe (one httpx client); the served API
    version is found on first use and kept."""

    def __init__(self, config, *, timeout: float = DEFAULT_TIMEOUT, field_manager: str = "nvcontainer-dra-driver"):
        import httpx2
        from lightkube import Client
        from lightkube.config.client_adapter import ExecAuth

        self.timeout = timeout
        try:
            self._client = Client(config, timeout=httpx2.Timeout(timeout), trust_env=False,
                                  field_manager=field_manager)
        except Exception as exc:    # lightkube's configuration errors come in many types
            raise NvcError("kubernetes", f"client configuration: {_why(exc)}") from None
        self._generic = self._client._client       # lightkube's request builder (public methods)
        bounded.install(self._generic._client)     # every socket operation within the call's deadline
        if isinstance(self._generic._client.auth, ExecAuth):   # it waits for the plugin for ever
            from .execplugin import Credentials

            config = self._generic.config
            self._generic._client.auth = exec_auth(
                Credentials(config.user.exec, str(config.fname.parent) if config.fname else None))
        self.server = escape(self._generic.config.cluster.server, 120)
        self.version: str | None = None

    def close(self) -> None:
        self._client.close()

    # -- claims ----------------------------------------------------------------------------

    def get_claim(self, namespace: str, name: str, *, deadline: float | None = None) -> dict:
        """The ResourceClaim as the server serves it (``apiVersion`` says which version).
        NvcError when it does not exist (``category == "kubernetes"``, detail ends "not found")."""
        what = f"get resourceclaim {escape(namespace, 80)}/{escape(name, 80)}"
        _named(what, namespace, _DNS_LABEL, "namespace")
        _named(what, name, _DNS_SUBDOMAIN, "name")
        deadline = _deadline(deadline)
        for version in self._versions():
            claim, _ = _resources(version)
            status, body = self._call(what, deadline, "get", claim, name=name, namespace=namespace)
            if status == 404 and _unserved(body):
                continue
            self.version = version
            return self._checked(what, status, body, kind="ResourceClaim")
        raise NvcError("kubernetes", f"{what}: {self.server} serves no {GROUP} version of {', '.join(VERSIONS)}")

    # -- the node ----------------------------------------------------------------------------

    def get_node(self, name: str, *, deadline: float | None = None) -> dict:
        """The Node object (its ``metadata.uid`` owns the node's slices, so they are collected
        when the node is deleted)."""
        from lightkube.resources.core_v1 import Node

        what = f"get node {escape(name, 80)}"
        _named(what, name, _DNS_SUBDOMAIN, "node name")
        status, body = self._call(what, _deadline(deadline), "get", Node, name=name)
        return self._checked(what, status, body, kind="Node")

    # -- slices ----------------------------------------------------------------------------

    def list_slices(self, node: str, driver: str = DRIVER, *, deadline: float | None = None) -> list[dict]:
        """Every ResourceSlice of ``driver`` on ``node`` (field selectors, then checked again)."""
        what = f"list resourceslices of node {escape(node, 80)}"
        _named(what, node, _DNS_SUBDOMAIN, "node name")
        deadline = _deadline(deadline)
        selector = f"spec.nodeName={node},spec.driver={driver}"
        items: list[dict] = []
        cont = None
        for _ in range(1000):
            params = {"fieldSelector": selector, "limit": PAGE, "continue": cont}
            body = self._slices_call(what, deadline, "list", params=params)
            items.extend(as_v1(i) for i in body.get("items") or () if isinstance(i, dict) and _mine(i, node, driver))
            cont = (body.get("metadata") or {}).get("continue")
            if not cont:
                return items
        raise NvcError("kubernetes", f"{what}: more than 1000 pages")

    def create_slice(self, obj: dict, *, deadline: float | None = None) -> dict:
        what = f"create resourceslice {escape((obj.get('metadata') or {}).get('name') or '(generated)', 80)}"
        return self._slices_call(what, _deadline(deadline), "post", obj=obj)

    def update_slice(self, obj: dict, *, deadline: float | None = None) -> dict:
        """Replace a slice; its ``metadata.resourceVersion`` must be the one read (a conflict is
        an error, not retried: the caller reads again)."""
        name = (obj.get("metadata") or {}).get("name") or ""
        return self._slices_call(f"update resourceslice {escape(name, 80)}", _deadline(deadline), "put",
                                 obj=obj, name=name)

    def delete_slice(self, name: str, *, deadline: float | None = None) -> None:
        """Delete a slice; one that is already gone is not an error."""
        _named(f"delete resourceslice {escape(name, 80)}", name, _DNS_SUBDOMAIN, "name")
        try:
            self._slices_call(f"delete resourceslice {escape(name, 80)}", _deadline(deadline), "delete", name=name)
        except NvcError as exc:
            if not exc.detail.endswith("not found"):
                raise

    def _slices_call(self, what: str, deadline: float, method: str, **kw) -> dict:
        for version in self._versions():
            _, res = _resources(version)
            if "obj" in kw:
                kw = dict(kw, obj=res(_in_version(kw["obj"], version)))
            status, body = self._call(what, deadline, method, res, **kw)
            if status == 404 and _unserved(body):
                continue
            self.version = version
            return self._checked(what, status, body)
        raise NvcError("kubernetes", f"{what}: {self.server} serves no {GROUP} version of {', '.join(VERSIONS)}")

    # -- the one place a request goes out ----------------------------------------------------

    def _versions(self):
        if self.version is not None:
            yield self.version
            return
        yield from VERSIONS

    def _checked(self, what: str, status: int, body, kind: str | None = None) -> dict:
        if 200 <= status < 300:
            if not isinstance(body, dict):
                raise NvcError("kubernetes", f"{what}: {self.server} answered {status} with a JSON "
                                             f"{type(body).__name__}, not an object")
            if kind is not None and body.get("kind") != kind:
                raise NvcError("kubernetes", f"{what}: {self.server} answered {status} with kind "
                                             f"{escape(repr(body.get('kind')), 60)}, not {kind}")
            return body
        message = body.get("message") if isinstance(body, dict) else ""
        if status == 404:
            raise NvcError("kubernetes", f"{what}: not found")
        raise NvcError("kubernetes", f"{what}: {self.server} answered {status}: {escape(message or '', 200)}")

    def _body(self, what: str, response) -> bytes:
        """The answer's bytes, MAX_BODY at most, as sent (no content coding)."""
        coding = response.headers.get("content-encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            raise NvcError("kubernetes", f"{what}: {self.server} answered in {escape(coding, 40)} coding, "
                                         "though none was asked")
        length = response.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and len(length) < 20 and int(length) > MAX_BODY:
            raise NvcError("kubernetes", f"{what}: {self.server}'s answer is larger than {MAX_BODY} bytes "
                                         f"({escape(length, 20)})")
        chunks, size = [], 0
        for chunk in response.iter_raw(CHUNK):
            size += len(chunk)
            if size > MAX_BODY:
                raise NvcError("kubernetes", f"{what}: {self.server}'s answer is larger than {MAX_BODY} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parsed(self, what: str, status: int, data: bytes):
        """A success's body: JSON, within bounds, or a line; a failure's: its Status when it is
        one (its message is shown), else nothing to show."""
        if not data:
            return {}
        if 200 <= status < 300:
            return documents.json_value(data, f"{what}: {self.server}'s answer", cap=MAX_BODY,
                                        category="kubernetes")
        try:
            return documents.json_value(data, "answer", cap=MAX_BODY)
        except NvcError:
            return {"message": "a body that is not JSON"}

    def _call(self, what: str, deadline: float, method: str, res, *, obj=None, name=None, namespace=None,
              params=None) -> tuple[int, object]:
        """Send one request until it is answered with a final status or the deadline passes;
        ``(status, JSON body)``.

        The failure's line names the state, not the moment: a retry that the deadline cuts short
        keeps the reason of the try before it, and a timeout is said without the seconds that
        happened to be left. A caller that says a line once until it changes (the slice
        publisher's loop) would otherwise say it again at every sync for one down server."""
        import httpx2

        pause = BACKOFF_FIRST
        attempts = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                why = last if attempts else "no time left"
                raise NvcError("kubernetes", f"{what}: {self.server}: {why} ({attempts} attempt(s))")
            attempts += 1
            try:
                request = self._generic.prepare_request(method, res, obj=obj, name=name, namespace=namespace,
                                                        params=dict(params or {}))
                request.timeout = httpx2.Timeout(min(self.timeout, max(left, 0.001)))
                outgoing = self._generic.build_adapter_request(request)
                outgoing.headers["Accept-Encoding"] = "identity"
                with bounded.until(deadline):
                    response = self._generic.send(outgoing, stream=True)
                    try:
                        status, data = response.status_code, self._body(what, response)
                    finally:
                        response.close()
                if status not in RETRIED:
                    return status, self._parsed(what, status, data)
                last = f"answered {status}"
            except httpx2.TimeoutException:
                if time.monotonic() < deadline:
                    last = f"no answer in {self.timeout:g} s"
                elif attempts == 1:
                    last = bounded.LATE
                # else: the deadline cut a retry short; the try before it says why the call failed
            except (httpx2.NetworkError, httpx2.RemoteProtocolError, OSError) as exc:
                last = _why(exc)
            except httpx2.HTTPError as exc:      # the request itself is wrong: no retry helps
                raise NvcError("kubernetes", f"{what}: {self.server}: {_why(exc)}") from None
            sleep = min(pause * (0.5 + random.random() / 2), deadline - time.monotonic())
            if sleep > 0:
                time.sleep(sleep)
            pause = min(pause * 2, BACKOFF_MAX)


def exec_auth(credentials):
    """An httpx ``Auth`` giving each request the exec plugin's token (:class:`.execplugin.Credentials`),
    asking it again once when the API server answers 401. Built here because httpx is imported on
    first use, and in this module only (the one of ``dra/`` that talks HTTP)."""
    import httpx2

    class ExecCredentialAuth(httpx2.Auth):
        def sync_auth_flow(self, request):
            token = credentials.current()
            if token is not None:
                request.headers["Authorization"] = f"Bearer {token}"
                response = yield request
                if response.status_code != 401:
                    return
            request.headers["Authorization"] = f"Bearer {credentials.fresh(token)}"
            yield request

    return ExecCredentialAuth()


def _named(what: str, value, pattern, field: str) -> None:
    """A name that goes into a request's path: what the API server accepts, or a line naming it
    (a "/" or ".." would otherwise address another resource)."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise NvcError("input", f"{what}: the {field} is not a valid Kubernetes name")


def _deadline(deadline: float | None) -> float:
    return time.monotonic() + DEFAULT_BUDGET if deadline is None else deadline


def _unserved(body) -> bool:
    """A 404 for the path itself (the server does not serve this group version), not for a
    named object: the API server's Status then has no ``details.name``."""
    details = body.get("details") if isinstance(body, dict) else None
    return not (isinstance(details, dict) and details.get("name"))


def _mine(item: dict, node: str, driver: str) -> bool:
    spec = item.get("spec") or {}
    return spec.get("nodeName") == node and spec.get("driver") == driver


def _in_version(obj: dict, version: str) -> dict:
    """A slice written in the v1 shape (slices.py's), in ``version``'s: v1beta1 keeps a device's
    attributes and capacity under ``basic``; v1beta2 is v1's shape."""
    out = dict(obj, apiVersion=f"{GROUP}/{version}", kind="ResourceSlice")
    if version != "v1beta1":
        return out
    spec = dict(out.get("spec") or {})
    devices = []
    for device in spec.get("devices") or ():
        basic = {k: v for k, v in device.items() if k != "name"}
        devices.append({"name": device.get("name"), "basic": basic})
    spec["devices"] = devices
    out["spec"] = spec
    return out


def as_v1(obj: dict) -> dict:
    """A slice as read, in the v1 shape (a v1beta1 device's ``basic`` lifted)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not any(isinstance(d, dict) and "basic" in d for d in spec.get("devices") or ()):
        return obj
    devices = [{"name": d.get("name"), **(d.get("basic") or {})} if isinstance(d, dict) else d
               for d in spec["devices"]]
    return dict(obj, spec=dict(spec, devices=devices))


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return escape(text.splitlines()[0] if text.splitlines() else text, 200)
