"""``nvcontainer ps`` names a container no engine and no known runtime state names (issue 35):
plain runc run with its own ``--root`` state directory, an ID that is not 64 hex digits and a
Mesos-like cgroup path. The GPU's holder is named by what the kernel shows, its cgroup's last
component and its init's command line, bounded and escaped; real runc on the fake machine,
cgroup v1 and v2."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from tests.fixtures import runtime
from tests.fixtures.fakegpu.runner import fake_proc_command
from tests.fixtures.fakegpu.spec import FakeSpec
from tests.test_ps_e2e import need_tools

DRIVER = r"""
import json, os, subprocess, sys
root, bundle, name, cfg, machine_root = sys.argv[1:6]
run = ["runc", "--root", root]
err = open(os.path.join(bundle, "..", "runc.err"), "w+")   # a file: the detached init keeps it open
res = subprocess.run([*run, "run", "-d", "--bundle", bundle, name], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=err, timeout=120)
if res.returncode:
    err.seek(0)
    sys.exit("runc run failed: " + err.read())
try:
    pid = json.loads(subprocess.run([*run, "state", name], capture_output=True, check=True).stdout)["pid"]
    def ps(*args):
        r = subprocess.run([sys.executable, "-I", "-m", "nvcontainer", "--root", machine_root, "--config", cfg, "ps", *args],
                           capture_output=True, text=True, env={"PYTHONPATH": sys.argv[6], "PATH": os.environ["PATH"]})
        return {"rc": r.returncode, "out": r.stdout, "err": r.stderr}
    print(json.dumps({"pid": pid, "json": ps("--json"), "text": ps()}))
finally:
    subprocess.run([*run, "delete", "-f", name], capture_output=True)
"""


@pytest.fixture(scope="module")
def machine(private_machine):
    return private_machine(FakeSpec(gpus=2))


@pytest.mark.parametrize("cgroup2", [False, True], ids=["cgroup-v1", "cgroup-v2"])
def test_a_container_nothing_names_is_named_by_its_cgroup_and_command(machine, tmp_path, cgroup2):
    need_tools()
    executor = str(uuid.uuid4())   # Mesos names a container's cgroup by a UUID
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[nvcontainer]\ncache-dir = "{tmp_path / "run"}"\n')
    script = "exec sh -c 'sleep 600; true' 'x\x1b[31mred'"   # the init's command line holds a terminal escape
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=1"], script,
                                 hook_args=("--config", str(cfg), "--socket", ""),
                                 extra_spec=lambda s: s["linux"].update(cgroupsPath=f"/mesos/{executor}"))
    state = tmp_path / "own-root"
    argv = [sys.executable, "-I", "-c", DRIVER, str(state), str(bundle), "hand-run.1", str(cfg), str(machine.root),
            str(runtime.REPO)]
    if cgroup2:
        argv = ["sh", "-c", runtime.CGROUP2_WORLD, "sh", *argv]
    res = subprocess.run(fake_proc_command(machine, argv), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["json"]["rc"] == 0, got["json"]["err"]
    view = json.loads(got["json"]["out"])["gpus"]
    (mine,) = [c for c in view[1]["containers"] if c["pid"] == got["pid"]]
    assert (mine["id"], mine["name"], mine["engine"]) == (executor, "", "")
    assert mine["command"] == "sh -c sleep 600; true x\\x1b[31mred"   # escaped, not a raw escape
    assert {"cgroup", "mount"} <= set(mine["evidence"])
    text = got["text"]["out"]
    assert executor in text and "[sh -c sleep 600; true x\\x1b[31mred]" in text and "\x1b" not in text
