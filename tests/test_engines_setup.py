"""Real engines started with the configuration ``nvcontainer setup`` wrote, on the fake GPU machine,
through the runtime shim: dockerd (``--runtime=nvidia``, ``--set-as-default``, ``--gpus``) and
containerd's CRI, as the kubelet drives it (RunPodSandbox / CreateContainer / StartContainer with
the runtime handler ``nvidia``).

The node's installation is a directory of this checkout's programs as the package lays them out:
the console scripts, the runtime shim's native front and the native hook client, built here. Its
``nvidia-container-runtime-hook`` and the hook the shim is configured with are stand-ins that
first give the container's procfs a ``/proc/driver/nvidia`` (what a real driver's procfs has;
``runtime.PROC_DRIVER_HOOK``) and then execute the real program with the same state and
arguments. The configuration (``/etc/nvcontainer/config.toml``: the fake driver root, that hook)
is laid over ``/etc`` in the engine's private world, as a node would have it.

Pass signals as in test_e2e_runtimes: with no driver behind the fake nodes, opening a node the
devices cgroup allows gives ENXIO, one it denies EPERM. A non-GPU container's ``config.json`` is
compared byte for byte as the engine handed it to the shim and as the shim handed it to runc,
by two transparent stand-ins around it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvcontainer.native import build as native
from nvcontainer.setup import containerd as containerd_setup
from tests.fixtures import cri, dockerd, runtime
from tests.fixtures.fakegpu import FakeSpec

ENXIO = runtime.ENXIO
VENV = Path(sys.executable).parent
CLI = [sys.executable, "-m", "nvcontainer"]

CHECKS = r"""
for n in 0 1; do
  if [ -e /dev/nvidia$n ]; then echo "OPEN$n:$(cat /dev/nvidia$n 2>&1 | head -1)"; else echo "OPEN$n:absent"; fi
done
echo "LDCONFIG:$(ldconfig -p | grep -oE 'lib(cuda|nvidia-ml)\.so\.1 ' | sort | tr -d ' ' | tr '\n' ' ')"
echo "DONE:ok"
"""



def need(*tools):
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")


def script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


@pytest.fixture(scope="module")
def node(tmp_path_factory, machine):
    """A node's installation (``bin``), its ``/etc`` layer (``etc``), and the stand-ins."""
    base = tmp_path_factory.mktemp("node")
    bin_dir = base / "bin"
    bin_dir.mkdir()
    for name in ("nvcontainer", "nvcontainer-hook", "nvidia-container-cli"):
        os.symlink(VENV / name, bin_dir / name)
    native.build(str(bin_dir / native.NAME), sys.executable)
    native.build_runtime(str(bin_dir / "nvidia-container-runtime"), sys.executable)
    script(bin_dir / "nvidia-container-runtime-hook", runtime.driver_wrapper(VENV / "nvidia-container-runtime-hook"))
    hook = script(base / "served-hook", runtime.driver_wrapper(bin_dir / native.NAME))
    keep = base / "keep"
    keep.mkdir()
    low = script(base / "runc-keeper", runtime.keeper(keep / "after.json", shutil.which("runc")))
    script(base / "shim-keeper", runtime.keeper(keep / "before.json", bin_dir / "nvidia-container-runtime"))
    etc = base / "etc"
    (etc / "nvcontainer").mkdir(parents=True)
    (etc / "nvcontainer/config.toml").write_text(
        f'[nvidia-container-cli]\nroot = "{machine.root}"\ndebug = "{base / "hook.log"}"\n'
        f'[nvidia-container-runtime]\nruntimes = ["{low}"]\n'
        f'[nvidia-container-runtime-hook]\npath = "{hook}"\n')
    return base


