"""A kubeconfig exec credential plugin, run by the DRA driver's client against the fake API
server: its token used and kept, asked again on a 401 or an expiry, told what kubectl tells it,
and bounded (a plugin that hangs, floods, fails or answers nonsense is one line within the
call's deadline, and is killed with what it started)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from nvcontainer.dra import kubeapi
from nvcontainer.errors import NvcError
from tests.fixtures.kubeapi import fake_api  # noqa: F401 (a fixture)

NODE = "node-a"


@pytest.fixture
def server(fake_api):
    fake_api.token = "t-1"
    fake_api.put_node(NODE)
    return fake_api


def kubeconfig(server, directory, command, *, api_version="client.authentication.k8s.io/v1beta1",
               env=None, args=None) -> str:
    exec_ = {"apiVersion": api_version, "command": command, "args": args or [],
             "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
              "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
              "users": [{"name": "fake", "user": {"exec": exec_}}],
              "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}
    path = os.path.join(directory, "kubeconfig")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def plugin(directory, name, body: str) -> str:
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(path, 0o755)
    return path


# prints the token in ./token as an ExecCredential, counting its runs and keeping what it was told
TOKEN_PLUGIN = """\
here=$(dirname "$0")
echo run >> "$here/runs"
printf '%s' "$KUBERNETES_EXEC_INFO" > "$here/info"
printf '%s' "$FROM_KUBECONFIG" > "$here/env"
expiry=${EXPIRY:+,\\"expirationTimestamp\\":\\"$EXPIRY\\"}
printf '{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential","status":{"token":"%s"%s}}' \\
    "$(cat "$here/token")" "$(printf "$expiry")"
"""


def client(path):
    return kubeapi.KubeApi(kubeapi.load_config(path), timeout=2)


def runs(directory) -> int:
    try:
        with open(os.path.join(directory, "runs")) as f:
            return len(f.read().split())
    except FileNotFoundError:
        return 0


def test_the_plugins_token_is_used_kept_and_asked_again_on_a_401(server, tmp_path):
    d = str(tmp_path)
    plugin(d, "plugin.sh", TOKEN_PLUGIN)
    (tmp_path / "token").write_text("t-1")
    # a relative command with a slash is the kubeconfig's directory's, wherever we run from
    api = client(kubeconfig(server, d, "./plugin.sh", env={"FROM_KUBECONFIG": "yes"}))
    try:
        assert api.get_node(NODE)["metadata"]["name"] == NODE
        assert api.get_node(NODE)["metadata"]["name"] == NODE
        assert runs(d) == 1                                      # kept, not asked per call
        info = json.loads((tmp_path / "info").read_text())
        assert info == {"apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential",
                        "spec": {"interactive": False}}
        assert (tmp_path / "env").read_text() == "yes"
        server.token = "t-2"                                     # rotated: the old one gets 401
        (tmp_path / "token").write_text("t-2")
        assert api.get_node(NODE)["metadata"]["name"] == NODE
        assert runs(d) == 2
    finally:
        api.close()


def test_an_expired_token_is_asked_again_before_it_is_refused(server, tmp_path, monkeypatch):
    d = str(tmp_path)
    plugin(d, "plugin.sh", TOKEN_PLUGIN)
    (tmp_path / "token").write_text("t-1")
    monkeypatch.setenv("EXPIRY", "2000-01-01T00:00:00Z")      # the plugin inherits our environment
    api = client(kubeconfig(server, d, os.path.join(d, "plugin.sh")))
    try:
        api.get_node(NODE)
        api.get_node(NODE)
        assert runs(d) == 2
        before = len(server.requests)
        monkeypatch.setenv("EXPIRY", "2999-01-01T00:00:00Z")
        api.get_node(NODE)
        api.get_node(NODE)
        assert runs(d) == 3
        assert len(server.requests) - before == 2                # no 401 on the way: asked in time
    finally:
        api.close()


def test_the_v1_api_version_is_run(server, tmp_path):
    """``client.authentication.k8s.io/v1`` (kubectl's since 1.22) is run, as kubectl runs it."""
    d = str(tmp_path)
    plugin(d, "plugin.sh", TOKEN_PLUGIN)
    (tmp_path / "token").write_text("t-1")
    api = client(kubeconfig(server, d, os.path.join(d, "plugin.sh"), api_version="client.authentication.k8s.io/v1"))
    try:
        assert api.get_node(NODE)["metadata"]["name"] == NODE
        assert json.loads((tmp_path / "info").read_text())["apiVersion"] == "client.authentication.k8s.io/v1"
    finally:
        api.close()


def refused(server, d: str, body: str, seconds: float) -> tuple[NvcError, float]:
    """The error of one call, within ``seconds``, through ``body`` as the plugin, and how long it took."""
    plugin(d, "plugin.sh", body)
    api = client(kubeconfig(server, d, os.path.join(d, "plugin.sh")))
    start = time.monotonic()
    try:
        with pytest.raises(NvcError) as err:
            api.get_node(NODE, deadline=time.monotonic() + seconds)
    finally:
        api.close()
    return err.value, time.monotonic() - start


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_plugin_that_hangs_ends_at_the_calls_deadline_with_what_it_started(server, tmp_path):
    """It never answers, and a child it started holds its output open: the call ends by its
    deadline with one line, and both are killed (a wait for EOF would wait for the child)."""
    d = str(tmp_path)
    err, took = refused(server, d, 'sleep 300 &\necho $! > "$(dirname "$0")/child"\nexec sleep 300\n', 1)
    assert took < 2
    assert err.detail == f"kubeconfig exec plugin {d}/plugin.sh: no answer within the call's deadline"
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child)


