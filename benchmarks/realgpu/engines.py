"""The real-GPU check's ``engines`` step (issue 33's benchmark on a real driver): a GPU
container's start through containerd as the kubelet drives it (CRI, runtime handler
``nvidia``) and as Docker drives it (containerd's runc v2 shim executing the registered
runtime's binary, what dockerd's ``--runtime=nvidia`` does: ``ctr run --runc-binary``), ours
and NVIDIA's 1.17.9 runtime (legacy mode, its hook and cli) beside plain runc, interleaved.

Why on the real node: the fake machine's NVML answers at once, so there NVIDIA's cli pays
nothing for the driver, while on a node it loads and initialises the real NVML on every GPU
start; our served start never loads NVML (the server's inventory, checked against the files).
``benchmarks.docker`` and ``benchmarks.cri`` give the fake machine's figures; this gives the
node's, with the engine's own work the same in every arm.

The node needs what ``TOOLS/engines`` brings (``benchmarks/realgpu_tools.sh``: containerd,
its runc v2 shim and ``ctr`` from Debian 12, xz-compressed; with ``dockerd.xz`` there too,
Docker's own path as well: a private dockerd on the same containerd, driven through its API as
``docker run --rm`` drives it, by :data:`DOCKER_LOOP`, the CLI being too large to carry). Everything runs in one PID and
mount namespace of its own (a fresh ``/run``, our server in it as a node runs it), which ends
with the step: nothing of it stays on the node but the scratch directory.
"""

from __future__ import annotations

import json
import lzma
import os
import shlex
import shutil
import subprocess
import tarfile
from pathlib import Path

from .. import dockernode, nvidia, stats
from .shell import GPU_ENV, HOOK_ENV, sh

ENGINES = ("containerd", "containerd-shim-runc-v2", "ctr")
DOCKERD = "dockerd"                   # optional beside them
BENCH = "docker.io/nvc/bench:real"    # busybox alone: what every timed pod and container runs
CHECK = "docker.io/nvc/check:real"    # the check's image: nvidia-smi's and the CUDA program's libraries
PAUSE = "docker.io/nvc/pause:real"

# Executes REAL with EXTRA before the arguments it was given: NVIDIA's runtime registers its
# hook by path alone, and the hook must read this run's configuration, not /etc's.
EXTRA_C = r"""
#include <unistd.h>
int main(int argc, char **argv) {
    char *args[argc + 2];
    int k = 0;
    args[k++] = argv[0];
    args[k++] = EXTRA;
    for (int i = 1; i < argc; i++) args[k++] = argv[i];
    args[k] = 0;
    execv(REAL, args);
    return 127;
}
"""

# The state (bundles, the shims' sockets) on the world's fresh /run, a tmpfs, as containerd
# keeps it on a node (/run/containerd); the images and snapshots on the disk, as /var/lib does.
CONFIG = """version = 2
root = "{base}/root"
state = "/run/containerd"

[grpc]
  address = "{base}/c.sock"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  disable_apparmor = true
  restrict_oom_score_adj = true   # the pause container's -998 needs CAP_SYS_RESOURCE
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    conf_dir = "{base}/cni"
"""

