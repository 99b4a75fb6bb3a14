"""A claim prepared by ``nvcontainer dra-driver`` runs containers: the CDI names the plugin
answered the fake kubelet with, handed to podman (``--device``) and to containerd's CRI, give a
container exactly the claim's GPU on the fake machine, and two pods of a shared claim both get it.

Pass signals as in test_e2e_runtimes: with no driver behind the fake nodes, opening an injected
node gives ENXIO; a node that was not injected is absent.

containerd 1.6 (Debian 12's) has no CDI in its CRI: no ``enable_cdi``, and it ignores
``ContainerConfig.CDI_devices`` (field 17), the only way kubelets 1.31 and later hand DRA's CDI
names to a runtime (1.26-1.30 also sent ``cdi.k8s.io/`` annotations). Both are tested here as
they are: the field alone gives the container no GPU under 1.6; the same names as
``cdi.k8s.io/`` annotations through the ``nvidia`` runtime handler (the runtime shim resolves
them, as NVIDIA's runtime does for CDI-less engines) give it exactly the claim's GPU.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fixtures import cri, runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.kubeapi import FakeApiServer
from tests.test_cdi_podman import CHECKS, run_podman_cdi
from tests.test_dra_driver import Node, driver, put
from tests.test_e2e_runtimes import ENXIO, parse
from tests.test_engines_setup import CHECKS as CRI_CHECKS
from tests.test_engines_setup import cri_node, facts, need, node   # noqa: F401 (node: a fixture)

HOOK = Path(sys.executable).parent / "nvcontainer-hook"


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


@pytest.fixture(scope="module")
def prepared(machine, tmp_path_factory):
    """Claims prepared through the plugin: "one" (GPU 1) and "shared" (GPU 0), the CDI directory
    and the CDI names the kubelet got."""
    base = tmp_path_factory.mktemp("dra")
    # the spec's hooks: our CDI hook after a /proc/driver/nvidia, as a real driver's procfs has
    hook = base / "cdi-hook"
    hook.write_text(runtime.driver_wrapper(HOOK))
    hook.chmod(0o755)
    node = Node(base, hook=str(hook))
    server = FakeApiServer()
    server.put_node("node-a")
    try:
        one, shared = put(server, "one", ["gpu-1"]), put(server, "shared", ["gpu-0"])
        with driver(machine, node, server) as (kubelet, _):
            got = kubelet.prepare(one, shared)
    finally:
        server.stop()
    names = {c[1]: [n for _, ids in got[c[2]][1] for n in ids] for c in (one, shared)}
    assert all(len(v) == 1 for v in names.values()), got
    return node.cdi, names


@pytest.mark.parametrize("runtime_name", ["crun", "runc"])
def test_podman_gets_exactly_the_claims_gpu(machine, prepared, tmp_path, runtime_name):
    need("podman", runtime_name)
    cdi, names = prepared
    res = run_podman_cdi(machine, cdi, tmp_path, names["one"][0], CHECKS, runtime_name)
    assert res.returncode == 0, res.stderr
    got = parse(res.stdout)
    assert got["DONE"] == ["ok"], res.stdout
    assert got["OPEN"] == ["/dev/nvidia0:cat: can't open '/dev/nvidia0': No such file or directory",
                           f"/dev/nvidia1:cat: can't open '/dev/nvidia1': {ENXIO}"]
    assert got["LDCONFIG"] == ["libcuda.so.1 libnvidia-ml.so.1"], res.stdout


def test_two_pods_sharing_a_claim_both_get_it(machine, prepared, tmp_path):
    need("podman", "crun")
    cdi, names = prepared
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda i: run_podman_cdi(machine, cdi, tmp_path / f"pod{i}", names["shared"][0], CHECKS),
                             range(2)))
    for res in runs:
        assert res.returncode == 0, res.stderr
        assert parse(res.stdout)["OPEN"] == [f"/dev/nvidia0:cat: can't open '/dev/nvidia0': {ENXIO}",
                                             "/dev/nvidia1:cat: can't open '/dev/nvidia1': No such file or directory"]


def test_containerd_16_cri(machine, prepared, node, tmp_path):   # noqa: F811
    need("containerd", "ctr", "runc")
    cdi, names = prepared
    base, main, prefix = cri_node(node, tmp_path)
    # containerd passes a container's annotations to its OCI spec only where the handler allows
    # them (container_annotations); nvidia-ctk's CDI setup allows cdi.k8s.io/*, ours does not yet
    dropin = prefix / "etc/containerd/conf.d/99-nvidia.toml"
    header = '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
    assert header in dropin.read_text(), dropin.read_text()
    dropin.write_text(dropin.read_text().replace(header, header + 'container_annotations = ["cdi.k8s.io/*"]\n'))
    etc = tmp_path / "etc"
    (etc / "nvcontainer").mkdir(parents=True)
    (etc / "nvcontainer/config.toml").write_text((node / "etc/nvcontainer/config.toml").read_text()
                                                 + f'[nvidia-container-runtime.modes.cdi]\nspec-dirs = ["{cdi}"]\n')
    annotation = {f"cdi.k8s.io/gpu.nvidia.com_{names['one'][0].split('=')[1]}": names["one"][0]}
    results, res = cri.run(machine, base, main, f"{prefix / 'etc'}:{etc}", [
        {"name": "field", "handler": "", "env": [], "script": CRI_CHECKS, "cdi": names["one"]},
        {"name": "annotated", "handler": "nvidia", "env": [], "script": CRI_CHECKS, "annotations": annotation},
        {"name": "shared1", "handler": "nvidia", "env": [], "script": CRI_CHECKS,
         "annotations": {"cdi.k8s.io/claim": names["shared"][0]}},
        {"name": "shared2", "handler": "nvidia", "env": [], "script": CRI_CHECKS,
         "annotations": {"cdi.k8s.io/claim": names["shared"][0]}},
    ])
    context = f"{res.stdout}\n{res.stderr}\n{cri.log(base)}"
    got = {r["name"]: (r["rc"], facts(r["log"])) for r in results}
    assert len(got) == 4, context
    assert got["field"][0] == 0 and got["field"][1]["OPEN0"] == ["absent"] and got["field"][1]["OPEN1"] == ["absent"]
    rc, out = got["annotated"]
    assert rc == 0 and out["OPEN0"] == ["absent"] and out["OPEN1"] == [f"cat: can't open '/dev/nvidia1': {ENXIO}"], \
        context
    assert sorted(set(out["LDCONFIG"][0].split())) == ["libcuda.so.1", "libnvidia-ml.so.1"], context   # 64 and 32-bit
    for pod in ("shared1", "shared2"):
        rc, out = got[pod]
        assert rc == 0, context
        assert out["OPEN0"] == [f"cat: can't open '/dev/nvidia0': {ENXIO}"] and out["OPEN1"] == ["absent"], context
