import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvcontainer.config.model import Config
from nvcontainer.errors import NvcError
from nvcontainer.request.oci import Mount
from nvcontainer.request.decide import CAPABILITIES, MAX_IDS, MAX_VALUE, Request, device_kind, request_from_env, request_from_options

CFG = Config()


def env_request(env, config=CFG, privileged=False, mounts=()):
    return request_from_env(env, config, privileged=privileged, mounts=mounts)


def env_error(env, config=CFG, privileged=False, mounts=()) -> NvcError:
    with pytest.raises(NvcError) as info:
        env_request(env, config, privileged, mounts)
    return info.value


def dev_mount(name, source="/dev/null"):
    return Mount(source, f"/var/run/nvidia-container-devices/{name}", "bind", ("ro", "rbind"))


# --- NVIDIA_VISIBLE_DEVICES ------------------------------------------------------------------

@pytest.mark.parametrize("value, gpu, devices", [
    (None, False, ()),                      # unset: not a GPU container
    ("", False, ()),
    ("  , ,", False, ()),
    ("void", False, ()),
    ("0,void", False, ()),                  # void anywhere wins
    ("all,void", False, ()),
    ("none", True, ()),                     # the driver without GPUs
    ("all", True, "all"),
    (" all ", True, "all"),
    ("0,all", True, "all"),                 # first all/none decides
    ("0,none,all", True, ()),
    ("all,none", True, "all"),
    ("ALL", True, "all"),                   # upstream's cli compares "all" without case (issue 15.8)
    ("0,All", True, "all"),
    ("ALL,none", True, ()),                 # the hook sees none first; "ALL" only means all to the cli
    ("0,ALL,none,all", True, ()),
    ("0", True, ("0",)),
    (" 1 , 0,,1, 0 ", True, ("1", "0")),    # trimmed, empties dropped, duplicates folded in order
    ("GPU-5f8e1a2b-1111-2222-3333-444455556666,0000:07:00.0,0:1", True,
     ("GPU-5f8e1a2b-1111-2222-3333-444455556666", "0000:07:00.0", "0:1")),
])
def test_visible_devices(value, gpu, devices):
    env = {} if value is None else {"NVIDIA_VISIBLE_DEVICES": value}
    r = env_request(env)
    assert (r.gpu, r.devices) == (gpu, devices)


def test_not_a_gpu_container_ignores_other_variables():
    r = env_request({"NVIDIA_DRIVER_CAPABILITIES": "bogus", "NVIDIA_REQUIRE_X": "!!", "CUDA_VERSION": "",
                     "NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_IMEX_CHANNELS": "x" * (MAX_VALUE + 1)})
    assert r == Request(gpu=False)


def test_gpu_container_defaults():
    assert env_request({"NVIDIA_VISIBLE_DEVICES": "all"}) == Request(
        gpu=True, devices="all", capabilities=("compute", "utility"))


@pytest.mark.parametrize("token, kind", [
    ("0", "index"), ("15", "index"), ("99999", "index"),
    ("GPU-5f8e1a2b-1111-2222-3333-444455556666", "gpu-uuid"), ("gpu-5F8E", "gpu-uuid"), ("GPU-5", "gpu-uuid"),
    ("0000:07:00.0", "bus-id"), ("00000000:af:1f.7", "bus-id"), ("07:00.0", "bus-id"), ("1:2:3.0", "bus-id"),
    ("MIG-12345678-abcd-ef01-2345-6789abcdef01", "mig-uuid"), ("mig-ab", "mig-uuid"),
    ("MIG-GPU-5f8e1a2b-1111-2222-3333-444455556666/1/0", "mig-legacy"), ("MIG-GPU-5f/14/2", "mig-legacy"),
    ("0:0", "mig-index"), ("3:12", "mig-index"),
])
def test_device_forms(token, kind):
    assert device_kind(token) == kind
    assert env_request({"NVIDIA_VISIBLE_DEVICES": token}).devices == (token,)


