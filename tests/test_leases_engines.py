"""``free`` requests through the engines, on the fake GPU machine: dockerd with ``--gpus
'"device=free:N"'`` (dockerd passes the id through to the hook unchanged) and with
``--runtime=nvidia -e NVIDIA_VISIBLE_DEVICES=free`` (the runtime shim leaves the choice to the
hook's lease), podman through hooks.d, containerd's CRI with the ``nvidia`` handler, and the
runtime shim in CDI mode (the lease taken at create, bound to the init by a hook). Each
container sees exactly its leased GPUs: ENXIO on its nodes, the others absent."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

from tests.fixtures import cri, dockerd, runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.test_engines_setup import CHECKS, cri_node, facts, machine, need, node, setup  # noqa: F401 (fixtures)
from tests.test_cdi_podman import spec_dir  # noqa: F401 (a fixture: `cdi generate` for this module's machine)
from tests.test_leases_e2e import ENXIO
from tests.test_runtime_engines import Shim, run_runc


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
    base, main, prefix = cri_node(node, tmp_path)
    results, res = cri.run(machine, base, main, f"{prefix / 'etc'}:{node / 'etc'}", [
        {"name": "two", "handler": "nvidia", "env": ["NVIDIA_VISIBLE_DEVICES=free:2"], "script": CHECKS},
        {"name": "one", "handler": "nvidia", "env": ["NVIDIA_VISIBLE_DEVICES=free"], "script": CHECKS},
    ])
    context = f"{res.stdout}\n{res.stderr}\n{cri.log(base)}"
    got = {r["name"]: (r["rc"], r["log"]) for r in results}
    assert len(got) == 2 and got["two"][0] == 0 and got["one"][0] == 0, context
    sees(got["two"][1], {0, 1})
    sees(got["one"][1], {0})      # two's lease ended with it


def test_runtime_shim_cdi_mode_leases_at_create_and_binds_at_start(machine, spec_dir, tmp_path):  # noqa: F811
    """mode = "cdi": the shim leases free:N at create (pending: no init yet), resolves the leased
    GPUs' CDI names, and its bind-lease hook ties the lease to the init, which ends it."""
    need("runc")
    shim = Shim(tmp_path / "shim", machine, mode="cdi", spec_dirs=[spec_dir])
    file = tmp_path / "shim/cache/leases.json"
    gate = tmp_path / "gate"
    gate.mkdir()

    def make(value, script):
        def edit(spec):
            spec["hooks"] = {"prestart": runtime.hook_entries(machine, our_hook=False)}   # the test's /proc/driver
            spec["mounts"].append({"destination": "/gate", "type": "bind", "source": str(gate),
                                   "options": ["rbind", "ro"]})
        return runtime.make_bundle(tmp_path, machine, [f"NVIDIA_VISIBLE_DEVICES={value}"], script, our_hook=False,
                                   extra_spec=edit)

    hold = CHECKS.replace('echo "DONE:ok"', 'while [ ! -e /gate/go ]; do sleep 0.05; done; echo "DONE:ok"')
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder = pool.submit(run_runc, machine, shim, make("free:1", hold))
        end = time.monotonic() + 60
        while not (file.exists() and json.loads(file.read_text())["leases"]
                   and json.loads(file.read_text())["leases"][0]["pid"]):
            assert time.monotonic() < end and not holder.done(), holder.result().stderr if holder.done() else ""
            time.sleep(0.05)
        (lease,) = json.loads(file.read_text())["leases"]
        assert lease["indexes"] == [0] and lease["pid"] > 0 and lease["start"] > 0   # bound to the init
        second = run_runc(machine, shim, make("free:1", CHECKS))
        assert second.returncode == 0, second.stderr
        sees(second.stdout, {1})
        third = run_runc(machine, shim, make("free:2", CHECKS))
        assert third.returncode != 0
        assert "free:2: no 2 GPU(s) free; GPU 0 held by container" in third.stderr, third.stderr
        (gate / "go").write_text("")
        first = holder.result()
        assert first.returncode == 0, first.stderr
        sees(first.stdout, {0})
