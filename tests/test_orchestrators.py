"""Orchestrators' ways of handing a container its GPUs, played with real runtimes on the fake
GPU machine (two GPUs): the Kubernetes NVIDIA device plugin's three strategies (envvar,
volume-mounts, CDI annotations) and a Mesos-style agent restricted to GPU 1 by the node's
``allowed-devices``.

Pass signals as in test_e2e_runtimes: with no driver behind the fake nodes, opening an injected
node the device cgroup allows gives ENXIO, and a node made with mknod that it denies gives EPERM.
Every container reports which nvidia nodes it has, what each open gives, and which driver
libraries its linker cache knows.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from tests.fixtures import runtime
from tests.fixtures.fakegpu import FakeSpec, run_in_fake_proc
from tests.test_e2e_runtimes import ENXIO, EPERM, parse

DEVICES_ROOT = "/var/run/nvidia-container-devices"
LIBCUDA = "usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14"
CHECKS = r"""
echo "NODES:$(ls /dev | grep -E '^nvidia[0-9]+$' | sort | tr '\n' ' ')"
for n in /dev/nvidia0 /dev/nvidia1; do echo "OPEN:$n:$(cat $n 2>&1 | head -1)"; done
for m in 0 1; do rm -f /tmp/n$m; mknod /tmp/n$m c 195 $m && echo "CGROUP:$m:$(cat /tmp/n$m 2>&1 | head -1)"; done
echo "CTL:$(test -c /dev/nvidiactl && echo yes)"
echo "LDCONFIG:$(ldconfig -p | grep -oE 'lib(cuda|nvidia-ml)\.so\.1 .*x86-64' | cut -d' ' -f1 | sort | tr '\n' ' ')"
echo "DONE:ok"
"""


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed")
    return fake_machine_factory(FakeSpec(gpus=2))


def config(tmp_path, text: str) -> tuple[str, str]:
    path = tmp_path / f"config-{abs(hash(text))}.toml"
    path.write_text(text)
    return ("--config", str(path))


def run(machine, tmp_path, env, *, hook_args=(), extra_spec=None, script=CHECKS):
    bundle = runtime.make_bundle(tmp_path, machine, env, script, hook_args=hook_args, extra_spec=extra_spec)
    return bundle, runtime.run_container(machine, bundle)


def assert_sees_only(res, gpu: int):
    """Exactly GPU ``gpu``: its node alone, allowed by the cgroup; the other GPU's node absent
    and denied; the control node and the driver libraries present."""
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["DONE"] == ["ok"], res.stdout
    other = 1 - gpu
    assert got["NODES"] == [f"nvidia{gpu}"]
    assert got["OPEN"] == sorted([f"/dev/nvidia{gpu}:cat: can't open '/dev/nvidia{gpu}': {ENXIO}",
                                  f"/dev/nvidia{other}:cat: can't open '/dev/nvidia{other}': No such file or directory"])
    assert got["CGROUP"] == sorted([f"{gpu}:cat: can't open '/tmp/n{gpu}': {ENXIO}",
                                    f"{other}:cat: can't open '/tmp/n{other}': {EPERM}"])
    assert got["CTL"] == ["yes"]
    assert got["LDCONFIG"] == ["libcuda.so.1 libnvidia-ml.so.1"]


# --- Kubernetes device plugin ---

def test_k8s_envvar_strategy(machine, tmp_path):
    uuid1 = machine.description()["gpus"][1]["uuid"]
    _, res = run(machine, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={uuid1}"])
    assert_sees_only(res, 1)


def test_k8s_volume_mounts_strategy(machine, tmp_path):
    """The plugin mounts /dev/null at DEVICES_ROOT/<uuid>; the image's own ``all`` is ignored
    because the node does not accept the variable from unprivileged containers."""
    uuid0 = machine.description()["gpus"][0]["uuid"]

    def mount_device(spec):
        spec["mounts"].append({"destination": f"{DEVICES_ROOT}/{uuid0}", "type": "bind", "source": "/dev/null",
                               "options": ["rbind", "ro"]})

    args = config(tmp_path, "accept-nvidia-visible-devices-as-volume-mounts = true\n"
                            "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n")
    _, res = run(machine, tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"], hook_args=args, extra_spec=mount_device)
    assert_sees_only(res, 0)


def test_k8s_cdi_annotation_is_left_to_the_engine(machine, tmp_path):
    """The hook does not act on ``cdi.k8s.io/`` annotations: the engine resolves them from its
    CDI specs (next test). With the spec's ``NVIDIA_VISIBLE_DEVICES=void`` nothing is injected."""
    uuid1 = machine.description()["gpus"][1]["uuid"]

    def annotate(spec):
        spec.setdefault("annotations", {})["cdi.k8s.io/nvidia-device-plugin_" + uuid1] = f"nvidia.com/gpu={uuid1}"

    bundle, res = run(machine, tmp_path, ["NVIDIA_VISIBLE_DEVICES=void"], extra_spec=annotate)
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["NODES"] == [""] and got["CTL"] == [""] and got["LDCONFIG"] == [""]
    assert not (bundle / "rootfs" / LIBCUDA).exists()


def test_k8s_cdi_device_resolved_by_podman(machine, tmp_path):
    """What a CDI-enabled engine does with ``nvidia.com/gpu=<uuid>``: podman reads the spec that
    ``nvcontainer cdi generate`` wrote and injects exactly that GPU."""
    if shutil.which("podman") is None or shutil.which("crun") is None:
        pytest.skip("podman and crun are needed")
    from tests.test_cdi_podman import run_podman_cdi

    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    gen = run_in_fake_proc(machine, [sys.executable, "-m", "nvcontainer", "--root", str(machine.root), "cdi",
                                     "generate", "--output", str(spec_dir / "nvidia.yaml")],
                           capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    uuid1 = machine.description()["gpus"][1]["uuid"]
    res = run_podman_cdi(machine, spec_dir, tmp_path, f"nvidia.com/gpu={uuid1}", CHECKS)
    assert_sees_only(res, 1)


# --- Mesos-style agent restricted to GPU 1 (--nvidia_gpu_devices=1) ---

@pytest.fixture
def agent(tmp_path):
    return config(tmp_path, 'allowed-devices = ["1"]\n')


def test_agent_refuses_a_request_beyond_its_gpus(machine, tmp_path, agent):
    bundle, res = run(machine, tmp_path, ["NVIDIA_VISIBLE_DEVICES=0,1"], hook_args=agent, script="echo STARTED")
    assert res.returncode != 0
    assert "STARTED" not in res.stdout
    assert "nvcontainer-hook: device error: 0: not allowed on this node (allowed-devices)" in res.stderr
    assert not (bundle / "rootfs" / LIBCUDA).exists()
    assert not (bundle / "rootfs/dev/nvidia1").exists()


@pytest.mark.parametrize("request_", ["1", "all"])
def test_agent_grants_its_gpu(machine, tmp_path, agent, request_):
    _, res = run(machine, tmp_path, [f"NVIDIA_VISIBLE_DEVICES={request_}"], hook_args=agent)
    assert_sees_only(res, 1)
