"""A legacy (Mesos / nvidia-docker 1) image under runc: the label brings the driver volume.

The image carries ``com.nvidia.volumes.needed=nvidia_driver`` (as an annotation) and the agent's
``NVIDIA_VISIBLE_DEVICES``; each container must see the versioned volume read-only at
``/usr/local/nvidia``, its loader must find the driver there, and it must get exactly its GPU.
"""

from __future__ import annotations

import shutil

import pytest

from nvcontainer.apply import volume as volumes
from nvcontainer.inventory.build import build
from nvcontainer.request.decide import CAPABILITIES
from tests.fixtures import runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.runtime import ENXIO, parse_facts as parse

CHECKS = r"""
echo "NODES:$(ls /dev | grep -E '^nvidia[0-9]+$' | sort | tr '\n' ' ')"
echo "OPEN:$(cat /dev/nvidia$GPU 2>&1 | head -1)"
echo "VOL:$(ls /usr/local/nvidia 2>&1 | tr '\n' ' ')"
echo "CUDALINK:$(readlink /usr/local/nvidia/lib64/libcuda.so.1)"
echo "SMI:$(ls /usr/local/nvidia/bin | grep -c nvidia-smi)"
echo "LDCONFIG:$(ldconfig -p | grep -E 'libcuda\.so\.1 ' | sed 's/.*=> //')"
echo "PERFILE:$(ls /usr/lib/x86_64-linux-gnu | grep -c nvidia)"
grep ' /usr/local/nvidia ' /proc/self/mountinfo | sed 's/^/MOUNT:/'
echo "WRITE:$(touch /usr/local/nvidia/x 2>&1 | head -1)"
echo "DONE:ok"
"""
LABEL = {"com.nvidia.volumes.needed": "nvidia_driver"}


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


def test_label_driven_legacy_image_gets_the_volume_and_only_its_gpu(machine, tmp_path):
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    base = tmp_path / "volumes"
    base.mkdir(mode=0o700)
    inv = build(str(machine.root), proc=str(machine.proc))
    built = volumes.create(str(base), inv, frozenset(CAPABILITIES) - {"compat32", "display"}, compat32=False)
    config = tmp_path / "config.toml"
    config.write_text(f'driver-volume-dir = "{base}"\n')

    def annotate(spec):
        spec["annotations"] = dict(LABEL)

    for gpu in ("0", "1"):
        bundle = runtime.make_bundle(tmp_path, machine, [f"NVIDIA_VISIBLE_DEVICES={gpu}", f"GPU={gpu}"], CHECKS,
                                     hook_args=("--config", str(config)), extra_spec=annotate)
        res = runtime.run_container(machine, bundle)
        assert res.returncode == 0, res.stderr
        got = parse(res.stdout)
        assert got["DONE"] == ["ok"], res.stdout
        assert got["NODES"] == [f"nvidia{gpu}"]
        assert got["OPEN"] == [f"cat: can't open '/dev/nvidia{gpu}': {ENXIO}"]
        assert got["VOL"] == ["bin lib lib64"]
        assert got["CUDALINK"] == [f"libcuda.so.{inv.driver_version}"]
        assert got["SMI"] == ["1"]
        assert got["LDCONFIG"] == ["/usr/local/nvidia/lib64/libcuda.so.1"]
        assert got["PERFILE"] == ["0"]   # no per-file injection beside the volume
        (mount,) = got["MOUNT"]
        assert built.path.endswith(mount.split()[3])   # the version directory, not its parent
        assert {"ro", "nosuid", "nodev"} <= set(mount.split()[5].split(","))
        assert "Read-only file system" in got["WRITE"][0]

    # without the label the same image gets the driver file by file, and no volume
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=0", "GPU=0"], CHECKS,
                                 hook_args=("--config", str(config)))
    got = parse(runtime.run_container(machine, bundle).stdout)
    assert got["DONE"] == ["ok"] and "No such file" in got["VOL"][0] and got["PERFILE"] != ["0"]


def test_missing_volume_fails_the_container_with_one_line(machine, tmp_path):
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    config = tmp_path / "config.toml"
    config.write_text(f'driver-volume-dir = "{tmp_path}/none"\n')
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=0"], "echo DONE:ran",
                                 hook_args=("--config", str(config)),
                                 extra_spec=lambda spec: spec.__setitem__("annotations", dict(LABEL)))
    res = runtime.run_container(machine, bundle)
    assert res.returncode != 0 and "DONE:ran" not in res.stdout
    assert f"{tmp_path}/none/nvidia_" in res.stderr
