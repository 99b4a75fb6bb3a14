"""The DRA driver's API server client against the fake API server (tests/fixtures/kubeapi.py):
claims in each served version, slice writes, kubeconfig and in-cluster configuration, and a
server that is down, slow or failing (bounded retries, one-line errors)."""

from __future__ import annotations

import json
import time

import pytest

from nvcontainer.dra import kubeapi
from nvcontainer.errors import NvcError
from tests.fixtures.kubeapi import FakeApiServer, answer, endless, fake_api, flood  # noqa: F401 (a fixture)

NODE = "node-a"


def claim(namespace="default", name="c1") -> dict:
    return {"metadata": {"namespace": namespace, "name": name, "uid": "u-1"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"}]}}}}


def a_slice(name="node-a-gpu.nvidia.com", node=NODE, devices=None) -> dict:
    return {"metadata": {"name": name},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices if devices is not None else [
                         {"name": "gpu-0", "attributes": {"type": {"string": "gpu"},
                                                          "driverVersion": {"version": "550.54.14"}},
                          "capacity": {"memory": {"value": "80Gi"}}}]}}


@pytest.fixture
def server(fake_api):
    fake_api.token = "secret"
    return fake_api


@pytest.fixture
def api(server, tmp_path):
    client = kubeapi.KubeApi(kubeapi.load_config(server.write_kubeconfig(str(tmp_path / "kubeconfig"))), timeout=2)
    yield client
    client.close()


@pytest.mark.parametrize("versions, used", [
    (("v1", "v1beta2", "v1beta1"), "v1"),      # 1.34
    (("v1beta2", "v1beta1"), "v1beta2"),       # 1.33
    (("v1beta1",), "v1beta1"),                 # 1.32
])
def test_claim_read_in_the_newest_served_version(tmp_path, versions, used):
    server = FakeApiServer(versions=versions)
    try:
        server.put_claim(claim())
        api = kubeapi.KubeApi(kubeapi.load_config(server.write_kubeconfig(str(tmp_path / "k"))))
        got = api.get_claim("default", "c1", deadline=time.monotonic() + 5)
        assert got["apiVersion"] == f"resource.k8s.io/{used}"
        assert got["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
        assert api.version == used
    finally:
        server.stop()


def test_missing_claim_is_one_line_not_found(server, api):
    with pytest.raises(NvcError) as err:
        api.get_claim("default", "gone", deadline=time.monotonic() + 5)
    assert err.value.category == "kubernetes"
    assert err.value.detail == "get resourceclaim default/gone: not found"
    # found the version once (v1), then a named 404: no fallback to the betas for a missing claim
    assert [p for _, p in server.requests] == ["/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/gone"]


def test_slices_create_list_update_delete(server, api):
    created = api.create_slice(a_slice())
    assert created["metadata"]["resourceVersion"]
    server.slices["other"] = dict(a_slice("other", node="node-b"), apiVersion="resource.k8s.io/v1")
    listed = api.list_slices(NODE)
    assert [s["metadata"]["name"] for s in listed] == ["node-a-gpu.nvidia.com"]
    changed = dict(listed[0])
    changed["spec"] = dict(changed["spec"], devices=[])
    api.update_slice(changed)
    assert server.slices["node-a-gpu.nvidia.com"]["spec"]["devices"] == []
    api.delete_slice("node-a-gpu.nvidia.com")
    api.delete_slice("node-a-gpu.nvidia.com")        # already gone: fine
    assert [(verb, name) for verb, _, name, _ in server.writes] == [
        ("create", "node-a-gpu.nvidia.com"), ("update", "node-a-gpu.nvidia.com"), ("delete", "node-a-gpu.nvidia.com")]
    assert ("GET", "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3Dnode-a%2Cspec.driver"
                   "%3Dgpu.nvidia.com&limit=500") in server.requests


def test_stale_update_is_a_conflict_not_retried(server, api):
    api.create_slice(a_slice())
    stale = api.list_slices(NODE)[0]
    api.update_slice(stale)
    with pytest.raises(NvcError, match="answered 409"):
        api.update_slice(stale)


def test_v1beta1_slices_are_written_with_basic_and_read_back_flat(tmp_path):
    server = FakeApiServer(versions=("v1beta1",))
    try:
        api = kubeapi.KubeApi(kubeapi.load_config(server.write_kubeconfig(str(tmp_path / "k"))))
        api.create_slice(a_slice())
        stored = server.slices["node-a-gpu.nvidia.com"]
        assert stored["apiVersion"] == "resource.k8s.io/v1beta1"
        assert stored["spec"]["devices"][0]["basic"]["capacity"] == {"memory": {"value": "80Gi"}}
        assert api.list_slices(NODE)[0]["spec"]["devices"] == a_slice()["spec"]["devices"]
    finally:
        server.stop()


def test_invalid_slice_is_refused_with_the_servers_line(server, api):
    bad = a_slice(devices=[{"name": "gpu-0", "attributes": {"cudaComputeCapability": {"version": "8.0"}}}])
    with pytest.raises(NvcError, match=r"answered 422: .*semver"):
        api.create_slice(bad)


def test_wrong_token_is_refused_at_once(server, tmp_path):
    api = kubeapi.KubeApi(kubeapi.load_config(server.write_kubeconfig(str(tmp_path / "k"), token="wrong")))
    start = time.monotonic()
    with pytest.raises(NvcError, match="answered 401"):
        api.list_slices(NODE, deadline=time.monotonic() + 10)
    assert time.monotonic() - start < 2


def test_in_cluster_configuration_over_tls(tmp_path, monkeypatch):
    server = FakeApiServer(token="sa-token", tls_dir=str(tmp_path / "tls"))
    try:
        for key, value in server.write_service_account(str(tmp_path / "sa")).items():
            monkeypatch.setenv(key, value)
        server.put_claim(claim())
        api = kubeapi.KubeApi(kubeapi.load_config(service_account=str(tmp_path / "sa")))
        assert api.get_claim("default", "c1")["metadata"]["uid"] == "u-1"
    finally:
        server.stop()


@pytest.mark.parametrize("text", ["{not yaml: [", "[" * 100_000])
def test_bad_kubeconfig_is_one_line(tmp_path, text):
    path = tmp_path / "k"
    path.write_text(text)
    with pytest.raises(NvcError, match=r"^kubernetes error: kubeconfig .*/k: "):
        kubeapi.load_config(str(path))


def test_transient_failures_are_retried(server, api):
    server.put_claim(claim())
    server.fail = [503, 500, 429]
    assert api.get_claim("default", "c1", deadline=time.monotonic() + 10)["metadata"]["name"] == "c1"
    assert len(server.requests) == 4


def test_down_server_gives_up_at_the_deadline(server, api):
    server.down = True
    start = time.monotonic()
    with pytest.raises(NvcError) as err:
        api.get_claim("default", "c1", deadline=time.monotonic() + 1.5)
    took = time.monotonic() - start
    assert 1.3 < took < 2.5
    assert "\n" not in str(err.value) and "attempt(s)" in err.value.detail
    assert len(server.requests) >= 3          # retried with backoff, not once, not a busy loop
    assert len(server.requests) < 30


def test_slow_server_is_bounded_by_the_deadline(server, api):
    server.put_claim(claim())
    server.slow = 5
    start = time.monotonic()
    with pytest.raises(NvcError, match="no answer within the call.s deadline"):
        api.get_claim("default", "c1", deadline=time.monotonic() + 1)
    assert time.monotonic() - start < 2


def test_stopped_server_then_back(server, api):
    server.put_claim(claim())
    server.stop()
    with pytest.raises(NvcError):
        api.get_claim("default", "c1", deadline=time.monotonic() + 0.5)
    server.start()
    assert api.get_claim("default", "c1", deadline=time.monotonic() + 5)["metadata"]["name"] == "c1"


@pytest.mark.parametrize("namespace, name", [("default", "../x"), ("a/b", "c"), ("default", ""), ("Default", "c"),
                                             ("default", "c\n"), ("default", "x" * 254)])
def test_names_that_would_change_the_path_are_refused(server, api, namespace, name):
    with pytest.raises(NvcError) as err:
        api.get_claim(namespace, name)
    assert err.value.category == "input" and "not a valid Kubernetes name" in err.value.detail
    assert server.requests == []


def test_node_name_is_checked(server, api):
    with pytest.raises(NvcError, match="node name is not a valid Kubernetes name"):
        api.list_slices("node/../x")
    assert server.requests == []


# -- hostile answers: every body bounded in time as a whole and in size, and parsed strictly ------

def claim_bytes(pad: int = 0) -> bytes:
    obj = dict(claim(), apiVersion="resource.k8s.io/v1", kind="ResourceClaim")
    return json.dumps(obj).encode() + b" " * pad


def test_a_trickled_answer_ends_at_the_calls_deadline(server, api):
    """A byte every 0.2 s is inside every per-read timeout (2 s): it kept a 1.5 s call reading
    for as long as the body lasted."""
    server.hostile = answer(claim_bytes(), trickle=0.2)
    start = time.monotonic()
    with pytest.raises(NvcError) as err:
        api.get_claim("default", "c1", deadline=time.monotonic() + 1.5)
    assert time.monotonic() - start < 2.0
    assert "\n" not in str(err.value) and "deadline" in err.value.detail


def test_an_endless_answer_ends_at_the_calls_deadline(server, api):
    server.hostile = endless(every=0.05)
    start = time.monotonic()
    with pytest.raises(NvcError, match="deadline"):
        api.get_claim("default", "c1", deadline=time.monotonic() + 1)
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("with_length", [True, False])
def test_a_flood_is_refused_at_the_size_bound_not_read_whole(server, api, with_length):
    sent: list[int] = []
    server.hostile = flood(128 << 20, with_length=with_length, sent=sent)
    with pytest.raises(NvcError, match=f"answer is larger than {kubeapi.MAX_BODY} bytes"):
        api.get_claim("default", "c1", deadline=time.monotonic() + 20)
    api.close()
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sent and sent[0] < kubeapi.MAX_BODY + (16 << 20)   # the client stopped reading: the rest never sent
    assert len(server.requests) == 1                          # final, not retried


@pytest.mark.parametrize("chunked", [False, True])
def test_the_size_bound_exactly_and_one_past(server, api, monkeypatch, chunked):
    body = claim_bytes()
    monkeypatch.setattr(kubeapi, "MAX_BODY", len(body) + 100)
    headers = (("Transfer-Encoding", "chunked"),) if chunked else ()
    at = claim_bytes(100)
    server.hostile = (lambda h: _chunked(h, at)) if chunked else answer(at, headers=headers)
    assert api.get_claim("default", "c1")["metadata"]["name"] == "c1"
    past = claim_bytes(101)
    server.hostile = (lambda h: _chunked(h, past)) if chunked else answer(past)
    with pytest.raises(NvcError, match="larger than"):
        api.get_claim("default", "c1")


def _chunked(handler, body: bytes) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    for i in range(0, len(body), 7):
        piece = body[i:i + 7]
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
    handler.wfile.write(b"0\r\n\r\n")


@pytest.mark.parametrize("body, content_type, message", [
    (b"<html><body>Sign in to the proxy</body></html>", "text/html", "answer: invalid JSON"),
    (b'[{"kind": "ResourceClaim"}]', "application/json", "with a JSON list, not an object"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", "answer: JSON nested deeper than 64 levels"),
    (b'{"a":' * 65 + b"1" + b"}" * 65, "application/json", "answer: JSON nested deeper than 64 levels"),
    (claim_bytes() + b'{"kind": "ResourceClaim"}', "application/json", "answer: invalid JSON: Extra data"),
    (claim_bytes()[:-1], "application/json", "answer: invalid JSON"),
    (b'{"kind": "Status", "status": "Success"}', "application/json", "with kind 'Status', not ResourceClaim"),
    (b'{"n": ' + b"9" * 5000 + b"}", "application/json", "answer: invalid JSON: Exceeds the limit"),
    (b"\xff\xfe{}", "application/json", "answer: "),
])
def test_a_success_that_is_no_claim_is_one_line(server, api, body, content_type, message):
    server.hostile = answer(body, content_type=content_type)
    with pytest.raises(NvcError) as err:
        api.get_claim("default", "c1", deadline=time.monotonic() + 5)
    assert err.value.category == "kubernetes" and message in err.value.detail, err.value.detail
    assert "\n" not in str(err.value)
    assert len(server.requests) == 1


def test_nesting_at_the_bound_is_read(server, api):
    inner = b'{"a":' * 62 + b"1" + b"}" * 62          # with the claim's own object and its "x": 64 levels
    server.hostile = answer(claim_bytes()[:-1] + b', "x": ' + inner + b"}")
    assert api.get_claim("default", "c1")["metadata"]["uid"] == "u-1"


def test_a_content_coding_not_asked_for_is_refused(server, api):
    import gzip
    server.hostile = answer(gzip.compress(b" " * (64 << 20)), headers=(("Content-Encoding", "gzip"),))
    with pytest.raises(NvcError, match="answered in gzip coding, though none was asked"):
        api.get_claim("default", "c1")
    assert server.requests and all(m == "GET" for m, _ in server.requests)


def test_the_deadline_is_lifted_after_the_call(server, api):
    """A call's deadline is the thread's only for the call: the next call, with its own, works."""
    server.put_claim(claim())
    server.hostile = answer(claim_bytes(), trickle=0.2)
    with pytest.raises(NvcError):
        api.get_claim("default", "c1", deadline=time.monotonic() + 0.5)
    server.hostile = None
    assert api.get_claim("default", "c1", deadline=time.monotonic() + 5)["metadata"]["name"] == "c1"


def test_a_server_killed_mid_answer_is_retried_then_one_line(server, api):
    """Half an answer, then the connection dropped (a server killed mid-request): retried while
    there is time, then one line; a whole answer after it is read."""
    server.put_claim(claim())
    whole = claim_bytes()
    cut = [0]

    def half(handler) -> None:
        cut[0] += 1
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(whole)))
        handler.end_headers()
        handler.wfile.write(whole[:len(whole) // 2])
        handler.wfile.flush()
        handler.connection.shutdown(2)

    server.hostile = half
    start = time.monotonic()
    with pytest.raises(NvcError) as err:
        api.get_claim("default", "c1", deadline=time.monotonic() + 1)
    assert time.monotonic() - start < 1.5 and cut[0] >= 2
    assert "\n" not in str(err.value) and "attempt(s)" in err.value.detail
    server.hostile = None
    assert api.get_claim("default", "c1", deadline=time.monotonic() + 5)["metadata"]["uid"] == "u-1"


def test_a_retry_cut_by_the_deadline_keeps_the_reason_before_it(server, api):
    """A connection closed unanswered, then a retry that the deadline ends: the line says the
    server closed it, not how little time the last try had. A loop that says a line once until
    it changes says one line for one down server, however the deadline falls (CI under load saw
    a retry begin 0.3 ms before it)."""
    import socket

    tries = [0]

    def closed_then_silent(handler) -> None:
        tries[0] += 1
        if tries[0] == 1:
            handler.connection.shutdown(socket.SHUT_RDWR)
        else:
            time.sleep(3)

    server.hostile = closed_then_silent
    with pytest.raises(NvcError) as err:
        api.get_claim("default", "c1", deadline=time.monotonic() + 0.8)
    assert tries[0] == 2
    assert "Server disconnected without sending a response" in err.value.detail, err.value.detail
    assert "no answer" not in err.value.detail
    lines = set()
    for _ in range(3):
        tries[0] = 0
        with pytest.raises(NvcError) as err:
            api.get_claim("default", "c1", deadline=time.monotonic() + 0.8)
        lines.add(err.value.detail.rsplit(" (", 1)[0])
    assert len(lines) == 1, lines
