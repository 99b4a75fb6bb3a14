"""DRA device names (nvcontainer/dra/names.py) from the inventory of fake machines, and back.

The expected names are NVIDIA's k8s-dra-driver-gpu's, written by hand from the fake machines'
specs (tests/fixtures/fakegpu/spec.py): GPU ``gpu-<minor>``; MIG (25.12 and later)
``gpu-<minor>-mig-<profile without dots>-<GI profile id>-<placement start>``."""

from __future__ import annotations

import pytest

from nvcontainer.dra import names
from nvcontainer.errors import NvcError
from nvcontainer.inventory.model import Gpu, Inventory, MigDevice
from tests.fixtures.fakegpu import FakeSpec, inventory_of



def test_two_gpus(fake_machine):
    inv = inventory_of(fake_machine)
    assert [n.name for n in names.devices(inv)] == ["gpu-0", "gpu-1"]
    assert names.lookup(inv, "gpu-1").gpu.uuid == inv.gpus[1].uuid
    assert names.lookup(inv, "gpu-1").mig is None


def test_minors_not_indexes(fake_machine_factory):
    inv = inventory_of(fake_machine_factory(FakeSpec(gpus=3, minors=(4, 2, 9))))
    assert [n.name for n in names.devices(inv)] == ["gpu-2", "gpu-4", "gpu-9"]
    assert names.lookup(inv, "gpu-9").gpu.index == 2


def test_mig_machine(fake_machine_factory):
    # GPU 0 (A100 80GB, minor 0) in MIG mode: 3 devices cycling 1g.10gb (id 19, 1 slice),
    # 2g.20gb (id 14, 2 slices); placed 0, then 2 (even start), then 4. GPU 1 (T4) whole.
    spec = FakeSpec(gpus=2, mig=True, mig_devices=3, mig_profiles=("1g.10gb", "2g.20gb"))
    inv = inventory_of(fake_machine_factory(spec))
    assert [n.name for n in names.devices(inv)] == [
        "gpu-0-mig-1g10gb-19-0", "gpu-0-mig-2g20gb-14-2", "gpu-0-mig-1g10gb-19-4", "gpu-1"]
    named = names.lookup(inv, "gpu-0-mig-2g20gb-14-2")
    assert named.mig.uuid == inv.gpus[0].migs[1].uuid and named.kind == "mig"
    assert named.uuid == named.mig.uuid
    with pytest.raises(NvcError, match="gpu-0: this node has no such device"):
        names.lookup(inv, "gpu-0")                     # a GPU in MIG mode is offered by its MIG devices


def test_plus_me_profile_label():
    assert names.profile_label("1g.10gb+me") == "1g10gb-me"
    assert names.profile_label("7g.80gb") == "7g80gb"


def test_older_mig_names_are_understood():
    # 25.3 / 25.8: gpu-<minor>-mig-<profile id>-<start>-<size>
    assert names.parse("gpu-3-mig-19-4-1") == (3, 19, 4)
    assert names.parse("gpu-3-mig-1g10gb-me-20-4") == (3, 20, 4)
    assert names.parse("gpu-12") == (12, None, None)


@pytest.mark.parametrize("bad", ["", "gpu", "gpu-", "gpu-x", "GPU-0", "gpu-0-mig-", "mig-0", "gpu-0\n", "gpu-" + "9" * 200])
def test_bad_names_are_one_line(bad):
    with pytest.raises(NvcError) as err:
        names.parse(bad)
    assert "\n" not in err.value.detail and "not a gpu.nvidia.com device name" in err.value.detail


def test_mig_without_geometry_is_refused():
    mig = MigDevice(parent=0, index=0, uuid="MIG-x", gi=1, ci=0, gi_access="", ci_access="", name="A100 MIG 1g.10gb")
    gpu = Gpu(index=0, minor=0, model="A100", brand="Nvidia", uuid="GPU-x", bus_id="00000000:07:00.0", arch="8.0",
              mig_capable=True, mig_enabled=True, migs=(mig,))
    with pytest.raises(NvcError, match="profile and placement are not known"):
        names.devices(Inventory(root="/", driver_version="550.54.14", cuda_version="12.4", gpus=(gpu,)))