@pytest.mark.parametrize("body, line", [
    ("yes\n", "wrote more than 1048576 bytes"),
    ("echo 'no such account' >&2\nexit 3\n", "exit status 3: no such account"),
    ("echo '<html>login</html>'\n", "its output: invalid JSON"),
    ("echo '{\"status\": {}}'\n", "its ExecCredential has no status.token"),
    ("echo '{\"status\": {\"clientCertificateData\": \"x\"}}'\n",
     "its ExecCredential has a client certificate, not a token (not supported)"),
    ("echo '{\"status\": {\"token\": \"t-1\", \"expirationTimestamp\": \"soon\"}}'\n",
     "status.expirationTimestamp soon is not an RFC 3339 time"),
])
def test_a_plugin_that_fails_is_one_line(server, tmp_path, body, line):
    d = str(tmp_path)
    err, took = refused(server, d, body, 10)
    assert took < 5
    assert err.category == "kubernetes"
    assert err.detail.startswith(f"kubeconfig exec plugin {d}/plugin.sh: {line}"), err.detail
    assert "\n" not in str(err)
    assert server.requests == []                  # nothing sent without a token


def test_the_driver_says_a_failing_plugin_in_one_line(server, tmp_path):
    """``dra-driver --remove-slices`` with a kubeconfig whose plugin fails: one line, exit 1."""
    d = str(tmp_path)
    plugin(d, "plugin.sh", "echo 'token expired, log in again' >&2\nexit 1\n")
    res = subprocess.run([sys.executable, "-m", "nvcontainer", "dra-driver", "--node-name", NODE, "--kubeconfig",
                          kubeconfig(server, d, "./plugin.sh"), "--remove-slices"],
                         capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, cwd="/", timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stderr == (f"nvcontainer: kubernetes error: kubeconfig exec plugin ./plugin.sh: exit status 1: "
                          "token expired, log in again\n")


def test_workers_that_need_a_token_at_once_run_the_plugin_once(server, tmp_path):
    """Eight threads' first calls at once (the DRA driver's workers after a start): one run of
    the plugin, every call answered."""
    from concurrent.futures import ThreadPoolExecutor

    d = str(tmp_path)
    plugin(d, "plugin.sh", "sleep 0.3\n" + TOKEN_PLUGIN)
    (tmp_path / "token").write_text("t-1")
    api = client(kubeconfig(server, d, os.path.join(d, "plugin.sh")))
    try:
        with ThreadPoolExecutor(8) as pool:
            names = list(pool.map(lambda _: api.get_node(NODE)["metadata"]["name"], range(8)))
    finally:
        api.close()
    assert names == [NODE] * 8
    assert runs(d) == 1
