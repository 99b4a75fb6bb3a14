"""Debian's Prometheus server scrapes ``nvcontainer metrics`` on the fake machine, and the queries
of NVIDIA's Grafana dashboard (grafana/dcgm-exporter-dashboard.json in NVIDIA/dcgm-exporter)
return data through its HTTP API: the proof that the dashboard works unchanged.

Prometheus runs on 127.0.0.1 with its own configuration and data directory under the test's
temporary directory, scraping every second, and is stopped at the end; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tests.fixtures.exporter import Exporter, free_port
from tests.fixtures.fakegpu.readings import BUSY, set_readings
from tests.fixtures.fakegpu.spec import FakeSpec

# The dashboard's panels as (title, PromQL), its variables written $instance and $gpu, as the
# dashboard has them (transcribed for these tests; the file itself is NVIDIA's).
PANELS = [
    ("GPU Temperature", 'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}'),
    ("GPU Avg. Temp", 'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})'),
    ("GPU Power Usage", 'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}'),
    ("GPU Power Total", 'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})'),
    ("GPU SM Clocks", 'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000'),
    ("GPU Utilization", 'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}'),
    ("GPU Framebuffer Mem Used", 'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}'),
    ("Tensor Core Utilization", 'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}'),
]
# the dashboard's variables: label_values(DCGM_FI_DEV_GPU_TEMP, instance) and (..., gpu)
VARIABLES = {"instance": "DCGM_FI_DEV_GPU_TEMP", "gpu": "DCGM_FI_DEV_GPU_TEMP"}

CONFIG = """global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: dcgm
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


@pytest.fixture(scope="module")
def machine(private_machine):
    m = private_machine(FakeSpec(gpus=2, archs=("9.0", "9.0")))
    return set_readings(m, {0: BUSY, 1: {**BUSY, "temp": 50, "power_mw": 100000, "gpm5": 10.0}},
                        utilization=((50, 20), (30, 10)))


def api(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        reply = json.loads(r.read())
    assert reply["status"] == "success", reply
    return reply["data"]


def until(fn, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while True:
        got = fn()
        if got or time.monotonic() > end:
            return got
        time.sleep(0.5)


def test_prometheus_scrapes_and_every_dashboard_panel_has_data(machine, tmp_path):
    if not shutil.which("prometheus"):
        pytest.skip("needs Debian's prometheus (scripts/install)")
    exp = Exporter(machine, tmp_path)
    prom = None
    try:
        exp.wait()
        (tmp_path / "prometheus.yml").write_text(CONFIG.replace("{port}", str(exp.port)))
        web = free_port()
        base = f"http://127.0.0.1:{web}"
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{web}",
                                 "--web.console.templates=/nonexistent", "--web.console.libraries=/nonexistent"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / "prometheus.log", "w"), cwd=tmp_path,
                                env={"PATH": os.environ["PATH"]})

        def target_up():
            try:
                targets = api(base, "/api/v1/targets")["activeTargets"]
            except OSError:
                return None
            return [t for t in targets if t["health"] == "up"]

        up = until(target_up)
        assert up, (tmp_path / "prometheus.log").read_text()[-2000:]
        instance = f"127.0.0.1:{exp.port}"
        temps = until(lambda: api(base, "/api/v1/query", query="DCGM_FI_DEV_GPU_TEMP")["result"])
        assert len(temps) == 2
        labels = temps[0]["metric"]
        assert {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION",
                "instance", "job"} <= set(labels)
        assert labels["Hostname"] == "fake-node" and labels["instance"] == instance
        assert {r["metric"]["UUID"] for r in temps} == {g["uuid"] for g in machine.description()["gpus"]}
        # the dashboard's variables
        values = {name: api(base, f"/api/v1/label/{name}/values", **{"match[]": metric})
                  for name, metric in VARIABLES.items()}
        assert values == {"instance": [instance], "gpu": ["0", "1"]}
        # each panel, with the variables as Grafana's "All" fills them, and with one GPU chosen
        for title, expr in PANELS:
            for gpu in (".*", "1"):
                query = expr.replace("$instance", instance).replace("$gpu", gpu)
                result = api(base, "/api/v1/query", query=query)["result"]
                assert result, f"panel {title!r}: no data for {query}"
        (total,) = api(base, "/api/v1/query", query=PANELS[3][1].replace("$instance", instance)
                       .replace("$gpu", ".*"))["result"]
        assert float(total["value"][1]) == 412.5
        (tensor,) = api(base, "/api/v1/query", query=PANELS[7][1].replace("$instance", instance)
                        .replace("$gpu", "1"))["result"]
        assert float(tensor["value"][1]) == 0.1
        # a counter's rate, as an alert on energy would take it
        rate = until(lambda: api(base, "/api/v1/query",
                                 query="rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[10s])")["result"], 30)
        assert len(rate) == 2
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
        exp.stop()
