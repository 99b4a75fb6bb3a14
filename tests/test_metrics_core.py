"""``nvcontainer metrics``'s pure parts on made-up facts: the counters file, the series and their
labels, the exposition formats, the web config, the listen address."""

from __future__ import annotations

import socket

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from nvcontainer.errors import NvcError
from nvcontainer.inventory.model import Gpu, Inventory, MigDevice
from nvcontainer.metrics import counters, families, server, webconfig
from nvcontainer.metrics.command import parse_listen

U0, U1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
MIG = "MIG-22222222-2222-2222-2222-222222222222"


def inventory(mig: bool = False) -> Inventory:
    migs = (MigDevice(parent=1, index=0, uuid=MIG, gi=3, ci=0, gi_access="", ci_access="",
                      name="NVIDIA H100 80GB HBM3 MIG 1g.10gb"),) if mig else ()
    return Inventory(root="/", driver_version="580.65.06", cuda_version="13.0", gpus=(
        Gpu(index=0, minor=0, model="NVIDIA H100 80GB HBM3", brand="Nvidia", uuid=U0, bus_id="00000000:07:00.0",
            arch="9.0"),
        Gpu(index=1, minor=3, model="NVIDIA H100 80GB HBM3", brand="Nvidia", uuid=U1, bus_id="00000000:0f:00.0",
            arch="9.0", mig_capable=mig, mig_enabled=mig, migs=migs)))


def entry(uuid, **readings):
    return {"gpu": uuid, "readings": {"gpu_temp": 61, "power_w": 312.5, "fb_used": 2048, "energy_mj": 1000,
                                      **readings},
            "gpm": {"tensor_active": 0.55, "sm_active": 0.75}, "xid": 79, "migs": {}}


def by_name(fams):
    return {f.name: f for f in fams}


# --- the counters file ----------------------------------------------------------------------

def test_counters_file_selects_fields_and_names_the_ones_nvml_cannot_give():
    chosen, missing = counters.parse("# comment\n\nDCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).\n"
                                     "DCGM_FI_DEV_VGPU_LICENSE_STATUS, gauge, vGPU License status\n"
                                     "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, counter, Energy, in mJ\n"
                                     "DCGM_FI_DRIVER_VERSION, label, Driver Version\n")
    assert [c.name for c in chosen] == ["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                                        "DCGM_FI_DRIVER_VERSION"]
    assert chosen[1].help == "Energy, in mJ" and chosen[1].type == "counter"
    assert missing == ["DCGM_FI_DEV_VGPU_LICENSE_STATUS"]


def test_dcgm_exporters_own_default_file_parses():
    text = "\n".join(f"{name}, {counters.CATALOGUE[name][2]}, {counters.CATALOGUE[name][3]}"
                     for name in counters.DEFAULT)
    chosen, missing = counters.parse(text + "\nDCGM_FI_DEV_VGPU_LICENSE_STATUS, gauge, vGPU License status\n")
    assert [c.name for c in chosen] == list(counters.DEFAULT) and missing == ["DCGM_FI_DEV_VGPU_LICENSE_STATUS"]


@pytest.mark.parametrize("text, words", [
    ("DCGM_FI_DEV_GPU_TEMP, gauge, a\nDCGM_FI_DEV_GPU_TEMP, gauge, b\n", "line 2: DCGM_FI_DEV_GPU_TEMP repeats line 1"),
    ("DCGM_FI_DEV_GPU_TEMP, histogram, a\n", "line 1: DCGM_FI_DEV_GPU_TEMP: type histogram"),
    ("DCGM_FI_DEV_GPU_TEMP gauge\n", "line 1: expected 'FIELD, type, help'"),
    ("DCGM FI\n\x1b[31m, gauge, x\n", "line 1"),
    ("DCGM_FI_DRIVER_VERSION, gauge, x\n", "is a label, not a gauge"),
])
def test_a_bad_counters_file_is_one_line_naming_the_line(text, words):
    with pytest.raises(NvcError) as err:
        counters.parse(text, "counters file f.csv")
    assert words in err.value.detail and "\n" not in err.value.detail and "\x1b" not in err.value.detail


# --- the series -----------------------------------------------------------------------------

def test_gpu_series_carry_dcgm_exporters_labels_and_units():
    fams = by_name(families.build(inventory(), counters.default(), {U0: entry(U0), U1: entry(U1)}, None, None,
                                  "node-1", {"nvml": True}))
    (temp0, temp1) = fams["DCGM_FI_DEV_GPU_TEMP"].samples
    assert temp0.labels == {"gpu": "0", "UUID": U0, "pci_bus_id": "00000000:07:00.0", "device": "nvidia0",
                            "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-1",
                            "DCGM_FI_DRIVER_VERSION": "580.65.06"}
    assert temp1.labels["device"] == "nvidia3" and temp0.value == 61.0
    assert fams["DCGM_FI_DEV_POWER_USAGE"].samples[0].value == 312.5
    assert fams["DCGM_FI_DEV_FB_USED"].samples[0].value == 2048
    assert fams["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"].samples[0].value == 0.55
    assert fams["DCGM_FI_DEV_XID_ERRORS"].samples[0].value == 79
    assert fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].type == "counter"
    assert "DCGM_FI_PROF_DRAM_ACTIVE" not in fams      # not read: no series, rather than a made-up 0
    assert [s.value for s in fams["nvcontainer_gpu_up"].samples] == [1.0, 1.0]


