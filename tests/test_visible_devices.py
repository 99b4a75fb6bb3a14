"""One reading of NVIDIA_VISIBLE_DEVICES (nvcontainer/request/visible.py) through every path.

The same value must mean the same devices to the hook (its decision), the runtime shim (the CDI
names of its cdi and auto modes) and the device plugin (the value it writes must read back as
the devices it allocated). The expectations are REFERENCE §6.3 written out per case, not the
module's output; each row goes through every path, so a path with a reading of its own fails.
"""

from __future__ import annotations

import pytest

from nvcontainer.config.model import Config
from nvcontainer.deviceplugin import devices
from nvcontainer.deviceplugin.allocate import allocate
from nvcontainer.deviceplugin.settings import Settings
from nvcontainer.errors import NvcError
from nvcontainer.inventory.model import Gpu, Inventory, MigDevice
from nvcontainer.request import visible
from nvcontainer.request.decide import request_from_env
from nvcontainer.request.oci import Spec
from nvcontainer.runtime import cdinames

GPU0 = "GPU-4a3c5f0e-1b2d-4c3e-9f8a-0123456789ab"
MIG0 = "MIG-8f0a1b2c-3d4e-5f60-7182-93a4b5c6d7e8"
NOT_GPU = None          # the hook leaves the container alone, the shim asks for no CDI device
DRIVER_ONLY = "none"    # the hook injects the driver without a GPU; the shim asks for no CDI device

# value -> what the hook's decision is: NOT_GPU, DRIVER_ONLY, "all" or the ids
CASES = [
    ("all", "all"),
    ("ALL", "all"),
    ("All", "all"),
    (" all ", "all"),
    ("0,ALL", "all"),                 # an "all" among ids: the cli stops at it, without case
    ("ALL,none", DRIVER_ONLY),        # the first exact word decides (the hook compares exactly)
    ("none", DRIVER_ONLY),
    ("none,0", DRIVER_ONLY),
    ("0,none", DRIVER_ONLY),
    ("void", NOT_GPU),
    ("0,void", NOT_GPU),
    ("all,void", NOT_GPU),            # void anywhere
    ("", NOT_GPU),
    (" ", NOT_GPU),
    (" , ,", NOT_GPU),
    (" 0 , 1 ", ("0", "1")),
    ("1,0,1", ("1", "0")),            # request order, once each
    (f"{GPU0},{GPU0.lower()}", (GPU0, GPU0.lower())),
    (MIG0, (MIG0,)),
    ("0:1, 1:0", ("0:1", "1:0")),
    ("00000000:07:00.0", ("00000000:07:00.0",)),
]


def hook_devices(value):
    request = request_from_env({"NVIDIA_VISIBLE_DEVICES": value}, Config(), privileged=True)
    if not request.gpu:
        return NOT_GPU
    return DRIVER_ONLY if request.devices == () else request.devices


def shim_names(value, mode="cdi"):
    spec = Spec(env=(("PATH", "/bin"), ("NVIDIA_VISIBLE_DEVICES", value)), rootfs="/r", privileged=True)
    asked = cdinames.asked(spec, Config(mode=mode), mode)
    return None if asked is None else asked.names


@pytest.mark.parametrize("value, decision", CASES)
def test_the_hook_and_the_shim_read_the_same_devices(value, decision):
    assert visible.read(visible.split(value)) == decision
    assert hook_devices(value) == decision
    if decision in (NOT_GPU, DRIVER_ONLY):
        expected_cdi = None
    elif decision == "all":
        expected_cdi = ("nvidia.com/gpu=all",)
    else:
        expected_cdi = tuple(f"nvidia.com/gpu={d}" for d in decision)
    assert shim_names(value) == expected_cdi
    # auto mode: only CDI names are the shim's; the rest (ALL included) is left to the hook
    assert shim_names(value, "auto") is None