@pytest.mark.parametrize("token", [
    "-1", "1.5", "123456", "0x1", "GPU-", "GPU-xyz", "GPU-" + "a" * 37, "GPU-../../etc", "MIG-",
    "MIG-GPU-abc/1", "MIG-GPU-abc/1/2/3", "MIG-GPU-abc/a/0", "0:", ":0", "0:1:2", "0000:07:00", "0000:07:00.8",
    "000000000:07:00.0", "0000:007:00.0", "gpu0", "/dev/nvidia0", "0 1", "\x1b[2J", "GPU-a\nb", "１",
])
def test_device_syntax_errors(token):
    assert device_kind(token) is None
    err = env_error({"NVIDIA_VISIBLE_DEVICES": f"0,{token}"})
    assert err.category == "device"
    assert err.detail.startswith("NVIDIA_VISIBLE_DEVICES: '")
    assert "unknown device (expected an index, GPU-<uuid>, a PCI bus id" in err.detail
    assert "\n" not in err.detail and "\x1b" not in err.detail


def test_cdi_name_in_env_is_refused_clearly():
    err = env_error({"NVIDIA_VISIBLE_DEVICES": "nvidia.com/gpu=all"})
    assert str(err) == ("device error: NVIDIA_VISIBLE_DEVICES: 'nvidia.com/gpu=all' is a CDI device name; "
                        "CDI devices are given to containers by a CDI-enabled runtime, not by this hook")