def test_a_gpu_that_did_not_answer_has_no_series_and_up_zero():
    fams = by_name(families.build(inventory(), counters.default(), {U0: entry(U0), U1: {"gpu": U1, "error": "gpu is lost"}},
                                  None, None, "n", {"nvml": True}))
    assert [s.labels["gpu"] for s in fams["DCGM_FI_DEV_GPU_TEMP"].samples] == ["0"]
    assert [(s.labels["gpu"], s.value) for s in fams["nvcontainer_gpu_up"].samples] == [("0", 1.0), ("1", 0.0)]
    fams = by_name(families.build(inventory(), counters.default(), {U0: entry(U0)}, None, None, "n", {"nvml": True}))
    assert [(s.labels["gpu"], s.value) for s in fams["nvcontainer_gpu_up"].samples] == [("0", 1.0), ("1", 0.0)]


def test_pods_label_the_gpus_they_hold_and_mig_devices_get_instance_labels():
    holders = {U0: [{"namespace": "ml", "pod": "train-0", "container": "main"},
                    {"namespace": "ml", "pod": "train-1", "container": "main"}],
               MIG: [{"namespace": "inf", "pod": "serve", "container": "c", "dra_claim_name": "one"}]}
    e1 = dict(entry(U1), migs={MIG: {"fb_used": 100, "fb_free": 9000}})
    fams = by_name(families.build(inventory(mig=True), counters.default(), {U0: entry(U0), U1: e1}, None, holders,
                                  "n", {"nvml": True}))
    temps = fams["DCGM_FI_DEV_GPU_TEMP"].samples
    assert [(s.labels["gpu"], s.labels.get("pod")) for s in temps] == [("0", "train-0"), ("0", "train-1"), ("1", None)]
    fb = [s for s in fams["DCGM_FI_DEV_FB_USED"].samples if "GPU_I_ID" in s.labels]
    assert [(s.labels["GPU_I_PROFILE"], s.labels["GPU_I_ID"], s.labels["pod"], s.value) for s in fb] == \
        [("1g.10gb", "3", "serve", 100.0)]
    assert fb[0].labels["UUID"] == U1 and fb[0].labels["gpu"] == "1"


