"""The device plugin's answers, applied the way the kubelet and the runtime apply them, on the
2-GPU fake machine: the plugin allocates over gRPC, then

* ``envvar``: the response's environment goes into a runc bundle whose config.json registers
  ``nvcontainer-hook`` as its prestart hook;
* ``volume-mounts``: the response's ``/dev/null`` mounts (and environment) go into the bundle,
  with the node configured to accept them and to ignore the variable from unprivileged images;
* ``cdi-annotations`` and ``cdi-cri``: the CDI names it returns are handed to ``podman run
  --device`` against the spec ``nvcontainer cdi generate`` wrote;

and the container must see exactly the allocated GPU: its node opens with ENXIO (the cgroup
allows it, no driver is behind it), the other GPU's node is absent and denied (test_orchestrators'
``assert_sees_only``)."""

from __future__ import annotations

import shutil

import pytest

from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb
from tests.fixtures import runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.test_deviceplugin_server import serving
from tests.test_orchestrators import CHECKS, assert_sees_only, config, run


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    return fake_machine_factory(FakeSpec(gpus=2))


def allocated(machine, tmp_path, table: dict, ids) -> pb.ContainerAllocateResponse:
    """What the plugin answers the kubelet for ``ids`` under ``table``."""
    (tmp_path / "plugin").mkdir()
    with serving(machine, tmp_path / "plugin", table) as (kubelet, _):
        (reg,) = kubelet.wait_registered(1)
        got = kubelet.plugin(reg.endpoint).Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=ids)]))
    (response,) = got.container_responses
    return response


def uuids(machine) -> list[str]:
    return [g["uuid"] for g in machine.description()["gpus"]]


@pytest.mark.parametrize("gpu", [0, 1])
def test_envvar_into_a_runc_bundle_with_the_hook(machine, tmp_path, gpu):
    response = allocated(machine, tmp_path, {"device-list-strategy": ["envvar"]}, [uuids(machine)[gpu]])
    assert not response.mounts and not response.cdi_devices
    _, res = run(machine, tmp_path, [f"{k}={v}" for k, v in response.envs.items()])
    assert_sees_only(res, gpu)


def test_envvar_with_replicas_and_index_ids(machine, tmp_path):
    table = {"device-list-strategy": ["envvar"], "replicas": 3, "device-id-strategy": "index"}
    response = allocated(machine, tmp_path, table, ["1::2", "1::0"])
    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": "1"}        # GPU 1, once
    _, res = run(machine, tmp_path, [f"{k}={v}" for k, v in response.envs.items()])
    assert_sees_only(res, 1)


def test_volume_mounts_into_a_runc_bundle(machine, tmp_path):
    response = allocated(machine, tmp_path, {"device-list-strategy": ["volume-mounts"]}, [uuids(machine)[0]])
    assert len(response.mounts) == 1

    def apply(spec):
        for m in response.mounts:
            spec["mounts"].append({"destination": m.container_path, "type": "bind", "source": m.host_path,
                                   "options": ["rbind", "ro" if m.read_only else "rw"]})

    args = config(tmp_path, "accept-nvidia-visible-devices-as-volume-mounts = true\n"
                            "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n")
    # the image's own NVIDIA_VISIBLE_DEVICES=all comes first; the kubelet's value replaces it
    env = ["NVIDIA_VISIBLE_DEVICES=all", *(f"{k}={v}" for k, v in response.envs.items())]
    _, res = run(machine, tmp_path, env, hook_args=args, extra_spec=apply)
    assert_sees_only(res, 0)


@pytest.fixture(scope="module")
def spec_dir(machine, tmp_path_factory):
    if shutil.which("podman") is None or shutil.which("crun") is None:
        pytest.skip("podman and crun are needed")
    return runtime.cdi_spec_dir(machine, tmp_path_factory.mktemp("cdi"))


@pytest.mark.parametrize("strategy, ids", [("cdi-annotations", "uuid"), ("cdi-cri", "uuid"), ("cdi-cri", "index")])
def test_cdi_names_through_podman(machine, spec_dir, tmp_path, strategy, ids):
    from tests.test_cdi_podman import run_podman_cdi

    wanted = uuids(machine)[1] if ids == "uuid" else "1"
    response = allocated(machine, tmp_path, {"device-list-strategy": [strategy], "device-id-strategy": ids}, [wanted])
    if strategy == "cdi-annotations":
        ((key, value),) = response.annotations.items()
        assert key.startswith("cdi.k8s.io/")
        names = value.split(",")
    else:
        names = [d.name for d in response.cdi_devices]
    assert names == [f"nvidia.com/gpu={wanted}"] and not response.envs
    res = run_podman_cdi(machine, spec_dir, tmp_path, names[0], CHECKS)
    assert_sees_only(res, 1)