def test_device_bounds():
    many = ",".join(f"GPU-{i:x}" for i in range(MAX_IDS))
    assert len(env_request({"NVIDIA_VISIBLE_DEVICES": many}).devices) == MAX_IDS
    err = env_error({"NVIDIA_VISIBLE_DEVICES": ",".join(f"GPU-{i:x}" for i in range(MAX_IDS + 1))})
    assert "1025 device ids (at most 1024)" in err.detail
    # duplicates fold before the count
    assert env_request({"NVIDIA_VISIBLE_DEVICES": ",".join(["0"] * 5000)}).devices == ("0",)
    err = env_error({"NVIDIA_VISIBLE_DEVICES": "0," * (MAX_VALUE // 2 + 1)})
    assert str(err) == f"input error: NVIDIA_VISIBLE_DEVICES: value longer than {MAX_VALUE} characters"


# --- legacy CUDA images ---------------------------------------------------------------------

@pytest.mark.parametrize("env, devices, caps, reqs", [
    ({"CUDA_VERSION": "9.0.176"}, "all", CAPABILITIES, ("cuda>=9.0",)),
    ({"CUDA_VERSION": "v10.2"}, "all", CAPABILITIES, ("cuda>=10.2",)),
    ({"CUDA_VERSION": "11"}, "all", CAPABILITIES, ("cuda>=11.0",)),
    ({"CUDA_VERSION": "11.0.3-rc.1+build.5"}, "all", CAPABILITIES, ("cuda>=11.0",)),
    ({"CUDA_VERSION": "9.0", "NVIDIA_VISIBLE_DEVICES": "1"}, ("1",), CAPABILITIES, ("cuda>=9.0",)),
    ({"CUDA_VERSION": "9.0", "NVIDIA_DRIVER_CAPABILITIES": "utility"}, "all", ("utility",), ("cuda>=9.0",)),
    ({"CUDA_VERSION": "9.0", "NVIDIA_DRIVER_CAPABILITIES": ""}, "all", ("compute", "utility"), ("cuda>=9.0",)),
    ({"CUDA_VERSION": "9.0", "NVIDIA_REQUIRE_FOO": "driver>=400"}, "all", CAPABILITIES,
     ("driver>=400", "cuda>=9.0")),
    # not legacy: NVIDIA_REQUIRE_CUDA set, so unset devices mean "no GPU"
    ({"CUDA_VERSION": "12.4.1", "NVIDIA_REQUIRE_CUDA": "cuda>=12.4", "NVIDIA_VISIBLE_DEVICES": "all"},
     "all", ("compute", "utility"), ("cuda>=12.4",)),
])
def test_legacy_image(env, devices, caps, reqs):
    r = env_request(env)
    assert (r.gpu, r.devices, r.capabilities, r.requirements) == (True, devices, caps, reqs)


def test_not_legacy_without_visible_devices():
    assert not env_request({"CUDA_VERSION": "12.4.1", "NVIDIA_REQUIRE_CUDA": "cuda>=12.4"}).gpu
    assert not env_request({"CUDA_VERSION": ""}).gpu
    assert not env_request({"CUDA_VERSION": "9.0", "NVIDIA_VISIBLE_DEVICES": ""}).gpu   # set but empty


@pytest.mark.parametrize("version", ["9.x", "09.0", "9.0.176.1", "9.0-rc1", "", "vv9.0", "9.0.", "99999999999.0"])
def test_legacy_invalid_version(version):
    env = {"CUDA_VERSION": version or " ", "NVIDIA_VISIBLE_DEVICES": "all"}
    err = env_error(env)
    assert err.category == "input" and err.detail.startswith("CUDA_VERSION: invalid version")


def test_legacy_requirement_dropped_when_disabled():
    r = env_request({"CUDA_VERSION": "bogus", "NVIDIA_DISABLE_REQUIRE": "1"})
    assert r.devices == "all" and r.requirements == ()


def test_legacy_unprivileged_refused():
    r = env_request({"CUDA_VERSION": "9.0"}, Config(accept_envvar_unprivileged=False))
    assert not r.gpu and r.warnings


# --- NVIDIA_DRIVER_CAPABILITIES -------------------------------------------------------------

@pytest.mark.parametrize("value, supported, caps", [
    (None, CAPABILITIES, ("compute", "utility")),
    ("", CAPABILITIES, ("compute", "utility")),
    (" , ", CAPABILITIES, ("compute", "utility")),
    ("all", CAPABILITIES, CAPABILITIES),
    ("video,all", CAPABILITIES, CAPABILITIES),
    ("video, graphics ,video", CAPABILITIES, ("graphics", "video")),
    ("utility", ("utility",), ("utility",)),
    ("all", ("utility", "video"), ("utility", "video")),
    (None, ("utility", "video"), ("utility",)),            # the default is cut to what is supported
    (None, ("graphics",), ()),
])
def test_capabilities(value, supported, caps):
    env = {"NVIDIA_VISIBLE_DEVICES": "all"}
    if value is not None:
        env["NVIDIA_DRIVER_CAPABILITIES"] = value
    assert env_request(env, Config(supported_driver_capabilities=supported)).capabilities == caps


@pytest.mark.parametrize("value, supported", [
    ("none", CAPABILITIES), ("compute,gpu", CAPABILITIES), ("Compute", CAPABILITIES),
    ("compute,video", ("compute", "utility")),
    ("all,bogus", CAPABILITIES), ("bogus,all", CAPABILITIES),   # "all" does not hide an unknown name (15.9)
])
def test_capabilities_unsupported(value, supported):
    err = env_error({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": value},
                    Config(supported_driver_capabilities=supported))
    assert str(err) == (f"input error: unsupported capabilities found in '{value}' "
                        f"(allowed '{','.join(sorted(supported))}')")


def test_capability_implications():
    r = Request(gpu=True, capabilities=("display", "video"))
    assert r.library_groups == {"compute", "video", "graphics"}
    assert r.binary_groups == set()
    r = Request(gpu=True, capabilities=("compat32", "compute", "utility"))
    assert r.library_groups == {"compute", "utility"} and r.binary_groups == {"compute", "utility"}


# --- NVIDIA_REQUIRE_* and NVIDIA_DISABLE_REQUIRE ---------------------------------------------

def test_requirements_sorted_by_name_jetpack_excluded():
    r = env_request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=12.4 brand=tesla,driver>=470",
                     "NVIDIA_REQUIRE_ARCH": "arch>=8.0", "NVIDIA_REQUIRE_JETPACK": "csv-mounts=all",
                     "NVIDIA_REQUIRE_JETPACK_X": "x", "NVIDIA_REQUIRE_EMPTY": " ", "NVIDIA_REQUIREMENT": "cuda>=99"})
    assert r.requirements == ("arch>=8.0", "cuda>=12.4 brand=tesla,driver>=470")


def test_requirement_invalid_names_variable():
    err = env_error({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_BAD": "cuda>>1"})
    assert err.category == "requirement"
    assert err.detail.startswith("NVIDIA_REQUIRE_BAD: invalid expression: cuda>>1")


def test_requirement_count_bound():
    env = {"NVIDIA_VISIBLE_DEVICES": "0", **{f"NVIDIA_REQUIRE_{i:02}": "cuda>=1" for i in range(32)}}
    assert len(env_request(env).requirements) == 32
    env["NVIDIA_REQUIRE_99"] = "cuda>=1"
    assert "too many requirements: 33" in env_error(env).detail


@pytest.mark.parametrize("value, disabled", [
    ("1", True), ("t", True), ("T", True), ("TRUE", True), ("true", True), ("True", True),
    ("0", False), ("false", False), ("yes", False), ("tRUE", False), (" true", False), ("", False), (None, False),
])
def test_disable_require_truthiness(value, disabled):
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=99"}
    if value is not None:
        env["NVIDIA_DISABLE_REQUIRE"] = value
    assert env_request(env).requirements == (() if disabled else ("cuda>=99",))


def test_disable_require_config():
    env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "garbage", "NVIDIA_DISABLE_REQUIRE": "false"}
    assert env_request(env, Config(disable_require=True)).requirements == ()


# --- MIG --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, short", [("NVIDIA_MIG_CONFIG_DEVICES", "MIG_CONFIG_DEVICES"),
                                         ("NVIDIA_MIG_MONITOR_DEVICES", "MIG_MONITOR_DEVICES")])
def test_mig_unprivileged_is_fatal(name, short):
    err = env_error({"NVIDIA_VISIBLE_DEVICES": "all", name: "all"})
    assert str(err) == f"input error: cannot set {short} in non privileged container"
    assert env_request({"NVIDIA_VISIBLE_DEVICES": "all", name: ""}).gpu   # empty is fine


def test_mig_privileged():
    r = env_request({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all",
                     "NVIDIA_MIG_MONITOR_DEVICES": " all "}, privileged=True)
    assert (r.mig_config, r.mig_monitor) == ("all", "all")
    err = env_error({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "0"}, privileged=True)
    assert str(err) == "mig-monitor error: only 'all' devices are currently supported, got '0'"


# --- IMEX -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, channels, warned", [
    (None, (), False), ("", (), False), ("void", (), False), ("none", (), False),
    ("all", (), True), ("0, 3,0,1048575", (0, 3, 1048575), False),
])
def test_imex(value, channels, warned):
    env = {"NVIDIA_VISIBLE_DEVICES": "all"}
    if value is not None:
        env["NVIDIA_IMEX_CHANNELS"] = value
    r = env_request(env)
    assert r.imex_channels == channels and bool(r.warnings) is warned


