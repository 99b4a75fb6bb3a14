"""``configure --dry-run`` and ``nvcontainer-hook --dry-run prestart`` as users run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.fixtures.fakegpu.runner import run_in_fake_proc

CLI = [sys.executable, "-m", "nvcontainer"]
HOOK = [sys.executable, "-m", "nvcontainer.hook"]


@pytest.fixture
def bundle(tmp_path):
    rootfs = tmp_path / "bundle/rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc/debian_version").write_text("12\n")
    return tmp_path / "bundle"


@pytest.fixture
def pid():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def write_config(bundle, env, caps=("CAP_CHOWN",)):
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["sh"], "env": ["PATH=/bin", *env], "capabilities": {"bounding": list(caps)}}}
    (bundle / "config.json").write_text(json.dumps(spec))


def hook(machine, bundle, pid, *args, state=None):
    state = state if state is not None else json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating",
                                                       "pid": pid, "bundle": str(bundle)})
    return run_in_fake_proc(machine, [*HOOK, "--root", str(machine.root), *args], input=state,
                            capture_output=True, text=True, timeout=60)


def test_hook_dry_run_plan(fake_machine, bundle, pid):
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=utility"])
    res = hook(fake_machine, bundle, pid, "--dry-run", "prestart")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["gpu"] is True
    assert plan["rootfs"] == str(bundle / "rootfs")
    assert plan["pid"] == pid
    assert [d["path"] for d in plan["devices"]] == ["/dev/nvidiactl", "/dev/nvidia1"]
    assert plan["cgroup_rules"] == ["c 195:255 rw", "c 195:1 rw"]
    assert plan["ldconfig"]["directories"] == ["/usr/lib/x86_64-linux-gnu"]
    assert all(not m["target"].endswith(".so.550.54.14") or "libnvidia-ml" in m["target"] or "libnvidia-cfg" in m["target"]
               or "libnvidia-nscq" in m["target"] for m in plan["mounts"])


@pytest.mark.parametrize("env", [[], ["NVIDIA_VISIBLE_DEVICES="], ["NVIDIA_VISIBLE_DEVICES=void"]])
def test_hook_not_a_gpu_container(fake_machine, bundle, pid, env):
    write_config(bundle, env)
    res = hook(fake_machine, bundle, pid, "--dry-run", "prestart")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"gpu": False}


@pytest.mark.parametrize("env,expected", [
    (["NVIDIA_VISIBLE_DEVICES=9"], "nvcontainer-hook: device error: 9: unknown device"),
    (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,frobnicate"],
     "nvcontainer-hook: input error: unsupported capabilities found in"),
    (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=99.0"],
     "nvcontainer-hook: requirement error: unsatisfied condition: cuda>=99.0"),
    (["NVIDIA_VISIBLE_DEVICES=0\x1b[2J\nforged line"], "nvcontainer-hook: "),
])
def test_hook_bad_values_are_one_line(fake_machine, bundle, pid, env, expected):
    write_config(bundle, env)
    res = hook(fake_machine, bundle, pid, "--dry-run", "prestart")
    assert res.returncode == 1
    assert res.stdout == ""
    assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith(expected), res.stderr
    assert "\x1b" not in res.stderr


@pytest.mark.parametrize("state,expected", [
    ('{"pid": true, "bundle": "/x"}', "nvcontainer-hook: input error: state: pid"),
    ('{"pid": 1.5, "bundle": "/x"}', "nvcontainer-hook: input error: state: pid"),
    ('{"pid": NaN, "bundle": "/x"}', "nvcontainer-hook: input error: "),
    ("[" * 100000, "nvcontainer-hook: input error: "),
    ("", "nvcontainer-hook: input error: "),
])
def test_hook_hostile_state(fake_machine, bundle, pid, state, expected):
    res = hook(fake_machine, bundle, pid, "--dry-run", "prestart", state=state)
    assert res.returncode == 1
    assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith(expected), res.stderr


def test_hook_other_stages_and_usage(fake_machine, bundle, pid):
    assert hook(fake_machine, bundle, pid, "poststart").returncode == 0
    assert hook(fake_machine, bundle, pid, "poststop").returncode == 0
    res = hook(fake_machine, bundle, pid, "frobnicate")
    assert res.returncode == 2 and res.stderr.startswith("nvcontainer-hook: input error: unknown stage")


def test_configure_dry_run_json(fake_machine, bundle):
    rootfs = bundle / "rootfs"
    res = run_in_fake_proc(fake_machine, [*CLI, "--root", str(fake_machine.root), "configure", "--dry-run", "--json",
                                          "-d", "0", "--utility", "--compute", str(rootfs)],
                           capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert [d["path"] for d in plan["devices"]][-1] == "/dev/nvidia0"
    assert any(m["target"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14" for m in plan["mounts"])


def test_configure_without_dry_run_does_not_pretend(fake_machine, bundle):
    res = run_in_fake_proc(fake_machine, [*CLI, "--root", str(fake_machine.root), "configure", "-d", "0", "-c",
                                          str(bundle / "rootfs")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1


@pytest.mark.parametrize("rootfs", ["relative/path", "/"])
def test_configure_rejects_bad_rootfs(fake_machine, rootfs):
    res = subprocess.run([*CLI, "configure", "--dry-run", rootfs], capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr == f"nvcontainer: input error: invalid rootfs directory: {rootfs}\n"


def test_hook_imports_stay_lean(fake_machine, bundle, pid):
    """The hook's own process must not import click, pyelftools or pynvml (NVML runs in a child)."""
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=0"])
    code = ("import sys, runpy; sys.argv=['nvcontainer-hook','--root',sys.argv[1],'--dry-run','prestart']\n"
            "from nvcontainer.hook import main as hook\n"
            "rc = hook.main(sys.argv[1:])\n"
            "bad = [m for m in ('click','elftools','pynvml') if m in sys.modules]\n"
            "sys.stderr.write('LOADED:' + ','.join(bad) + '\\n'); sys.exit(rc)\n")
    state = json.dumps({"pid": pid, "bundle": str(bundle)})
    res = run_in_fake_proc(fake_machine, [sys.executable, "-c", code, str(fake_machine.root)], input=state,
                           capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "LOADED:\n" in res.stderr