# argv: base, our python, the library path containerd (and so runc) gets, the server's
# global options (its --debug, or nothing). The steps are
# base/steps.sh; containerd and our server end with the namespace.
WORLD = r"""
set -e
base=$1 python=$2 libs=$3 serve_debug=$4
mount -t tmpfs -o mode=755 nvc-run /run
mkdir -m 700 /run/nvcontainer
env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    "$python" -m nvcontainer $serve_debug serve --socket /run/nvcontainer/hook.sock 2> "$base/serve.err" &
for i in $(seq 200); do [ -S /run/nvcontainer/hook.sock ] && break; sleep 0.1; done
PATH="$base/bin:$PATH" XDG_CONFIG_HOME="$base/xdg" LD_LIBRARY_PATH="$libs" \
    "$base/bin/containerd" --config "$base/config.toml" > "$base/containerd.log" 2>&1 &
daemon=$!
for i in $(seq 150); do [ -S "$base/c.sock" ] && break; sleep 0.1; done
for image in bench pause check; do
    "$base/bin/ctr" --address "$base/c.sock" -n k8s.io images import --snapshotter native "$base/$image.tar" > /dev/null
done
if [ -x "$base/bin/dockerd" ]; then
    PATH="$base/bin:$PATH" LD_LIBRARY_PATH="$libs" "$base/bin/dockerd" --config-file "$base/daemon.json" \
        --containerd "$base/c.sock" --data-root "$base/docker" --exec-root /run/docker --pidfile "$base/docker.pid" \
        -H "unix://$base/d.sock" --bridge none --iptables=false --ip6tables=false --ip-masq=false \
        --storage-driver vfs --userland-proxy=false --exec-opt native.cgroupdriver=cgroupfs > "$base/dockerd.log" 2>&1 &
    dockerd=$!
    for i in $(seq 300); do [ -S "$base/d.sock" ] && break; sleep 0.1; done
fi
set +e
bash "$base/steps.sh"
rc=$?
[ -n "${dockerd:-}" ] && { kill $dockerd; wait $dockerd 2>/dev/null; }
kill $daemon; wait $daemon 2>/dev/null
exit $rc
"""

# Docker's path, timed, through dockerd's API as `docker run --rm --network none` drives it
# (create, start, wait, remove): argv[1] socket, argv[2] the image's rootfs tarball (imported
# first), then dockernode.ROUND_ROBIN's, each arm's settings [runtime, env].
DOCKER_LOOP = r"""
import http.client, json, socket, sys, time

class Unix(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=120)
        self.unix = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.unix)

def call(method, url, body=None, raw=None, ctype="application/json"):
    conn = Unix(sys.argv[1])
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, "/v1.41" + url, body=data, headers={"Content-Type": ctype})
    res = conn.getresponse()
    out = res.read()
    conn.close()
    if res.status >= 300:
        raise RuntimeError(f"{method} {url}: {res.status} {out[:300]!r}")
    return json.loads(out) if out.startswith(b"{") else out

with open(sys.argv[2], "rb") as f:
    call("POST", "/images/create?fromSrc=-&repo=nvc/bench&tag=real", raw=f.read(), ctype="application/x-tar")
ERRORS = (OSError, RuntimeError, KeyError, ValueError)
why = str

def start(arm, r, settings):
    runtime, env = settings
    cid = call("POST", "/containers/create", {"Image": "nvc/bench:real", "Cmd": ["/bin/true"], "Env": env,
               "HostConfig": {"Runtime": runtime, "NetworkMode": "none"}})["Id"]
    call("POST", f"/containers/{cid}/start")
    rc = call("POST", f"/containers/{cid}/wait")["StatusCode"]
    call("DELETE", f"/containers/{cid}?force=1")   # on the clock: `docker run --rm` waits for it
    return rc, None
""" + dockernode.ROUND_ROBIN

# Docker's path, timed: "T <arm> <round> <us> <rc>" per `ctr run --rm`, arms rotated each round.
CTR_LOOP = r"""
for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < ${#names[@]}; k++)); do
        i=$(( (k + r) % ${#names[@]} ))
        t0=$EPOCHREALTIME
        eval "$ctr run --rm --snapshotter native ${cmds[i]} $image c-${names[i]}-$r /bin/true" > "$base/ctr.out" 2>&1
        rc=$?
        t1=$EPOCHREALTIME
        echo "T ${names[i]} $r $(( ${t1/./} - ${t0/./} )) $rc"
        [ $rc = 0 ] || { echo "E ${names[i]} $(head -c 400 "$base/ctr.out")"; }
    done
done
"""