@pytest.mark.parametrize("bad", ["1048576", "-1", "0x1", "1.0", "a", "٣", "99999999999999999999"])
def test_imex_invalid(bad):
    err = env_error({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_IMEX_CHANNELS": f"1,{bad}"})
    assert err.category == "input" and f"unsupported IMEX channel value: {bad}" in err.detail


def test_imex_unprivileged_refused():
    cfg = Config(accept_envvar_unprivileged=False, accept_volume_mounts=True)
    r = env_request({"NVIDIA_IMEX_CHANNELS": "1"}, cfg, mounts=[dev_mount("0")])
    assert r.devices == ("0",) and r.imex_channels == () and "NVIDIA_IMEX_CHANNELS" in r.warnings[0]
    r = env_request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "1"}, cfg, privileged=True)
    assert r.imex_channels == (1,)


# --- unprivileged policy, swarm, volume mounts ------------------------------------------------

def test_unprivileged_envvar_policy():
    strict = Config(accept_envvar_unprivileged=False)
    env = {"NVIDIA_VISIBLE_DEVICES": "all"}
    assert env_request(env, strict, privileged=True).devices == "all"
    assert env_request(env).devices == "all"
    r = env_request(env, strict)
    assert not r.gpu and r.devices == ()
    assert r.warnings == ("ignoring NVIDIA_VISIBLE_DEVICES of an unprivileged container "
                          "(accept-nvidia-visible-devices-envvar-when-unprivileged = false)",)
    # nothing requested: nothing to warn about
    assert env_request({}, strict).warnings == ()
    # a refused request is not validated either
    assert not env_request({"NVIDIA_VISIBLE_DEVICES": "junk!"}, strict).gpu