def setup(node: Path, prefix: Path, engine: str, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run([*CLI, "setup", engine, "--prefix", str(prefix), "--hook-path",
                          str(node / "bin/nvcontainer-hook"), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res


def facts(out: str) -> dict[str, list[str]]:
    return runtime.parse_facts(out)


def assert_gpu0(rc: int, out: str, context: str) -> None:
    got = facts(out)
    assert rc == 0 and got.get("DONE") == ["ok"], f"{out}\n{context}"
    assert got["OPEN0"] == [f"cat: can't open '/dev/nvidia0': {ENXIO}"], out
    assert got["OPEN1"] == ["absent"], out
    assert got["LDCONFIG"] == ["libcuda.so.1 libnvidia-ml.so.1"], out


def test_dockerd_with_the_daemon_json_setup_wrote(machine, node, tmp_path):
    need("dockerd", "docker", "runc")
    prefix = tmp_path / "root"
    (prefix / "etc/docker").mkdir(parents=True)
    (prefix / "etc/docker/daemon.json").write_text('{\n  "log-level": "warn"\n}\n')
    report = setup(node, prefix, "docker", "--engine-version", "20.10.24").stdout
    assert "restart: systemctl restart docker" in report
    daemon = json.loads((prefix / "etc/docker/daemon.json").read_text())
    assert daemon == {"log-level": "warn", "runtimes": {"nvidia": {"path": str(node / "bin/nvidia-container-runtime")}}}
    # one more runtime, by hand, for this test only: the shim behind a keeper of the spec dockerd wrote
    daemon["runtimes"]["kept"] = {"path": str(node / "shim-keeper")}
    (tmp_path / "daemon.json").write_text(json.dumps(daemon))
    base = dockerd.prepare(tmp_path / "d")
    run = ["run", "--rm", "--network", "none"]
    results, res = dockerd.run(machine, base, tmp_path / "daemon.json", [
        [*run, "--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=0", dockerd.IMAGE, "sh", "-c", CHECKS],
        [*run, "--runtime=kept", dockerd.IMAGE, "sh", "-c", CHECKS],
        [*run, dockerd.IMAGE, "sh", "-c", CHECKS],
        [*run, "--gpus", "device=0", dockerd.IMAGE, "sh", "-c", CHECKS],
    ], etc=node / "etc", local_bin=prefix / "usr/local/bin")
    context = f"{res.stderr}\n{dockerd.log(base)}"
    assert len(results) == 4, context
    assert_gpu0(*results[0], context)
    plain = facts(results[1][1])
    assert results[1][0] == 0 and plain["OPEN0"] == ["absent"] and plain["LDCONFIG"] == [""], context
    keep = node / "keep"
    assert (keep / "before.json").read_bytes() == (keep / "after.json").read_bytes()   # the shim left it alone
    spec = json.loads((keep / "after.json").read_text())
    hooks = [h["path"] for stage in (spec.get("hooks") or {}).values() for h in stage]
    assert not [h for h in hooks if "hook" in os.path.basename(h)]
    # no NVIDIA device node or rule (major 195) added (a substring test would also match the
    # container's random hex id, as it once did)
    assert not [d for d in spec["linux"].get("devices") or [] if d.get("major") == 195 or "nvidia" in d["path"]]
    assert not [r for r in (spec["linux"].get("resources") or {}).get("devices") or [] if r.get("major") == 195]
    assert facts(results[2][1])["OPEN0"] == ["absent"]          # runc, the default: no GPU
    assert_gpu0(*results[3], context)                          # --gpus: the hook setup put on dockerd's PATH


def test_dockerd_with_nvidia_as_the_default_runtime(machine, node, tmp_path):
    need("dockerd", "docker", "runc")
    prefix = tmp_path / "root"
    setup(node, prefix, "docker", "--engine-version", "20.10.24", "--set-as-default")
    daemon = prefix / "etc/docker/daemon.json"
    assert json.loads(daemon.read_text())["default-runtime"] == "nvidia"
    base = dockerd.prepare(tmp_path / "d")
    run = ["run", "--rm", "--network", "none"]
    results, res = dockerd.run(machine, base, daemon, [
        [*run, "-e", "NVIDIA_VISIBLE_DEVICES=0", dockerd.IMAGE, "sh", "-c", CHECKS],
        [*run, "-e", "NVIDIA_VISIBLE_DEVICES=1", dockerd.IMAGE, "sh", "-c",
         "cat /dev/nvidia1 2>&1 | head -1; [ -e /dev/nvidia0 ] || echo ZERO:absent"],
        [*run, dockerd.IMAGE, "sh", "-c", CHECKS],
    ], etc=node / "etc", served=True)
    context = f"{res.stderr}\n{dockerd.log(base)}"
    assert len(results) == 3, context
    # served: the shim's spec edit of each GPU container (the front answers the third alone), and
    # the hook the shim added is the native client, and nvcontainer serve did the work
    served = (base / "serve.log").read_text()
    assert "request declined" not in served and served.count("runtime request from pid ") == 2, served
    assert "(served by nvcontainer serve, pid " in (node / "hook.log").read_text()
    assert_gpu0(*results[0], context)
    assert results[1] == (0, f"cat: can't open '/dev/nvidia1': {ENXIO}\nZERO:absent"), context
    assert results[2][0] == 0 and facts(results[2][1])["OPEN0"] == ["absent"], context
    subprocess.run([*CLI, "setup", "docker", "--undo", "--prefix", str(prefix)], check=True, capture_output=True,
                   timeout=60)
    assert not daemon.exists()   # setup made it; undo takes it back whole


def cri_node(node: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """containerd's CRI set up by ``setup containerd`` (1.6): (its base, its main config, the prefix)."""
    need("containerd", "ctr", "runc")
    pytest.importorskip("grpc")
    base = cri.prepare(tmp_path / "c")
    prefix = tmp_path / "root"
    main = prefix / "etc/containerd/config.toml"
    main.parent.mkdir(parents=True)
    main.write_text((base / "config.toml").read_text())
    setup(node, prefix, "containerd", "--engine-version", "1.6.20")
    return base, main, prefix


def test_containerd_cri_with_the_runtime_handler_setup_wrote(machine, node, tmp_path):
    """Kubernetes' way: pods through containerd's CRI gRPC endpoint with the runtime handler
    'nvidia' from the drop-in setup wrote (containerd 1.6: the handler is the route; no CDI)."""
    base, main, prefix = cri_node(node, tmp_path)
    assert f'imports = ["{containerd_setup.DROPIN}"]' in main.read_text()
    other = 'cat /dev/nvidia1 2>&1 | head -1; [ -e /dev/nvidia0 ] || echo ZERO:absent'
    results, res = cri.run(machine, base, main, f"{prefix / 'etc'}:{node / 'etc'}", [
        {"name": "gpu0", "handler": "nvidia", "env": ["NVIDIA_VISIBLE_DEVICES=0"], "script": CHECKS},
        {"name": "gpu1", "handler": "nvidia", "env": ["NVIDIA_VISIBLE_DEVICES=1"], "script": other},
        {"name": "plain", "handler": "nvidia", "env": [], "script": CHECKS},
        {"name": "runc", "handler": "", "env": ["NVIDIA_VISIBLE_DEVICES=0"], "script": CHECKS},
    ])
    context = f"{res.stdout}\n{res.stderr}\n{cri.log(base)}"
    got = {r["name"]: (r["rc"], r["log"]) for r in results}
    assert len(got) == 4, context
    assert_gpu0(*got["gpu0"], context)
    assert got["gpu1"] == (0, f"cat: can't open '/dev/nvidia1': {ENXIO}\nZERO:absent"), context
    for name in ("plain", "runc"):   # no GPU asked for; the default handler runs no hook at all
        assert got[name][0] == 0 and facts(got[name][1])["OPEN0"] == ["absent"], context
