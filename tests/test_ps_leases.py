"""Stale leases: a leased container that ended while no server watched it leaves its lease in
the file; ``doctor`` warns about it and ``ps`` lists it as gone. Pure verdicts on made-up facts,
then for real under runc on the fake machine."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from nvcontainer.doctor.checks import OK, WARN, Facts, evaluate
from nvcontainer.ps.model import LeaseView
from tests.fixtures import runtime
from tests.fixtures.fakegpu import FakeSpec, run_in_fake_proc

CLI = [sys.executable, "-I", "-m", "nvcontainer"]


def leases_check(**facts):
    (check,) = [c for c in evaluate(Facts(**facts)) if c.name == "leases"]
    return check


def test_lease_verdicts():
    live = LeaseView(container="a" * 64, pid=10, gpus=("GPU-0",))
    dead = LeaseView(container="b" * 64, pid=20, gpus=("GPU-1", "GPU-2"), alive=False)
    assert leases_check().verdict == OK
    assert leases_check(leases=(live,)).detail == "1 lease(s), each held by a running container"
    stale = leases_check(leases=(live, dead))
    assert stale.verdict == WARN
    assert stale.detail == "1 of 2 lease(s) stale, their container gone: container bbbbbbbbbbbb (pid 20) on GPU-1, GPU-2"
    assert "nvcontainer serve" in stale.fix
    bad = leases_check(lease_error="/run/nvcontainer/leases.json: truncated or not JSON (3 bytes)")
    assert bad.verdict == WARN and "truncated" in bad.detail


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


def test_a_container_gone_without_the_server_leaves_a_stale_lease(machine, tmp_path):
    if not all(map(shutil.which, ("runc", "busybox", "unshare"))):
        pytest.skip("needs runc, busybox and unshare")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[nvcontainer]\ncache-dir = "{tmp_path / "run"}"\n')
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=free"], "ls /dev",
                                 hook_args=("--config", str(cfg), "--socket", ""))
    res = runtime.run_container(machine, bundle)
    assert res.returncode == 0, res.stderr
    (lease,) = json.loads((tmp_path / "run/leases.json").read_text())["leases"]
    assert lease["container"] == bundle.name

    def cli(*args):
        return run_in_fake_proc(machine, [*CLI, "--root", str(machine.root), "--config", str(cfg), *args],
                                capture_output=True, text=True, timeout=120)

    report = {c["name"]: c for c in json.loads(cli("doctor", "--json", "--spec-dir", str(tmp_path)).stdout)}
    assert report["leases"]["verdict"] == WARN
    assert f"container {bundle.name[:12]} (pid {lease['pid']}) on {lease['gpus'][0]}" in report["leases"]["detail"]

    ps = cli("ps", "--json")
    assert ps.returncode == 0, ps.stderr
    view = json.loads(ps.stdout)["gpus"]
    (entry,) = [c for c in view[lease["indexes"][0]]["containers"] if c["id"] == bundle.name]
    assert (entry["id"], entry["pid"], entry["how"], entry["running"]) == (bundle.name, lease["pid"], "lease", False)
    assert "lease (container gone)" in cli("ps").stdout

    (tmp_path / "run/leases.json").write_text("{}")   # a file that cannot be trusted: ps still answers
    ps = cli("ps")
    assert ps.returncode == 0 and ps.stderr.startswith("nvcontainer: warning: leases not shown:")
    assert ps.stderr.count("\n") == 1


def test_a_pending_lease_that_never_started_is_named_so():
    never = LeaseView(container="c" * 64, pid=0, gpus=("GPU-0",), alive=False)
    assert "container cccccccccccc (its init never started) on GPU-0" in leases_check(leases=(never,)).detail