@pytest.mark.parametrize("env, devices", [
    ({"DOCKER_RESOURCE_GPU": "GPU-aa", "NVIDIA_VISIBLE_DEVICES": "all"}, ("GPU-aa",)),
    ({"DOCKER_RESOURCE_GPU": "GPU-aa", "OTHER": "GPU-bb,GPU-aa"}, ("GPU-aa", "GPU-bb")),
    ({"OTHER": "1"}, ("1",)),
    ({"NVIDIA_VISIBLE_DEVICES": "all"}, "all"),
    # set but empty counts as unset (issue 15.10; upstream takes the GPUs away)
    ({"DOCKER_RESOURCE_GPU": "", "NVIDIA_VISIBLE_DEVICES": "all"}, "all"),
    ({"DOCKER_RESOURCE_GPU": " , ", "OTHER": "", "NVIDIA_VISIBLE_DEVICES": "0"}, ("0",)),
    ({"DOCKER_RESOURCE_GPU": "", "OTHER": "1"}, ("1",)),
    ({"DOCKER_RESOURCE_GPU": "void", "NVIDIA_VISIBLE_DEVICES": "all"}, None),
])
def test_swarm_resource_precedence(env, devices):
    r = env_request(env, Config(swarm_resource=("DOCKER_RESOURCE_GPU", "OTHER")))
    assert (r.devices if r.gpu else None) == devices


def test_swarm_unprivileged_refused_names_variables():
    r = env_request({"OTHER": "1"}, Config(swarm_resource=("DOCKER_RESOURCE_GPU", "OTHER"),
                                           accept_envvar_unprivileged=False))
    assert not r.gpu and r.warnings[0].startswith("ignoring OTHER of an unprivileged container")


VOLUMES = Config(accept_volume_mounts=True, accept_envvar_unprivileged=False)


def test_volume_mounts_take_precedence():
    mounts = [dev_mount("GPU-aa"), dev_mount("1"), dev_mount("1/"), dev_mount("imex/3"),
              Mount("/dev/null", "/proc/kcore", "bind", ()),
              Mount("/host/file", "/var/run/nvidia-container-devices/7", "bind", ()),
              Mount("/dev/null", "/var/run/nvidia-container-devicesX/8", "bind", ()),
              Mount("/dev/../dev/null", "/var/run/nvidia-container-devices/./0:1", "bind", ())]
    r = env_request({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_IMEX_CHANNELS": "9"}, VOLUMES, mounts=mounts)
    assert r.devices == ("GPU-aa", "1", "0:1")
    assert r.imex_channels == (3,)
    assert r.warnings == ()


def test_volume_mounts_ignored_unless_enabled():
    r = env_request({"NVIDIA_VISIBLE_DEVICES": "0"}, mounts=[dev_mount("1")])
    assert r.devices == ("0",)


def test_volume_mounts_all_and_fallback():
    assert env_request({}, VOLUMES, mounts=[dev_mount("all")]).devices == "all"
    # no device mounts: fall back to the environment, which the policy refuses
    r = env_request({"NVIDIA_VISIBLE_DEVICES": "all"}, VOLUMES, mounts=[dev_mount("imex/1")])
    assert not r.gpu and r.warnings


@pytest.mark.parametrize("name, fragment", [
    ("cdi/nvidia.com/gpu/0", "CDI device requests need a CDI-enabled runtime"),
    ("cdi/nvidia.com/gpu=0", "CDI device requests need a CDI-enabled runtime"),
    ("../../etc", None),
    ("foo/bar", "unknown device"),
])
def test_volume_mount_rejections(name, fragment):
    mount = dev_mount(name)
    if fragment is None:   # escapes the root after normalisation: not a device request at all
        assert not env_request({}, VOLUMES, mounts=[mount]).gpu
        return
    err = env_error({}, VOLUMES, mounts=[mount])
    assert err.category == "device" and fragment in err.detail


def test_volume_mount_imex_invalid():
    err = env_error({}, VOLUMES, mounts=[dev_mount("0"), dev_mount("imex/x")])
    assert "volume mounts: unsupported IMEX channel value: x" in err.detail


def test_volume_mount_count_bound():
    mounts = [dev_mount(str(i)) for i in range(MAX_IDS + 1)]
    assert "more than 1024 device requests" in env_error({}, VOLUMES, mounts=mounts).detail


# --- configure's own options -------------------------------------------------------------------

def test_options_basic():
    r = request_from_options(devices=["0, GPU-aa", "1:0,0"], capabilities=["video", "compat32", "utility"],
                             requirements=["cuda>=12"], imex_channels=["1,2", "2"], mig_config="all")
    assert r == Request(gpu=True, devices=("0", "GPU-aa", "1:0"), capabilities=("compat32", "utility", "video"),
                        requirements=("cuda>=12",), mig_config="all", imex_channels=(1, 2))
    assert r.library_groups == {"compute", "utility", "video"}


def test_options_no_device_is_driver_only():
    assert request_from_options() == Request(gpu=True)


def test_options_all_stops_parsing():
    assert request_from_options(devices=["0,all,junk!"]).devices == "all"
    assert request_from_options(devices=["0", "ALL"]).devices == "all"
    with pytest.raises(NvcError, match="--device: 'junk!': unknown device"):
        request_from_options(devices=["junk!,all"])


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": ["none"]}, "device error: --device: 'none': unknown device"),
    ({"capabilities": ["gpu"]}, "input error: unknown capability 'gpu'"),
    ({"requirements": ["cuda>"]}, "requirement error: invalid expression: cuda>"),
    ({"requirements": ["cuda>=1"] * 33}, "requirement error: too many requirements: 33"),
    ({"mig_config": "0"}, "mig-config error: only 'all' devices are currently supported"),
    ({"imex_channels": ["1048576"]}, "input error: --imex-channel: unsupported IMEX channel value: 1048576"),
])
def test_options_errors(kwargs, message):
    with pytest.raises(NvcError) as info:
        request_from_options(**kwargs)
    assert str(info.value).startswith(message)


