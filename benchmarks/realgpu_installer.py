"""benchmarks/realgpu.py's ``installer`` step (issue 33): ``nvcontainer install`` on a real GPU
node, into a scratch node root, and a container started through what it installed.

The node has no engine, so the step plays one: the installer runs as the DaemonSet's container
would (``--host-root`` a scratch root with its own ``/etc/containerd``, ``/usr/local``, ``/run``;
the install directory named by a link into it, as ``tests/test_installer.py`` does), and the
runtime handler it registered in that root's containerd drop-in is executed the way containerd's
runc shim executes it: ``BinaryName --root STATE run --bundle B ID``. The container asks for GPU 0
(``NVIDIA_VISIBLE_DEVICES=0``) and runs ``nvidia-smi -L`` behind runc's deny-by-default device
cgroup: a GPU listed proves the shim's edit, the hook and the cgroup step on real hardware. Then
SIGTERM, and the root's ``config.toml`` must be byte for byte what it was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

MAIN = 'version = 2\n# a node\'s own file\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "pause:3"\n'
DROPIN = "etc/containerd/conf.d/99-nvidia.toml"
READY = "run/nvcontainer/validations/toolkit-ready"


def tree(node, top: Path) -> Path:
    """A tree as scripts/bundle lays one out, from the node's environment: the runtime front
    (reading ``config``, asking the node's server), the served client, the entry fronts."""
    from nvcontainer.native import build

    bin_dir = top / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    config = top.parent / "shim-config.toml"
    config.write_text(f'[nvidia-container-runtime]\nruntimes = ["{node.tools / "runc"}"]\n')
    build.build_runtime(str(bin_dir / "nvidia-container-runtime"), str(node.python), str(config),
                        defines=(f'NVC_SOCKET="{node.socket}"',))
    shutil.copy2(node.client, bin_dir / build.NAME)
    for name in build.FRONT_NAMES:
        shutil.copy2(node.venv / "bin" / name, bin_dir / name)
    if not (bin_dir / "python3").exists():
        os.symlink(node.python, bin_dir / "python3")
    return top


def installer(node, template: Path) -> None:
    work = node.work / "installer"
    host, named = work / "host", work / "nvc"
    for d in ("etc/containerd", "usr/local", "run", "var/run"):
        (host / d).mkdir(parents=True, exist_ok=True)
    (host / "etc/containerd/config.toml").write_text(MAIN)
    inside = host / str(named).lstrip("/")
    inside.parent.mkdir(parents=True, exist_ok=True)
    if not named.is_symlink():
        os.symlink(inside, named)
    source = tree(node, work / "tree")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOST_ROOT_MOUNT": str(host),
           "TOOLKIT_INSTALL_DIR": str(named), "NVCONTAINER_SOURCE": str(source), "RUNTIME": "containerd",
           "RUNTIME_RESTART_MODE": "none", "NVIDIA_RUNTIME_SET_AS_DEFAULT": "false"}
    out: dict = {}
    started = time.time()
    p = subprocess.Popen([str(node.python), "-m", "nvcontainer", "install"], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not ((host / READY).exists() and (host / READY).stat().st_mtime >= started):
            if p.poll() is not None or time.time() - started > 120:
                raise RuntimeError(f"the installer did not get ready: rc {p.poll()}")
            time.sleep(0.1)
        out["ready_s"] = round(time.time() - started, 2)
        handler = tomllib.loads((host / DROPIN).read_text())["plugins"]["io.containerd.grpc.v1.cri"]["containerd"][
            "runtimes"]["nvidia"]["options"]["BinaryName"]
        out["handler"] = handler
        from .realgpu import GPU_ENV, sh

        bundle = node.bundle(template, [], GPU_ENV, ["nvidia-smi", "-L"])
        run = sh([handler, "--root", str(node.work / "runc-state"), "run", "--bundle", str(bundle), bundle.name],
                 env=node.runc_env)
        sh([*node.runc, "delete", "-f", bundle.name], env=node.runc_env)
        shutil.rmtree(bundle, ignore_errors=True)
        node.block("installer: a GPU container through the installed runtime handler", run)
        out["run"] = {"rc": run["rc"], "ms": run["ms"], "gpu_listed": "GPU 0:" in run["stdout"]}
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        out["installer_log"] = err.decode(errors="replace")[-4000:]
        out["restored"] = (host / "etc/containerd/config.toml").read_text() == MAIN and not (host / DROPIN).exists()
        out["removed"] = not os.path.lexists(named / "current")
        node.report["installer"] = out
        node.say(f"installer: ready in {out.get('ready_s')} s; GPU in the container: "
                 f"{out.get('run', {}).get('gpu_listed')}; config restored byte for byte: {out['restored']}; "
                 f"programs removed: {out['removed']}")
        node.say("\n".join("  " + line for line in out["installer_log"].splitlines()))
        if named.is_symlink():
            named.unlink()
    json.dumps(out)   # the record stays JSON
