"""The device plugin's pure decisions, on inventories made by hand: settings, the advertised
table under each MIG strategy, Allocate under each strategy, preferred allocation over a
topology, and the health rules. No process, socket or GPU is involved (the other
test_deviceplugin_* files run the real thing)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st

from nvcontainer.config import load as config
from nvcontainer.deviceplugin import devices
from nvcontainer.health import rules as health
from nvcontainer.deviceplugin.allocate import Refused, allocate
from nvcontainer.deviceplugin.preferred import preferred
from nvcontainer.deviceplugin.settings import Settings, parse
from nvcontainer.health.topology import from_report
from nvcontainer.inventory.topology import Topology, sysfs_address
from nvcontainer.errors import NvcError
from nvcontainer.inventory.model import Gpu, Inventory, MigDevice
from nvcontainer.request.selection import allow_list


def gpu(i: int, *, migs=(), profile="1g.10gb") -> Gpu:
    mig_devices = tuple(
        MigDevice(parent=i, index=j, uuid=f"MIG-{i}{j}000000-0000-0000-0000-000000000000", gi=j + 1, ci=0,
                  gi_access="", ci_access="", name=f"NVIDIA A100 MIG {p}")
        for j, p in enumerate(migs))
    return Gpu(index=i, minor=i, model="NVIDIA A100", brand="Nvidia", uuid=f"GPU-{i}0000000-0000-0000-0000-00000000000{i}",
               bus_id=f"00000000:{0x07 + i:02x}:00.0", arch="8.0", mig_capable=True, mig_enabled=bool(migs),
               migs=mig_devices)


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory(root="/", driver_version="550.54.14", cuda_version="12.4", gpus=gpus)


PLAIN8 = inventory(*(gpu(i) for i in range(8)))
MIXED = inventory(gpu(0, migs=("1g.10gb", "2g.20gb", "1g.10gb")), gpu(1))
ALL_MIG = inventory(gpu(0, migs=("1g.10gb", "1g.10gb")), gpu(1, migs=("1g.10gb",)))


def table(inv=PLAIN8, **kw):
    return devices.advertise(inv, Settings(**kw))


def ids(resource):
    return [d.id for d in resource.devices]


# --- settings -----------------------------------------------------------------------------------


def test_settings_defaults_and_keys():
    assert parse(None) == Settings()
    s = parse({"mig-strategy": "mixed", "device-list-strategy": "envvar,cdi-cri", "replicas": 4,
               "ignore-xids": [48, 48, 79], "socket-dir": "/tmp/x/"})
    assert (s.mig_strategy, s.device_list_strategy, s.replicas, s.ignore_xids, s.socket_dir) == \
        ("mixed", ("envvar", "cdi-cri"), 4, (48, 79), "/tmp/x")
    assert (Settings().sharing, Settings().mps_root) == ("time-slicing", "/run/nvidia/mps")
    s = parse({"sharing": "mps", "mps-root": "/srv/mps/", "replicas": 2})
    assert (s.sharing, s.mps_root) == ("mps", "/srv/mps")


@pytest.mark.parametrize("raw, word", [
    ({"mig-stratgy": "none"}, "unknown key 'device-plugin.mig-stratgy'"),
    ({"mig-strategy": "all"}, "device-plugin.mig-strategy"),
    ({"replicas": 0}, "device-plugin.replicas"),
    ({"replicas": True}, "device-plugin.replicas"),
    ({"device-list-strategy": ["envvar", "nope"]}, "device-plugin.device-list-strategy"),
    ({"device-list-strategy": []}, "device-plugin.device-list-strategy"),
    ({"socket-dir": "relative"}, "device-plugin.socket-dir"),
    ({"cdi-kind": "nvidia.com"}, "device-plugin.cdi-kind"),
    ({"cdi-annotation-prefix": "cdi.k8s.io"}, "device-plugin.cdi-annotation-prefix"),
    ({"ignore-xids": ["48"]}, "device-plugin.ignore-xids"),
    ({"heartbeat-seconds": 2, "heartbeat-timeout-seconds": 3}, "twice"),
    ({"sharing": "MPS"}, "device-plugin.sharing"),
    ({"sharing": "timeslicing"}, "device-plugin.sharing"),
    ({"mps-root": "run/mps"}, "device-plugin.mps-root"),
])
def test_settings_refuse_bad_values(raw, word):
    with pytest.raises(NvcError) as err:
        parse(raw)
    assert word in str(err.value) and err.value.category == "config"


def test_command_line_overrides_are_checked_like_keys():
    s = Settings().with_overrides(mig_strategy="single", replicas=None, device_list_strategy=("cdi-cri",))
    assert (s.mig_strategy, s.replicas, s.device_list_strategy) == ("single", 1, ("cdi-cri",))
    with pytest.raises(NvcError, match="device-plugin.replicas"):
        Settings().with_overrides(replicas=1000)


def test_the_config_file_keeps_the_table_raw():
    cfg = config.parse('deadline = 5\n[device-plugin]\nmig-strategy = "mixed"\nreplicas = 2\n')
    assert cfg.device_plugin == {"mig-strategy": "mixed", "replicas": 2}
    assert parse(cfg.device_plugin).replicas == 2
    assert config.parse("").device_plugin is None
    hash(cfg)   # the raw table does not make the config unhashable
    with pytest.raises(NvcError, match="device-plugin: expected a table"):
        config.parse('device-plugin = "x"\n')


# --- the advertised table -----------------------------------------------------------------------


def test_none_strategy_advertises_every_gpu_by_uuid_or_index():
    (res,) = table()
    assert res.name == "nvidia.com/gpu" and res.socket == "nvcontainer-gpu.sock"
    assert ids(res) == [g.uuid for g in PLAIN8.gpus]
    (res,) = table(device_id_strategy="index")
    assert ids(res) == [str(i) for i in range(8)]
    (res,) = table(MIXED)           # MIG mode does not matter with none
    assert ids(res) == [g.uuid for g in MIXED.gpus]


def test_single_strategy_advertises_mig_devices_as_gpus():
    (res,) = table(ALL_MIG, mig_strategy="single")
    assert res.name == "nvidia.com/gpu"
    assert ids(res) == [m.uuid for g in ALL_MIG.gpus for m in g.migs]
    (res,) = table(ALL_MIG, mig_strategy="single", device_id_strategy="index")
    assert ids(res) == ["0:0", "0:1", "1:0"]
    (res,) = table(PLAIN8, mig_strategy="single")            # no MIG anywhere: whole GPUs
    assert len(res.devices) == 8


@pytest.mark.parametrize("inv, word", [(MIXED, "not on GPU 1"),
                                       (inventory(gpu(0, migs=("1g.10gb", "2g.20gb"))), "more than one MIG profile")])
def test_single_strategy_refuses_a_mixed_node(inv, word):
    with pytest.raises(NvcError, match=word):
        table(inv, mig_strategy="single")


def test_mixed_strategy_one_resource_per_profile():
    res = {r.name: r for r in table(MIXED, mig_strategy="mixed", device_id_strategy="index")}
    assert {n: ids(r) for n, r in res.items()} == {
        "nvidia.com/gpu": ["1"],
        "nvidia.com/mig-1g.10gb": ["0:0", "0:2"],
        "nvidia.com/mig-2g.20gb": ["0:1"],
    }
    assert res["nvidia.com/mig-2g.20gb"].socket == "nvcontainer-mig-2g.20gb.sock"


def test_mig_profile_comes_from_nvml_s_name():
    m = MigDevice(0, 0, "MIG-x", 1, 0, "", "", name="NVIDIA H100 80GB HBM3 MIG 1g.10gb+me")
    assert devices.mig_profile(m) == "1g.10gb+me"
    assert devices.resource_name("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"
    assert devices.mig_profile(MigDevice(0, 0, "MIG-x", 1, 0, "", "", name="")) == ""
    with pytest.raises(NvcError, match="no profile"):
        table(inventory(gpu(0, migs=("",))), mig_strategy="mixed")


def test_replicas_and_renaming():
    (res,) = table(inventory(gpu(0), gpu(1)), replicas=3)
    assert ids(res) == [f"{g}::{k}" for g in (gpu(0).uuid, gpu(1).uuid) for k in range(3)]
    assert {d.replica for d in res.devices} == {0, 1, 2}
    (res,) = table(inventory(gpu(0)), replicas=2, rename_shared=True, device_id_strategy="index")
    assert res.name == "nvidia.com/gpu.shared" and ids(res) == ["0::0", "0::1"]


def test_allowed_devices_limit_the_table():
    allow = allow_list(MIXED, ("1", MIXED.gpus[0].migs[1].uuid))
    res = {r.name: ids(r) for r in devices.advertise(MIXED, Settings(mig_strategy="mixed"), allow)}
    assert res == {"nvidia.com/gpu": [MIXED.gpus[1].uuid], "nvidia.com/mig-2g.20gb": [MIXED.gpus[0].migs[1].uuid]}
    (res,) = devices.advertise(PLAIN8, Settings(), allow_list(PLAIN8, ("2", "5")))
    assert ids(res) == [PLAIN8.gpus[2].uuid, PLAIN8.gpus[5].uuid]


def test_numa_nodes_go_with_the_devices():
    (res,) = devices.advertise(ALL_MIG, Settings(mig_strategy="single"), None, {0: 1})
    assert [d.numa for d in res.devices] == [1, 1, None]


# --- Allocate -----------------------------------------------------------------------------------


def response(res, request, **kw):
    s = Settings(**kw)
    return allocate(request, res, frozenset(), s, "rid")


def test_envvar_strategy():
    (res,) = table()
    got = response(res, [PLAIN8.gpus[3].uuid, PLAIN8.gpus[1].uuid])
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{PLAIN8.gpus[3].uuid},{PLAIN8.gpus[1].uuid}"}
    assert not got.mounts and not got.annotations and not got.cdi_devices


def test_volume_mounts_strategy():
    (res,) = table(device_id_strategy="index")
    got = response(res, ["2", "0"], device_id_strategy="index", device_list_strategy=("volume-mounts",))
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert [(m.container_path, m.host_path, m.read_only) for m in got.mounts] == [
        ("/var/run/nvidia-container-devices/2", "/dev/null", True),
        ("/var/run/nvidia-container-devices/0", "/dev/null", True)]


def test_cdi_strategies_name_what_cdi_generate_defines():
    (res,) = table(inventory(gpu(0), gpu(1)))
    got = response(res, [gpu(1).uuid], device_list_strategy=("cdi-annotations", "cdi-cri"))
    assert got.cdi_devices == (f"nvidia.com/gpu={gpu(1).uuid}",)
    assert dict(got.annotations) == {"cdi.k8s.io/nvcontainer-device-plugin_rid": f"nvidia.com/gpu={gpu(1).uuid}"}
    assert not got.envs
    (res,) = table(ALL_MIG, mig_strategy="single", device_id_strategy="index")
    got = response(res, ["0:1", "1:0"], device_id_strategy="index", device_list_strategy=("cdi-cri",),
                   cdi_kind="example.com/gpu")
    assert got.cdi_devices == ("example.com/gpu=0:1", "example.com/gpu=1:0")


def test_replicas_map_back_to_each_gpu_once():
    (res,) = table(inventory(gpu(0), gpu(1)), replicas=4)
    request = [f"{gpu(1).uuid}::3", f"{gpu(0).uuid}::0", f"{gpu(1).uuid}::1"]
    got = response(res, request, replicas=4)
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{gpu(1).uuid},{gpu(0).uuid}"}
    with pytest.raises(Refused, match="unknown device"):            # never more replicas than configured
        response(res, [f"{gpu(0).uuid}::4"], replicas=4)
    with pytest.raises(Refused, match="at most 1"):
        response(res, request, replicas=4, fail_requests_greater_than_one=True)
    assert response(res, request[:1], replicas=4, fail_requests_greater_than_one=True).envs


@pytest.mark.parametrize("request_, word", [
    (["GPU-nope"], "unknown device GPU-nope for nvidia.com/gpu"),
    (["0\n1"], "unknown device 0\\n1"),
    (["x" * 500], "not a device ID"),
    ([], "no device IDs"),
    (["0"] * 2000, "at most 1024"),
])
def test_bad_requests_are_refused_with_one_escaped_line(request_, word):
    (res,) = table()
    with pytest.raises(Refused) as err:
        response(res, request_)
    assert word in err.value.message and "\n" not in err.value.message and err.value.code == "invalid"


def test_unhealthy_devices_are_refused():
    (res,) = table()
    with pytest.raises(Refused, match="is unhealthy") as err:
        allocate([gpu(0).uuid, gpu(2).uuid], res, frozenset({PLAIN8.gpus[2].uuid}), Settings(), "r")
    assert err.value.code == "unhealthy"


# --- preferred allocation -----------------------------------------------------------------------

# two NUMA nodes of four GPUs; NVLink pairs 0-1, 2-3, 4-5, 6-7 (two links) bridged 1-2 and 5-6
DGX = Topology(numa={i: i // 4 for i in range(8)},
               links={(0, 1): 2, (2, 3): 2, (4, 5): 2, (6, 7): 2, (1, 2): 1, (5, 6): 1},
               pcie={(a, b): (10 if a // 2 == b // 2 else 40 if a // 4 == b // 4 else 50)
                     for a in range(8) for b in range(a + 1, 8)})


def pick(available, size, must=(), topo=DGX, **kw):
    (res,) = table(device_id_strategy="index", **kw)
    return sorted(preferred([str(a) for a in available], [str(m) for m in must], size, res, topo,
                            spread=kw.get("replicas", 1) > 1))


@pytest.mark.parametrize("available, size, must, want", [
    (range(8), 2, (), ["0", "1"]),                   # an NVLink pair
    (range(8), 2, (1,), ["0", "1"]),                 # two links beat the one-link bridge 1-2
    (range(8), 2, (2,), ["2", "3"]),
    ([0, 2, 3, 4], 2, (), ["2", "3"]),
    ([0, 3, 4, 5], 2, (), ["4", "5"]),
    ([0, 4], 2, (), ["0", "4"]),                     # nothing better to be had
    (range(8), 4, (), ["0", "1", "2", "3"]),         # one NUMA node, most NVLinks
    ([1, 2, 4, 5, 6, 7], 4, (), ["4", "5", "6", "7"]),
    ([0, 1, 2, 4, 5], 3, (), ["0", "1", "2"]),
    ([1, 3, 4], 2, (), ["1", "3"]),                  # same NUMA node over NVLink-less cross-socket
    (range(8), 8, (), [str(i) for i in range(8)]),
])
def test_preferred_allocation_prefers_numa_then_nvlink(available, size, must, want):
    assert pick(available, size, must) == want


def test_preferred_allocation_without_nvml_topology_keeps_numa():
    numa_only = Topology(numa={i: i // 4 for i in range(8)})
    assert pick([0, 4, 5, 6], 2, topo=numa_only) == ["4", "5"]
    assert pick([3, 4, 5], 2, (3,), topo=Topology()) == ["3", "4"]


def test_preferred_replicas_spread_over_gpus_and_the_least_shared():
    (res,) = table(device_id_strategy="index", replicas=4)
    available = [f"{g}::{k}" for g in (0, 1) for k in range(4)] + ["4::3"]
    got = preferred(available, [], 2, res, DGX, spread=True)
    assert sorted(g.split("::")[0] for g in got) == ["0", "1"]
    got = preferred(["0::0", "1::0", "1::1", "1::2"], [], 1, res, DGX, spread=True)
    assert got[0].startswith("1::")                  # GPU 1 has more replicas free
    got = preferred(["0::0", "0::1", "0::2"], ["0::2"], 2, res, DGX, spread=True)
    assert got[0] == "0::2" and len(set(got)) == 2


@pytest.mark.parametrize("available, must, size, word", [
    (["0", "1"], [], 3, "allocation size"),
    (["0", "1"], ["0", "1"], 1, "allocation size"),
    (["0", "9"], [], 1, "unknown available device 9"),
    (["0"], ["7"], 1, "unknown must-include device 7"),
])
def test_preferred_allocation_refuses_nonsense(available, must, size, word):
    (res,) = table(inventory(gpu(0), gpu(1), gpu(2)), device_id_strategy="index")
    with pytest.raises(Refused, match=word):
        preferred(available, must, size, res, Topology())


@hsettings(max_examples=150, deadline=None)
@given(st.data())
def test_preferred_allocation_invariants(data):
    replicas = data.draw(st.sampled_from([1, 1, 3]))
    (res,) = table(PLAIN8, device_id_strategy="index", replicas=replicas)
    everything = [d.id for d in res.devices]
    available = data.draw(st.lists(st.sampled_from(everything), min_size=1, unique=True))
    must = data.draw(st.lists(st.sampled_from(available), unique=True, max_size=len(available)))
    size = data.draw(st.integers(min_value=max(1, len(must)), max_value=len(available)))
    got = preferred(available, must, size, res, DGX, spread=replicas > 1)
    assert len(got) == size == len(set(got))
    assert set(must) <= set(got) <= set(available)
    assert got[:len(must)] == must


def test_a_large_node_is_chosen_greedily_but_well():
    big = inventory(*(gpu(i) for i in range(64)))
    (res,) = devices.advertise(big, Settings(device_id_strategy="index"))
    topo = Topology(numa={i: i // 16 for i in range(64)}, links={(i, i + 1): 2 for i in range(0, 64, 2)})
    got = preferred([str(i) for i in range(64)], ["17"], 8, res, topo)
    assert got[0] == "17" and len(got) == 8
    assert {int(g) // 16 for g in got} == {1}                           # one NUMA node
    assert "16" in got                                                 # 17's NVLink peer


# --- health -------------------------------------------------------------------------------------

POLICY = health.Policy(frozenset({48}), recovery=60)
NOI = health.NO_INSTANCE


def bad(h, inv=ALL_MIG):
    return health.bad_units(h, inv)


def test_critical_xids_and_only_those():
    g0 = ALL_MIG.gpus[0]
    h = health.Health()
    for xid in (13, 31, 43, 45, 68, 109, 48):          # application errors, and one the operator ignores
        h = health.on_event(h, g0.uuid, 0x8, xid, NOI, NOI, 0, POLICY)
    h = health.on_event(h, g0.uuid, 0x2, 79, NOI, NOI, 0, POLICY)   # not an XID event
    assert bad(h) == {}
    h = health.on_event(h, g0.uuid, 0x8, 79, NOI, NOI, 0, POLICY)
    assert bad(h) == {g0.uuid: "XID 79", g0.migs[0].uuid: "XID 79", g0.migs[1].uuid: "XID 79"}


def test_an_xid_on_one_mig_instance_marks_it_and_its_gpu():
    g0 = ALL_MIG.gpus[0]
    m1 = g0.migs[1]
    h = health.on_event(health.Health(), g0.uuid, 0x8, 94, m1.gi, m1.ci, 0, POLICY)
    assert set(bad(h)) == {g0.uuid, m1.uuid}


def test_recovery_lost_gpus_and_a_silent_driver():
    g0, g1 = ALL_MIG.gpus
    h = health.on_event(health.Health(), g1.uuid, 0x8, 79, NOI, NOI, 100, POLICY)
    h = health.on_beat(h, [g0.uuid], 120, POLICY)
    assert set(bad(h)) == {g0.uuid, *(m.uuid for m in g0.migs), g1.uuid, g1.migs[0].uuid}
    assert bad(h)[g0.migs[0].uuid] == "GPU is lost"
    h = health.on_beat(h, [], 150, POLICY)             # GPU 0 answers again; the XID is 50 s old
    assert set(bad(h)) == {g1.uuid, g1.migs[0].uuid}
    h = health.on_beat(h, [], 160, POLICY)             # 60 s without another: healthy
    assert bad(h) == {}
    h = health.on_down(h, "no heartbeat")
    assert set(bad(h).values()) == {"no heartbeat"} and len(bad(h)) == 5
    assert bad(health.on_beat(h, [], 170, POLICY)) == {}


def test_without_recovery_an_xid_stays():
    g0 = PLAIN8.gpus[0]
    never = health.Policy()
    h = health.on_event(health.Health(), g0.uuid, 0x8, 79, NOI, NOI, 0, never)
    assert g0.uuid in bad(health.on_beat(h, [], 1e9, never), PLAIN8)


# --- topology -----------------------------------------------------------------------------------


def test_topology_report_in_indexes_and_malformed_entries_dropped():
    u = [g.uuid for g in PLAIN8.gpus]
    report = {"nvlink": [[u[1], u[0], 2], [u[2], "GPU-unknown", 1], [u[3], u[3], 4], "junk", [u[4], u[5], "2"]],
              "pcie": [[u[0], u[1], 10], [u[0], u[7], 99]]}
    topo = from_report(report, PLAIN8, {0: 0})
    assert topo.links == {(0, 1): 2} and topo.pcie == {(0, 1): 10} and topo.numa == {0: 0}
    assert topo.link_count(1, 0) == 2 and topo.pcie_level(0, 7) == 50 and topo.pcie_level(3, 3) == 0
    assert sysfs_address("00000000:07:00.0") == "0000:07:00.0"
    assert sysfs_address("00010000:07:00.0") == "00010000:07:00.0"


def test_the_dra_driver_reads_the_health_keys_as_the_device_plugin_does():
    """One parser for the [device-plugin] table's health keys (health/settings.py), below both
    plugins: same values, same one-line refusals; the keys only the device plugin reads are its own."""
    from nvcontainer.health import settings as health

    raw = {"health-checks": False, "ignore-xids": [79, 13, 13], "xid-recovery-seconds": 30,
           "heartbeat-seconds": 1, "heartbeat-timeout-seconds": 9, "replicas": 4}
    plugin, alone = parse(raw), health.parse(raw)
    for key in health.KEYS.values():
        assert getattr(plugin, key[0]) == getattr(alone, key[0])
    assert alone.ignore_xids == (13, 79)
    for bad, message in [({"ignore-xids": ["13"]}, "device-plugin.ignore-xids: expected an array"),
                         ({"heartbeat-seconds": 3, "heartbeat-timeout-seconds": 5}, "more than twice"),
                         ({"health-checks": "no"}, "device-plugin.health-checks: expected true or false")]:
        for parser in (parse, health.parse):
            with pytest.raises(NvcError) as exc:
                parser(bad)
            assert message in exc.value.detail