# --- nothing but NvcError, whatever the environment ------------------------------------------

names = st.sampled_from([
    "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA", "NVIDIA_REQUIRE_X",
    "NVIDIA_DISABLE_REQUIRE", "CUDA_VERSION", "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES",
    "NVIDIA_IMEX_CHANNELS", "DOCKER_RESOURCE_GPU", "NVIDIA_REQUIRE_JETPACK",
])
values = st.text(max_size=40) | st.sampled_from(
    ["all", "none", "void", "0,1", "GPU-ab,0:1", "compute,video", "cuda>=12.4 brand=tesla", "9.0.176", "1", ""])
mount_st = st.builds(Mount, st.sampled_from(["/dev/null", "/x"]),
                     st.text(max_size=12).map(lambda t: "/var/run/nvidia-container-devices/" + t)
                     | st.text(max_size=20),
                     st.just("bind"), st.just(()))
configs = st.builds(Config, swarm_resource=st.sampled_from([(), ("DOCKER_RESOURCE_GPU",)]),
                    accept_envvar_unprivileged=st.booleans(), accept_volume_mounts=st.booleans(),
                    disable_require=st.booleans(),
                    supported_driver_capabilities=st.sampled_from([CAPABILITIES, ("utility",)]))


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(names | st.text(max_size=10), values, max_size=6), configs, st.booleans(),
       st.lists(mount_st, max_size=3))
def test_env_parser_raises_only_nvc_error(env, config, privileged, mounts):
    try:
        r = request_from_env(env, config, privileged=privileged, mounts=mounts)
    except NvcError as exc:
        assert "\n" not in str(exc)
        return
    if r.gpu and r.devices != "all":
        assert all(device_kind(t) for t in r.devices)
    assert set(r.capabilities) <= set(config.supported_driver_capabilities)


def test_ignore_imex_channel_requests_feature():
    """[features] ignore-imex-channel-requests: neither the variable nor a volume mount asks for
    a channel, and an invalid value is not even read."""
    cfg = Config(ignore_imex_channel_requests=True, accept_volume_mounts=True)
    r = env_request({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "1,x"}, cfg, privileged=True)
    assert r.gpu and r.imex_channels == ()
    assert env_request({}, cfg, mounts=[dev_mount("0"), dev_mount("imex/3")]).imex_channels == ()
