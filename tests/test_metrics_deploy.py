"""How ``nvcontainer metrics`` is deployed: the Kubernetes objects (deploy/kubernetes/metrics),
the package's systemd unit; and the endpoint's TLS and basic authentication from a web config."""

from __future__ import annotations

import base64
import shutil
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from nvcontainer import __version__
from nvcontainer.metrics import pods, server, webconfig
from nvcontainer.setup import units
from tests.test_k8s_manifests import DEPLOY, objects, one
from tests.test_units import CLI, verify

yaml = pytest.importorskip("yaml")


def test_the_daemonset_serves_dcgm_exporters_port_with_pod_labels():
    objs = objects("metrics")
    ds = one(objs, "DaemonSet", "nvcontainer-metrics")
    spec = ds["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"][:1] == ["nvcontainer"] and "metrics" in container["command"]
    assert container["image"] == f"nvcontainer:{__version__}"
    assert container["ports"] == [{"name": "metrics", "containerPort": 9400}]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    socket_dir = str(Path(pods.SOCKET).parent)
    assert mounts["pod-resources"]["mountPath"] == socket_dir and mounts["pod-resources"]["readOnly"]
    assert volumes["pod-resources"]["hostPath"]["path"] == socket_dir
    assert spec["hostPID"] is True and spec["runtimeClassName"] == "nvidia"
    security = container["securityContext"]
    assert security["privileged"] is False and security["capabilities"]["drop"] == ["ALL"]
    service = one(objs, "Service", "nvcontainer-metrics")
    assert service["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["port"] == 9400 and service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert not [o for o in objs if o["kind"] == "ServiceMonitor"]


def test_the_servicemonitor_is_an_optional_component():
    objs = objects("metrics/monitored")
    monitor = one(objs, "ServiceMonitor", "nvcontainer-metrics")
    service = one(objs, "Service", "nvcontainer-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert (DEPLOY / "metrics" / "servicemonitor" / "kustomization.yaml").read_text().count("kind: Component") == 1


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_the_package_unit_verifies(tmp_path):
    for name, text in units.package_units(CLI).items():
        (tmp_path / name).write_text(text)
    res = verify(tmp_path)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    assert units.METRICS_SERVICE not in units.all_units(CLI)   # setup ENGINE does not write it
    assert f"ExecStart={CLI} metrics --listen :9400" in units.metrics_service(CLI)


# --- TLS and basic auth ---------------------------------------------------------------------

def _serve(**kwargs):
    httpd = server.Server(("127.0.0.1", 0), lambda: [], lambda line: None, family=__import__("socket").AF_INET,
                          **kwargs)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, httpd.server_address[1]


def test_tls_and_basic_auth_from_the_web_config(tmp_path):
    bcrypt = pytest.importorskip("bcrypt")
    if not shutil.which("openssl"):
        pytest.skip("needs openssl")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / "k.pem"),
                    "-out", str(tmp_path / "c.pem")], check=True, capture_output=True, timeout=60)
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    (tmp_path / "web.yml").write_text(f"tls_server_config:\n  cert_file: {tmp_path / 'c.pem'}\n"
                                      f"  key_file: {tmp_path / 'k.pem'}\nbasic_auth_users:\n  prom: '{hashed}'\n")
    cfg = webconfig.load(str(tmp_path / "web.yml"))
    httpd, port = _serve(users=webconfig.Users(cfg.users), context=webconfig.ssl_context(cfg))
    try:
        client = ssl.create_default_context(cafile=str(tmp_path / "c.pem"))
        url = f"https://127.0.0.1:{port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, context=client, timeout=10)
        assert err.value.code == 401
        auth = {"Authorization": "Basic " + base64.b64encode(b"prom:pw").decode()}
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth), context=client, timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        with pytest.raises((urllib.error.URLError, ConnectionError)):      # plain HTTP is not served
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        # after a client that spoke nonsense, the endpoint still answers
        import socket as sk

        with sk.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"\x16\x03\x01garbage" * 20)
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth), context=client, timeout=10) as r:
            assert r.status == 200
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_every_option_is_in_the_man_page():
    out = subprocess.run([str(Path(CLI).parent / "python"), "-m", "nvcontainer", "metrics", "--help"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    page = (Path(__file__).resolve().parent.parent / "man" / "nvcontainer-metrics.1").read_text()
    options = [word.rstrip(",") for word in out.split() if word.startswith("--") and word != "--help"]
    assert len(options) >= 8
    for option in options:
        assert option.replace("-", "\\-") in page, option