@pytest.mark.parametrize("value, names", [
    ("nvidia.com/gpu=0, nvidia.com/gpu=1", ("nvidia.com/gpu=0", "nvidia.com/gpu=1")),
    ("nvidia.com/gpu=all", ("nvidia.com/gpu=all",)),
    ("nvidia.com/gpu=0,void", None),
    ("nvidia.com/gpu=0,ALL", None),   # all GPUs, as the hook reads it: not a CDI-only request
])
def test_auto_mode_takes_only_a_list_of_cdi_names(value, names):
    assert shim_names(value, "auto") == names


@pytest.mark.parametrize("word", ["NONE", "Void"])
def test_words_other_than_all_are_exact_as_upstream(word):
    """``none`` and ``void`` are compared exactly, as NVIDIA's hook does: any other spelling is
    an id, refused by the hook and named as a CDI device (which then resolves to nothing)."""
    with pytest.raises(NvcError, match="unknown device"):
        hook_devices(word)
    assert shim_names(word) == (f"nvidia.com/gpu={word}",)


def test_swarm_variables_and_legacy_images_read_alike():
    env = {"DOCKER_RESOURCE_GPU": " ALL ", "NVIDIA_VISIBLE_DEVICES": "0"}
    config = Config(mode="cdi", swarm_resource=("DOCKER_RESOURCE_GPU",))
    assert request_from_env(env, config, privileged=True).devices == "all"
    spec = Spec(env=tuple(env.items()), rootfs="/r", privileged=True)
    assert cdinames.asked(spec, config, "cdi").names == ("nvidia.com/gpu=all",)
    legacy = {"CUDA_VERSION": "9.0.176"}
    assert request_from_env(legacy, Config(), privileged=True).devices == "all"
    assert cdinames.asked(Spec(env=tuple(legacy.items()), rootfs="/r", privileged=True), Config(mode="cdi"),
                          "cdi").names == ("nvidia.com/gpu=all",)


def _inventory():
    migs = tuple(MigDevice(parent=0, index=j, uuid=f"MIG-{j}1111111-2222-3333-4444-555555555555", gi=j + 1, ci=0,
                           gi_access="", ci_access="", name="NVIDIA A100 MIG 1g.10gb") for j in range(2))
    gpus = (Gpu(index=0, minor=0, model="NVIDIA A100", brand="Nvidia", uuid=GPU0.replace("4a", "00"),
                bus_id="00000000:07:00.0", arch="8.0", mig_capable=True, mig_enabled=True, migs=migs),
            Gpu(index=1, minor=1, model="NVIDIA A100", brand="Nvidia", uuid=GPU0, bus_id="00000000:08:00.0",
                arch="8.0", mig_capable=True, mig_enabled=False))
    return Inventory(root="/", driver_version="550.54.14", cuda_version="12.4", gpus=gpus)


@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
def test_what_the_device_plugin_writes_reads_back_as_what_it_allocated(id_strategy):
    """The plugin's ``envvar`` answer, read by the hook and by the shim's cdi mode, names the
    very devices its ``cdi-cri`` answer names, for whole GPUs and MIG devices alike."""
    settings = Settings(mig_strategy="mixed", device_id_strategy=id_strategy,
                        device_list_strategy=("envvar", "cdi-cri"))
    for resource in devices.advertise(_inventory(), settings):
        ids = [d.id for d in resource.devices]
        got = allocate(ids, resource, frozenset(), settings, "rid")
        value = dict(got.envs)["NVIDIA_VISIBLE_DEVICES"]
        tokens = tuple(d.unit.token(id_strategy) for d in resource.devices)
        assert hook_devices(value) == tokens
        assert shim_names(value) == got.cdi_devices == tuple(f"nvidia.com/gpu={t}" for t in tokens)


@pytest.mark.parametrize("ids", [(), ("all",), ("0", "ALL"), ("none",), ("void",), ("0,1",), (" 0",), ("0", "")])
def test_the_writer_refuses_what_would_not_read_back(ids):
    with pytest.raises(ValueError):
        visible.value(ids)