def _place(source: Path, name: str, bin_: Path) -> bool:
    """``source/name`` (or its ``.xz``) as an executable ``bin_/name``; False when neither is there."""
    packed, plain = source / f"{name}.xz", source / name
    if plain.is_file():
        shutil.copy2(plain, bin_ / name)
    elif packed.is_file():
        with lzma.open(packed) as src, open(bin_ / name, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    else:
        return False
    os.chmod(bin_ / name, 0o755)
    return True


def _unpack(node, bin_: Path) -> bool:
    """The engines and runc into ``bin_``; False without containerd's three (dockerd is optional)."""
    source = node.tools / "engines"
    bin_.mkdir(parents=True, exist_ok=True)
    if not all(_place(source, name, bin_) for name in ENGINES):
        return False
    shutil.copy2(node.tools / "runc", bin_ / "runc")
    _place(source, DOCKERD, bin_)
    return True


DEBUG = os.environ.get("NVC_ENGINES_DEBUG") == "1"   # our runtime's, hook's and server's traces in the record


def _fronts(node, base: Path) -> dict[str, str]:
    """Each runtime's binary: ours (the front asking the world's server, its hook the native
    client), NVIDIA's (its configuration under XDG_CONFIG_HOME, its hook told the same file);
    and how ours was linked ("static" or "dynamic")."""
    from nvcontainer.native import build

    ours = base / "ours"
    ours.mkdir()
    config = ours / "config.toml"
    debug = base / "debug"
    debug.mkdir()
    config.write_text((f'[nvidia-container-cli]\ndebug = "{debug}/hook.log"\n' if DEBUG else "")
                      + "[nvidia-container-runtime]\n"
                      + (f'debug = "{debug}/runtime.log"\n' if DEBUG else "")
                      + f'runtimes = ["{base}/bin/runc"]\n'
                      'mode = "legacy"\n'
                      "[nvidia-container-runtime-hook]\n"
                      f'path = "{node.client}"\n')
    front = ours / "nvidia-container-runtime"
    linked = build.build_runtime(str(front), str(node.python), str(config))
    musl = shutil.which("musl-gcc", path="/usr/local/bin:/usr/bin:/bin")
    node.say(f"our runtime front: linked {linked}{' with musl' if musl else ''}")
    theirs = base / "xdg" / "nvidia-container-runtime" / "config.toml"
    theirs.parent.mkdir(parents=True)
    nvidia.write_config(theirs, node.work / "nvidia-container-cli", f"{node.anchors}/lib:{node.tools}/lib",
                        legacy=True)
    hook = _extra(base / "nvidia-hook", node.anchors / "bin" / "nvidia-container-runtime-hook", f"-config={theirs}")
    with open(theirs, "a") as f:
        f.write(f'runtimes = ["{base}/bin/runc"]\n[nvidia-container-runtime-hook]\npath = "{hook}"\n')
    return {"ours": str(front), "nvidia": str(node.anchors / "bin" / "nvidia-container-runtime"), "linked": linked}


def _extra(dest: Path, real: Path, extra: str) -> Path:
    """:data:`EXTRA_C` built to execute ``real`` with ``extra`` first; static where the node's C
    library allows it (as ``benchmarks/nvidia.py``'s shim)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    source = dest.with_suffix(".c")
    source.write_text(EXTRA_C)
    cc = shutil.which("musl-gcc") or "gcc"
    argv = [cc, "-O2", f'-DREAL="{real}"', f'-DEXTRA="{extra}"', "-o", str(dest), str(source)]
    if subprocess.run([*argv, "-static"], stderr=subprocess.DEVNULL).returncode != 0:
        subprocess.run(argv, check=True)
    return dest


def _summary(node, title: str, stdout: str, arms: dict, control: str) -> dict:
    """One loop's figures (:func:`dockernode.judged`), said and returned; a failed round is
    counted and left out, so one bad round does not lose the run."""
    samples, errors = dockernode.samples_of(stdout, arms)
    j = dockernode.judged(samples)
    node.say(f"\n{title}")
    for line in dockernode.table(j, failed=True):
        node.say(line)
    ratio = dockernode.ratio_to_nvidia(j["over"])
    nogpu = stats.paired_median(j["timed"].get("shim-nogpu", []), j["timed"].get(control, []))
    if ratio is not None:
        node.say("-> " + dockernode.verdict("served overhead / NVIDIA's", ratio, dockernode.RATIO_TARGET, "x"))
    if nogpu is not None:
        node.say("-> " + dockernode.verdict(f"no GPU through our runtime over {control}", nogpu,
                                            dockernode.NOGPU_TARGET_MS, " ms"))
    for line in errors[-5:]:
        node.say(f"!! {line[:400]}")
    return {"n": j["n"], "over_runc_ms": j["over"], "ratio_to_nvidia": ratio, "nogpu_over_control_ms": nogpu,
            "failed": j["failed"], "errors": errors[-10:],
            "arms": {arm: {"summary": stats.summary(s), "ms": s} for arm, s in j["timed"].items()}}


def engines(node, template: Path, runs: int) -> None:
    node.say(f"\n== the engines' path (issue 33): containerd's CRI, `ctr run` (Docker's shim path) and dockerd "
             f"where carried, {runs} interleaved rounds")
    base = node.work / "engines"
    if not _unpack(node, base / "bin"):
        node.say(f"no {', '.join(ENGINES)} in {node.tools / 'engines'}: step left out "
                 "(benchmarks/realgpu_tools.sh puts them there)")
        node.report["engines"] = {"skipped": "no engines in TOOLS"}
        return
    from tests.fixtures.containerd import image_tar

    fronts = _fronts(node, base)
    bench = node.busybox_root(base / "bench-rootfs", ("usr/lib/x86_64-linux-gnu",))   # the timed containers' image
    image_tar(bench, base / "bench.tar", BENCH, ("/bin/true",))
    image_tar(bench, base / "pause.tar", PAUSE, ("/bin/sleep", "3600"))
    image_tar(template, base / "check.tar", CHECK)
    for d in ("cni", "logs", "check-logs"):
        (base / d).mkdir()
    (base / "config.toml").write_text(
        CONFIG.format(base=base, pause=PAUSE)
        + dockernode.CRI_HANDLER.format(name="nvidia", path=fronts["ours"])
        + dockernode.CRI_HANDLER.format(name="nvidia-toolkit", path=fronts["nvidia"])
        + dockernode.CRI_HANDLER.format(name="runc-named", path=base / "bin" / "runc"))
    docker = (base / "bin" / DOCKERD).exists()
    (base / "daemon.json").write_text(json.dumps({"runtimes": {
        "nvidia": {"path": fronts["ours"]}, "nvidia-toolkit": {"path": fronts["nvidia"]},
        "runc-named": {"path": str(base / "bin" / "runc")}}}))
    with tarfile.open(base / "bench-rootfs.tar", "w") as tar:
        tar.add(bench, arcname=".")
    work = "nvidia-smi -L; " + ("/cudatest; " if node.has_cuda else "") + "ls /dev | grep nvidia | tr '\\n' ' '; echo"
    from tests.fixtures import cri

    checks = [{"name": "served", "handler": "nvidia", "env": GPU_ENV, "script": work, "image": CHECK},
              {"name": "nvidia", "handler": "nvidia-toolkit", "env": GPU_ENV, "script": work, "image": CHECK},
              {"name": "nogpu", "handler": "nvidia", "env": [], "script": "ls /dev; grep -c nvidia /proc/mounts || true",
               "image": CHECK}]
    cri_arms = {"runc": ["", []], "runc-named": ["runc-named", []], "shim-nogpu": ["nvidia", []],
                "served": ["nvidia", GPU_ENV], "nvidia": ["nvidia-toolkit", GPU_ENV],
                "nvidia-nogpu": ["nvidia-toolkit", []]}
    gpu = " ".join(f"--env {shlex.quote(e)}" for e in GPU_ENV)
    ctr_arms = {"runc": "", "runc-named": f"--runc-binary {base}/bin/runc",
                "shim-nogpu": f"--runc-binary {fronts['ours']}", "served": f"--runc-binary {fronts['ours']} {gpu}",
                "nvidia": f"--runc-binary {fronts['nvidia']} {gpu}", "nvidia-nogpu": f"--runc-binary {fronts['nvidia']}"}
    python = shlex.quote(str(node.python))
    (base / "check.py").write_text(cri.CLIENT)
    (base / "loop.py").write_text(dockernode.cri_loop_client(BENCH))
    (base / "docker.py").write_text(DOCKER_LOOP)
    docker_arms = {"runc": ["runc", []], **{arm: v for arm, v in cri_arms.items() if arm != "runc"}}
    steps = [f"base={shlex.quote(str(base))}",
             f'{python} -I "$base/check.py" "$base/c.sock" "$base/check-logs" {shlex.quote(json.dumps(checks))} '
             '> "$base/check.out" 2>&1',
             f'ctr="$base/bin/ctr --address $base/c.sock -n k8s.io" image={BENCH} rounds={runs + 1}',
             "names=(" + " ".join(ctr_arms) + ")",
             "cmds=(" + " ".join(shlex.quote(v) for v in ctr_arms.values()) + ")",
             CTR_LOOP.rstrip() + ' > "$base/ctr-runs.out"',
             *([f'{python} -I "$base/docker.py" "$base/d.sock" "$base/bench-rootfs.tar" {runs + 1} '
                f'{shlex.quote(json.dumps(docker_arms))} > "$base/docker.out" 2>&1'] if docker else []),
             f'{python} -I "$base/loop.py" "$base/c.sock" "$base/logs" {runs + 1} '
             f'{shlex.quote(json.dumps(cri_arms))} > "$base/cri.out" 2>&1']
    if DEBUG:   # Docker's path again after the CRI's: does a server that served for a while differ?
        steps += [CTR_LOOP.rstrip().replace("c-${names[i]}-$r", "d-${names[i]}-$r")
                  + ' > "$base/ctr-after.out"']
    (base / "steps.sh").write_text("\n".join(steps) + "\n")
    result = sh(["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private", "--",
                 "bash", "-c", WORLD, "bash", str(base), str(node.python), str(node.tools / "lib"),
                 f"--debug {base}/debug/serve.log" if DEBUG else ""],
                timeout=60 * 20, env={"PATH": HOOK_ENV[0][5:], "HOME": str(base)})
    out: dict = {"front": fronts["linked"], "world": {k: v for k, v in result.items() if k != "stdout"}}
    if result["rc"] != 0:
        node.block("the engines' world", result)
    for name in ("containerd.log", "serve.err", "dockerd.log"):
        path = base / name
        out[name] = path.read_text(errors="replace")[-3000:] if path.exists() else ""
    read = lambda name: (base / name).read_text(errors="replace") if (base / name).exists() else ""  # noqa: E731
    out["check"] = [json.loads(line) for line in read("check.out").splitlines() if line.startswith("{")]
    for c in out["check"]:
        node.say(f"CRI pod, {c['name']}: rc {c['rc']}\n" + "\n".join("  " + x for x in str(c["log"]).splitlines()))
    if not out["check"]:
        node.say("!! the check pods: " + read("check.out")[-1500:])
    out["cri"] = _summary(node, "containerd CRI pod (RunPodSandbox .. exit of /bin/true), ms", read("cri.out"),
                          cri_arms, "runc-named")
    out["ctr"] = _summary(node, "ctr run --rm (containerd's runc v2 shim executing the runtime binary, as under "
                          "dockerd --runtime), ms", read("ctr-runs.out"), ctr_arms, "runc-named")
    if docker:
        out["dockerd"] = _summary(node, "dockerd, `docker run --rm --network none` through its API (create, start, "
                                  "wait, remove), ms", read("docker.out"), docker_arms, "runc-named")
        if not out["dockerd"]["n"]:
            node.say("!! dockerd's log:\n" + out["dockerd.log"][-2000:])
    if DEBUG:
        out["ctr_after"] = _summary(node, "ctr run --rm again, after the CRI's pods, ms", read("ctr-after.out"),
                                    ctr_arms, "runc-named")
        for name in ("serve.log", "runtime.log", "hook.log"):
            out[f"debug_{name}"] = read(f"debug/{name}")[-60000:]
    if not out["cri"]["n"] or not out["ctr"]["n"]:
        node.say("!! containerd's log:\n" + out["containerd.log"][-2000:])
    node.report["engines"] = out