def view(name: str, engine: str = "podman", cid: str = "c" * 64) -> list[dict]:
    proc = {"pid": 10, "command": "python", "memory": 300 << 20, "sm": 5, "kinds": ["compute"]}
    mps = {"pid": 11, "command": "python", "memory": None, "sm": None, "kinds": ["mps"]}
    return [{"index": 0, "minor": 0, "uuid": U0, "model": "m", "utilization": 1, "memory_utilization": 1,
             "containers": [{"id": cid, "name": name, "engine": engine, "pid": 9, "how": "request",
                             "running": True, "evidence": ["process"], "memory": 300 << 20,
                             "processes": [proc, mps]},
                            {"id": "gone", "name": "", "engine": "", "pid": 8, "how": "lease", "running": False,
                             "evidence": ["lease"], "memory": None, "processes": []}],
             "host_processes": [{"pid": 1, "command": "Xorg", "memory": 1 << 20, "sm": 0, "kinds": ["graphics"]}]}]


def test_container_series_per_gpu_and_a_gone_leases_container_has_none():
    fams = by_name(families.containers(inventory(), view("web"), "n"))
    (mem,) = fams["nvcontainer_container_gpu_memory_bytes"].samples
    assert mem.labels == {"gpu": "0", "UUID": U0, "device": "nvidia0", "Hostname": "n", "engine": "podman",
                          "container_id": "c" * 64, "container_name": "web"}
    assert mem.value == 300 << 20
    assert fams["nvcontainer_container_gpu_processes"].samples[0].value == 2
    assert fams["nvcontainer_container_gpu_mps_clients"].samples[0].value == 1
    (lease,) = fams["nvcontainer_container_gpu_lease"].samples
    assert lease.labels["container_id"] == "gone" and lease.labels["running"] == "false"
    assert fams["nvcontainer_host_gpu_memory_bytes"].samples[0].value == 1 << 20


def test_kubernetes_containers_get_their_pods_names():
    fams = by_name(families.containers(inventory(), view("ml/train-0/main", "kubernetes"), "n"))
    labels = fams["nvcontainer_container_gpu_memory_bytes"].samples[0].labels
    assert (labels["namespace"], labels["pod"], labels["container"]) == ("ml", "train-0", "main")


HOSTILE = 'a"b\\c\nd\x1b[31mred\u00e9'


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text; version=1.0.0"])
def test_hostile_names_are_escaped_and_read_back_whole_in_both_formats(accept):
    fams = families.containers(inventory(), view(HOSTILE), "n")
    body, content_type = server.encode(fams, accept)
    text = body.decode()
    assert "\nd" not in text.replace("\\n", "")       # no raw newline inside a label value
    parse = parse_openmetrics if "openmetrics" in content_type else parse_text
    got = {f.name: f for f in parse(text)}
    name = "nvcontainer_container_gpu_memory_bytes"
    assert got[name].samples[0].labels["container_name"] == HOSTILE


def test_dcgm_counters_keep_their_names_in_both_formats():
    fams = families.build(inventory(), counters.default(), {U0: entry(U0)}, None, None, "n", {"nvml": True})
    text, _ = server.encode(fams, "text/plain; version=0.0.4")
    assert b"# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n" in text
    assert b"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text and b"_total" not in text
    fams = families.build(inventory(), counters.default(), {U0: entry(U0)}, None, None, "n", {"nvml": True})
    om, content_type = server.encode(fams, "application/openmetrics-text;version=1.0.0,text/plain;q=0.5")
    assert content_type.startswith("application/openmetrics-text") and om.endswith(b"# EOF\n")
    assert b"# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION unknown\n" in om and b"_total" not in om
    names = {s.name for f in parse_openmetrics(om.decode()) for s in f.samples}
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" in names and "DCGM_FI_DEV_GPU_TEMP" in names


# --- the web config and the listen address --------------------------------------------------

def test_web_config_tls_and_users():
    cfg = webconfig.parse("tls_server_config:\n  cert_file: /c.crt\n  key_file: /c.key\n"
                          "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: /ca.crt\n", "w")
    assert cfg.tls and cfg.client_auth_type == "RequireAndVerifyClientCert" and not cfg.users
    assert webconfig.parse("", "w") == webconfig.WebConfig()


