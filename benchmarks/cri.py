"""containerd's CRI with the runtime handler ``nvidia`` (issue 33): a pod's container started as
the kubelet starts it (RunPodSandbox, CreateContainer, StartContainer, until it exits), timed,
NVIDIA's handler beside ours in the same run.

The same node as ``benchmarks/dockernode.py`` (its fronts, hooks and NVIDIA's anchors, built by its
``setup``), here registered as containerd handlers: ``runc`` (the default), ``nvidia`` (our shim,
served), ``nvidia-toolkit`` (NVIDIA's runtime 1.17.9, legacy mode). Arms: ``runc``, ``shim-nogpu``
(handler nvidia, no GPU asked), ``served`` (handler nvidia, ``NVIDIA_VISIBLE_DEVICES=0``),
``nvidia`` and ``nvidia-nogpu``, and ``runc-named`` (runc itself as a handler with a
``BinaryName``, the control for what containerd does for any such handler). A pod's time runs from RunPodSandbox to its container's exit
(the sandbox goes through the handler too); the status is polled every 2 ms. The fake machine's
containers have no ``/proc/driver/nvidia``: each GPU hook is chained behind a small program that
mounts a tmpfs at the container's ``/proc/driver`` and makes ``nvidia`` in it first (docker's
benchmark gets that tmpfs from ``--tmpfs``; CRI has no such option).

    python -m benchmarks.cri [--runs 20] [--anchors ../shared/anchors/nvidia-anchors.tar.xz]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.fixtures import cri
from tests.fixtures.fakegpu.runner import fake_proc_command

from . import dockernode, nvidia, stats, workspace

CHAIN_TMPFS = dockernode.CHAIN_C.replace("#include <sys/stat.h>", "#include <sys/stat.h>\n#include <sys/mount.h>").replace(
    '        snprintf(path, sizeof path, "%s/proc/driver/nvidia", root);',
    '        snprintf(path, sizeof path, "%s/proc/driver", root);\n'
    '        if (mount("nvc-bench", path, "tmpfs", 0, "mode=755") < 0) _exit(5);\n'
    '        snprintf(path, sizeof path, "%s/proc/driver/nvidia", root);')

RUNTIMES = """
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
"""

# the world: /run and /etc as the docker benchmark has them, the server, containerd, the images
SCRIPT = r"""
set -e
base=$1 config=$2 etc=$3 python=$4 serve_config=$5
shift 5
""" + dockernode.WORLD + r"""containerd --config "$config" > "$base/containerd.log" 2>&1 &
daemon=$!
for i in $(seq 150); do [ -S "$base/c.sock" ] && break; sleep 0.1; done
for image in image.tar pause.tar; do
    ctr --address "$base/c.sock" -n k8s.io images import --snapshotter native "$base/$image" > /dev/null
done
set +e
"$@"
rc=$?
kill $daemon; wait $daemon 2>/dev/null
exit $rc
"""

def chain(base: Path, real: str | Path, extra: str | None = None) -> Path:
    """dockernode.chain's program, mounting the tmpfs first (CHAIN_TMPFS)."""
    return dockernode.chain(base, real, extra, CHAIN_TMPFS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cri", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed pods per arm, after the first (default 20)")
    parser.add_argument("--anchors", type=Path, default=nvidia.TARBALL)
    parser.add_argument("--out", type=Path, default=dockernode.RESULTS)
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    ws, machine = workspace.with_machine("nvc-bench-cri-")
    base = ws.base.parent
    try:
        cri.prepare(base)
        daemon, etc, _docker_arms, about = dockernode.setup(base, ws, machine, args.anchors)
        runtimes = json.loads(daemon.read_text())["runtimes"]
        node = base / "node"
        chain(node / "hook-served", ws.native_client)            # the served front's hook, with the tmpfs
        if "nvidia-toolkit" in runtimes:
            chain(node / "hook-nvidia", nvidia.hook_entry(base, machine, args.anchors)["path"])
        text = (base / "config.toml").read_text() + RUNTIMES + "".join(
            dockernode.CRI_HANDLER.format(name=name, path=runtimes[key]["path"])
            for name, key in (("nvidia", "nvidia"), ("nvidia-toolkit", "nvidia-toolkit")) if key in runtimes) + \
            dockernode.CRI_HANDLER.format(name="runc-named", path=shutil.which("runc"))
        config = base / "bench.toml"
        config.write_text(text)
        gpu = ["NVIDIA_VISIBLE_DEVICES=0"]
        # runc-named: runc itself as a handler with a BinaryName, as ours and NVIDIA's are (the
        # control for what containerd does differently for such a handler)
        arms = {"runc": ["", []], "runc-named": ["runc-named", []], "shim-nogpu": ["nvidia", []],
                "served": ["nvidia", gpu]}
        if "nvidia-toolkit" in runtimes:
            arms.update({"nvidia": ["nvidia-toolkit", gpu], "nvidia-nogpu": ["nvidia-toolkit", []]})
        client = dockernode.cri_loop_client(cri.IMAGE)
        inner = ["sh", "-c", SCRIPT, "sh", str(base), str(config), str(etc), str(ws.python), str(node / "served.toml"),
                 sys.executable, "-I", "-c", client, str(base / "c.sock"), str(base / "logs"), str(args.runs + 1),
                 json.dumps(arms)]
        outer = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private", "--",
                 *fake_proc_command(machine, inner)]
        res = subprocess.run(outer, capture_output=True, text=True, timeout=3600,
                             env={"PATH": workspace.SERVER_ENV["PATH"], "HOME": str(base)})
        samples, errors = dockernode.samples_of(res.stdout, arms)
        j = dockernode.judged(samples)
        timed, over = j["timed"], j["over"]
        if any(j["failed"].values()) or any(len(s) != args.runs for s in timed.values()):
            sys.stderr.write(f"benchmarks.cri: failed pods\n{chr(10).join(errors[-10:])}\n{res.stderr[-2000:]}\n"
                             f"{cri.log(base)[-1500:]}\n")
            return 1
        ratio = dockernode.ratio_to_nvidia(over)
        load_end = os.getloadavg()
        lines = [f"containerd CRI pod (RunPodSandbox .. exit of /bin/true), {args.runs} per arm after the first, "
                 f"alternating; load {load_start[0]:.1f} -> {load_end[0]:.1f}; {about}", *dockernode.table(j)]
        if ratio is not None:
            lines.append(dockernode.verdict("served overhead / NVIDIA's", ratio, dockernode.RATIO_TARGET, "x"))
        nogpu = stats.paired_median(timed["shim-nogpu"], timed["runc-named"])
        lines.append(f"no GPU through the handler over runc: {over['shim-nogpu']:+.1f} ms; "
                     + dockernode.verdict("over runc as a named handler", nogpu, dockernode.NOGPU_TARGET_MS, " ms"))
        sys.stdout.write("\n".join(lines) + "\n")
        workspace.save(args.out, "cri", {"runs": args.runs, "nvidia_arm": about, "over_runc_ms": over,
                                         "ratio_to_nvidia": ratio, "loadavg": [load_start, load_end],
                                         "arms": {arm: {"summary": stats.summary(s), "ms": s}
                                                  for arm, s in timed.items()}})
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
