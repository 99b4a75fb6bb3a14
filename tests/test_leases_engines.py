"""``free`` requests through the engines, on the fake GPU machine: dockerd with ``--gpus
'"device=free:N"'`` (dockerd passes the id through to the hook unchanged) and with
``--runtime=nvidia -e NVIDIA_VISIBLE_DEVICES=free`` (the runtime shim leaves the choice to the
hook's lease), podman through hooks.d, and containerd's CRI with the ``nvidia`` handler. Each
container sees exactly its leased GPUs: ENXIO on its nodes, the others absent."""

from __future__ import annotations

import pytest

from tests.fixtures import cri, dockerd, runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.test_engines_setup import CHECKS, facts, machine, need, node, setup  # noqa: F401 (fixtures)
from tests.test_leases_e2e import ENXIO


def sees(out: str, gpus: set[int]) -> None:
    got = facts(out)
    assert got.get("DONE") == ["ok"], out
    for n in (0, 1):
        want = f"cat: can't open '/dev/nvidia{n}': {ENXIO}" if n in gpus else "absent"
        assert got[f"OPEN{n}"] == [want], out


def test_dockerd_gpus_and_runtime_take_leases(machine, node, tmp_path):
    need("dockerd", "docker", "runc")
    prefix = tmp_path / "root"
    setup(node, prefix, "docker", "--engine-version", "20.10.24")
    base = dockerd.prepare(tmp_path / "d")
    run = ["run", "--rm", "--network", "none"]
    results, res = dockerd.run(machine, base, prefix / "etc/docker/daemon.json", [
        # a holder, detached: GPU 0
        ["run", "-d", "--name", "holder", "--network", "none", "--runtime=nvidia", "-e",
         "NVIDIA_VISIBLE_DEVICES=free", dockerd.IMAGE, "sleep", "120"],
        [*run, "--gpus", '"device=free:2"', dockerd.IMAGE, "sh", "-c", CHECKS],       # only one free
        [*run, "--gpus", '"device=free:1"', dockerd.IMAGE, "sh", "-c", CHECKS],       # GPU 1
        [*run, "--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=free", dockerd.IMAGE, "sh", "-c", CHECKS],
        ["rm", "-f", "holder"],
        [*run, "--gpus", '"device=free:2"', dockerd.IMAGE, "sh", "-c", CHECKS],       # both, the holder gone
    ], etc=node / "etc", local_bin=prefix / "usr/local/bin")
    context = f"{res.stderr}\n{dockerd.log(base)}"
    assert len(results) == 6, context
    assert results[0][0] == 0, context
    assert results[1][0] != 0 and "free:2: no 2 GPU(s) free; GPU 0 held by container" in results[1][1] + res.stderr, \
        f"{results[1]}\n{context}"
    assert results[2][0] == 0, context
    sees(results[2][1], {1})
    assert results[3][0] == 0, context
    sees(results[3][1], {1})
    assert results[5][0] == 0, context
    sees(results[5][1], {0, 1})


def test_podman_hooks_dir_free(machine, tmp_path):
    need("podman", "crun")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[nvcontainer]\ncache-dir = "{tmp_path / "run"}"\n')
    res = runtime.run_podman(machine, tmp_path, ["NVIDIA_VISIBLE_DEVICES=free"], CHECKS,
                             hook_args=("--config", str(cfg), "--socket", ""))
    assert res.returncode == 0, res.stderr
    sees(res.stdout, {0})


def test_containerd_cri_free(machine, node, tmp_path):
    need("containerd", "ctr", "runc")
    pytest.importorskip("grpc")
    base = cri.prepare(tmp_path / "c")
    prefix = tmp_path / "root"
    main = prefix / "etc/containerd/config.toml"
    main.parent.mkdir(parents=True)
    main.write_text((base / "config.toml").read_text())
    setup(node, prefix, "containerd", "--engine-version", "1.6.20")
    results, res = cri.run(machine, base, main, f"{prefix / 'etc'}:{node / 'etc'}", [
        {"name": "two", "handler": "nvidia", "env": ["NVIDIA_VISIBLE_DEVICES=free:2"], "script": CHECKS},
        {"name": "one", "handler": "nvidia", "env": ["NVIDIA_VISIBLE_DEVICES=free"], "script": CHECKS},
    ])
    context = f"{res.stdout}\n{res.stderr}\n{cri.log(base)}"
    got = {r["name"]: (r["rc"], r["log"]) for r in results}
    assert len(got) == 2 and got["two"][0] == 0 and got["one"][0] == 0, context
    sees(got["two"][1], {0, 1})
    sees(got["one"][1], {0})      # two's lease ended with it