@pytest.mark.parametrize("text, words", [
    ("http_server_config:\n  http2: false\n", "http_server_config is not supported"),
    ("tls_server_config:\n  cert_file: /c\n", "needs both cert_file and key_file"),
    ("tls_server_config:\n  cert_file: /c\n  key_file: /k\n  cipher_suites: [a]\n", "cipher_suites is not supported"),
    ("tls_server_config:\n  cert_file: /c\n  key_file: /k\n  client_auth_type: Maybe\n", "client_auth_type Maybe"),
    ("tls_server_config:\n  cert_file: /c\n  key_file: /k\n  client_auth_type: RequireAndVerifyClientCert\n",
     "needs client_ca_file"),
    ("basic_auth_users:\n  u: plaintext\n", "not a bcrypt hash"),
])
def test_a_bad_web_config_is_one_line(text, words):
    with pytest.raises(NvcError) as err:
        webconfig.parse(text, "web config file w.yml")
    assert words in err.value.detail and "\n" not in err.value.detail


def test_basic_auth_checks_bcrypt_hashes():
    bcrypt = pytest.importorskip("bcrypt")
    import base64

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    users = webconfig.Users(webconfig.parse(f"basic_auth_users:\n  prom: '{hashed}'\n", "w").users)
    good = "Basic " + base64.b64encode(b"prom:s3cret").decode()
    assert users.check(good) and users.check(good)        # the second from the cache
    assert not users.check("Basic " + base64.b64encode(b"prom:wrong").decode())
    assert not users.check("Basic " + base64.b64encode(b"eve:s3cret").decode())
    assert not users.check(None) and not users.check("Basic !!!") and not users.check("Bearer x")


@pytest.mark.parametrize("value, want", [
    (":9400", (socket.AF_INET6, "::", 9400)), ("127.0.0.1:9400", (socket.AF_INET, "127.0.0.1", 9400)),
    ("[::1]:19400", (socket.AF_INET6, "::1", 19400)),
])
def test_listen_addresses(value, want):
    assert parse_listen(value) == want


@pytest.mark.parametrize("value", ["9400", ":0", ":70000", "::1:9400", "host:port"])
def test_bad_listen_addresses(value):
    with pytest.raises(NvcError) as err:
        parse_listen(value)
    assert "--listen" in err.value.detail


def test_a_thousand_short_lived_containers_leave_no_series_behind():
    many = view("x")
    template = many[0]["containers"][0]
    many[0]["containers"] = [dict(template, id=f"{i:064x}", name=f"job-{i}") for i in range(1000)]
    fams = by_name(families.containers(inventory(), many, "n"))
    assert len(fams["nvcontainer_container_gpu_memory_bytes"].samples) == 1000
    gone = view("x")
    gone[0]["containers"] = []           # the next scrape: they all exited
    fams = by_name(families.containers(inventory(), gone, "n"))
    assert fams["nvcontainer_container_gpu_memory_bytes"].samples == []
    assert len(fams["nvcontainer_host_gpu_memory_bytes"].samples) == 1


def test_mps_clients_are_merged_into_the_activity_by_pid():
    from nvcontainer.metrics.attribution import activity

    got = activity({U0: {"activity": {"processes": [{"pid": 5, "memory": 10, "kinds": ["compute"], "sm": 1}],
                                      "utilization": 3, "memory_utilization": 4},
                         "mps": [{"pid": 5, "memory": None}, {"pid": 6, "memory": 20}]},
                    U1: {"gpu": U1, "error": "gpu is lost"}})
    (gpu,) = got["gpus"]
    assert {p["pid"]: p["kinds"] for p in gpu["processes"]} == {5: ["compute", "mps"], 6: ["mps"]}


def test_the_operators_files_are_read_bounded_and_never_block(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for load, path in ((counters.load, fifo), (webconfig.load, fifo), (counters.load, tmp_path),
                       (counters.load, tmp_path / "missing")):
        with pytest.raises(NvcError) as err:
            load(str(path))
        assert str(path) in err.value.detail and "\n" not in err.value.detail
    big = tmp_path / "big.csv"
    big.write_text("# x\n" * (counters.MAX_FILE // 4 + 1))
    with pytest.raises(NvcError, match="larger than"):
        counters.load(str(big))
