"""A Docker node on the fake GPU machine, shared by the Docker (``benchmarks.docker``), CRI
(``benchmarks.cri``) and trace (``benchmarks.dockertrace``) benchmarks, which never import each
other: a private dockerd with every runtime arm registered (ours served and in-process, NVIDIA's
from the anchors), each GPU hook behind the program that makes ``/proc/driver/nvidia`` in the
container, and one round-robin world of ``docker run`` per arm; and how every benchmark of the
engines' path (these two, and the real-GPU check's engines step) judges the samples of its
rounds: :func:`judged`, :func:`table`, :func:`verdict`. The targets are issue 27's (and 33's)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from nvcontainer.native import build as native
from tests.fixtures import dockerd
from tests.fixtures.fakegpu.runner import fake_proc_command

from . import nvidia, stats, workspace


RESULTS = workspace.REPO / "benchmarks" / "results"


RATIO_TARGET = 0.5    # our GPU start's overhead over runc / NVIDIA's


NOGPU_TARGET_MS = 2.0


# The state on stdin: make <root>/proc/driver/nvidia in the container's mount namespace (in a
# child: this process must not stay there), then execute REAL with the same argv and state.
CHAIN_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
static char state[65536], spec[1 << 20];
int main(int argc, char **argv) {
    ssize_t n, used = 0, got = 0;
    (void)argc;
    while ((n = read(0, state + used, sizeof state - 1 - used)) > 0) used += n;
    state[used] = 0;
    char *pid = strstr(state, "\"pid\":"), *bundle = strstr(state, "\"bundle\":\"");
    if (!pid || !bundle) return 2;
    char path[4096], root[4096], ns[64];
    bundle += 10;
    char *end = strchr(bundle, '"');
    if (!end) return 2;
    snprintf(path, sizeof path, "%.*s/config.json", (int)(end - bundle), bundle);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 2;
    while ((n = read(fd, spec + got, sizeof spec - 1 - got)) > 0) got += n;
    close(fd);
    char *r = strstr(spec, "\"root\":{\"path\":\"");
    if (!r) return 2;
    r += 16;
    char *rend = strchr(r, '"');
    if (!rend) return 2;
    if (*r == '/') snprintf(root, sizeof root, "%.*s", (int)(rend - r), r);
    else snprintf(root, sizeof root, "%.*s/%.*s", (int)(end - bundle), bundle, (int)(rend - r), r);
    snprintf(ns, sizeof ns, "/proc/%ld/ns/mnt", strtol(pid + 6, NULL, 10));
    pid_t child = fork();
    if (child == 0) {
        int nsfd = open(ns, O_RDONLY);
        if (nsfd < 0 || setns(nsfd, CLONE_NEWNS) < 0) _exit(3);
        snprintf(path, sizeof path, "%s/proc/driver/nvidia", root);
        _exit(mkdir(path, 0555) == 0 ? 0 : 4);
    }
    int status;
    if (child < 0 || waitpid(child, &status, 0) < 0 || status != 0) return 3;
    int p[2];
    if (pipe(p) < 0 || write(p[1], state, used) != used) return 5;
    close(p[1]);
    dup2(p[0], 0);
    close(p[0]);
#ifdef EXTRA
    char *args[256];
    int k = 0;
    args[k++] = argv[0];
    args[k++] = EXTRA;
    for (int i = 1; argv[i] && k < 255; i++) args[k++] = argv[i];
    args[k] = NULL;
    execv(REAL, args);
#else
    execv(REAL, argv);
#endif
    return 127;
}
"""


# The node's world, in a script with $base, $etc, $python and $serve_config set: /run a tmpfs,
# /etc under an overlay of the node's files, and the resident server, waited for (docker, cri).
WORLD = r"""mount -t tmpfs -o mode=755 nvc-run /run
mkdir -p "$base/etc-upper" "$base/etc-work"
mount -t overlay nvc-etc -o "lowerdir=$etc:/etc,upperdir=$base/etc-upper,workdir=$base/etc-work" /etc
mkdir -m 700 /run/nvcontainer
"$python" -m nvcontainer --config "$serve_config" serve --socket /run/nvcontainer/hook.sock 2> "$base/serve.err" &
for i in $(seq 100); do [ -S /run/nvcontainer/hook.sock ] && break; sleep 0.1; done
"""

# argv: base, daemon.json, /etc layer, python for `serve`, its configuration, rounds, then the arms as
# NAME ARG... separated by "--next". Prints "T <arm> <round> <ms> <rc>" per run.
SCRIPT = r"""
set -e
base=$1 daemon=$2 etc=$3 python=$4 serve_config=$5 rounds=$6
shift 6
""" + WORLD + r"""[ -S /run/nvcontainer/hook.sock ] || { echo "E serve"; cat "$base/serve.err"; exit 1; }
""" + dockerd.START + r"""docker -H "unix://$base/d.sock" import "$base/image.tar" nvc/busybox:test > /dev/null
set +e
names=() cmds=()
cmd=() name=
for a in "$@" --next; do
    if [ "$a" = --next ]; then names+=("$name"); cmds+=("$(printf '%q ' "${cmd[@]}")"); cmd=() name=
    elif [ -z "$name" ]; then name=$a
    else cmd+=("$a"); fi
done
n=${#names[@]}
for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < n; k++)); do
        i=$(( (k + r) % n ))
        t0=$EPOCHREALTIME
        eval "docker -H unix://$base/d.sock run --rm --network none --tmpfs /proc/driver:mode=755 ${cmds[i]}" \
            > "$base/out" 2>&1
        rc=$?
        t1=$EPOCHREALTIME
        echo "T ${names[i]} $r $(( (${t1/./} - ${t0/./}) )) $rc"
        [ $rc = 0 ] || { echo "E ${names[i]}"; head -c 600 "$base/out"; echo; }
    done
done
kill $daemon_pid; wait $daemon_pid 2>/dev/null
exit 0
"""


def chain(base: Path, real: Path | str, extra: str | None = None, code: str = CHAIN_C) -> Path:
    """``base/nvidia-container-runtime-hook``: :data:`CHAIN_C` (or ``code``) built to execute
    ``real`` (the name a hook front answers to, as argv[0] goes through), with ``extra`` as its
    first argument."""
    base.mkdir(parents=True, exist_ok=True)
    source = base / "chain.c"
    source.write_text(code)
    program = base / "nvidia-container-runtime-hook"
    cc = shutil.which("musl-gcc") or "gcc"
    defines = [f'-DREAL="{real}"'] + ([f'-DEXTRA="{extra}"'] if extra is not None else [])
    subprocess.run([cc, "-static", "-O2", *defines, "-o", str(program), str(source)], check=True)
    return program


def shim_config(path: Path, machine, hook: Path, debug: Path | None = None) -> Path:
    """The shim's configuration; with ``debug``, the shim's and the hook's traces (timestamped
    lines) go to ``debug/<name>-runtime.log`` and ``-hook.log``."""
    cli_debug = f'debug = "{debug / path.stem}-hook.log"\n' if debug else ""
    runtime_debug = f'debug = "{debug / path.stem}-runtime.log"\n' if debug else ""
    path.write_text(f'[nvidia-container-cli]\nroot = "{machine.root}"\n{cli_debug}'
                    f'[nvidia-container-runtime]\nruntimes = ["runc"]\n{runtime_debug}'
                    f'[nvidia-container-runtime-hook]\npath = "{hook}"\n')
    return path


def setup(base: Path, ws, machine, tarball: Path, debug: Path | None = None) -> tuple[Path, Path, dict[str, list[str]], str]:
    """(daemon.json, /etc layer, arm -> docker run arguments, what NVIDIA's arm is)."""
    node = base / "node"
    node.mkdir()
    etc = base / "etc"
    (etc / "nvidia-container-runtime").mkdir(parents=True)
    fronts = {}
    for arm, real in (("served", ws.native_client), ("inprocess", ws.hook)):
        # in-process: a node whose server is down. The front asks a socket nothing listens on and
        # runs its Python half; the hook is told there is no server (by default nvcontainer-hook
        # asks one that listens on /run/nvcontainer/hook.sock, and this world has one).
        hook = chain(node / f"hook-{arm}", real, "--socket=" if arm == "inprocess" else None)
        config = shim_config(node / f"{arm}.toml", machine, hook, debug)
        front = node / arm / "nvidia-container-runtime"
        front.parent.mkdir()
        down = ('NVC_SOCKET="/run/nvcontainer/down.sock"',) if arm == "inprocess" else ()
        native.build_runtime(str(front), str(ws.python), str(config), defines=down)
        fronts[arm] = front
    # what `nvcontainer setup docker` writes (tests/test_engines_setup.py checks that form), and
    # one more runtime for the in-process configuration
    runtimes = {"nvidia": {"path": str(fronts["served"])}, "nvidia-inprocess": {"path": str(fronts["inprocess"])}}
    image = dockerd.IMAGE
    gpu = ["-e", "NVIDIA_VISIBLE_DEVICES=0"]
    arms = {"runc": [image, "true"],
            "shim-nogpu": ["--runtime=nvidia", image, "true"],
            "served": ["--runtime=nvidia", *gpu, image, "true"],
            "inprocess": ["--runtime=nvidia-inprocess", *gpu, image, "true"]}
    entry = nvidia.hook_entry(base, machine, tarball)
    if entry is None:
        about = f"NVIDIA's arm left out: {tarball} is not there"
    else:
        top = base / "nvidia" / "nvidia-anchors"
        hook = chain(node / "hook-nvidia", entry["path"])
        # NVIDIA's runtime and hook read /etc/nvidia-container-runtime/config.toml (the /etc layer)
        config = nvidia.write_config(etc / "nvidia-container-runtime" / "config.toml", base / "nvidia" /
                                     "nvidia-container-cli", f"{top}/lib", root=str(machine.root), legacy=True)
        with open(config, "a") as f:
            f.write(f'[nvidia-container-runtime-hook]\npath = "{hook}"\n')
        runtimes["nvidia-toolkit"] = {"path": str(top / "bin" / "nvidia-container-runtime")}
        arms["nvidia"] = ["--runtime=nvidia-toolkit", *gpu, image, "true"]
        arms["nvidia-nogpu"] = ["--runtime=nvidia-toolkit", image, "true"]
        about = "NVIDIA's runtime 1.17.9 (legacy mode) + hook 1.17.9 + cli 1.17.0, ../shared/anchors"
    daemon = base / "daemon.json"
    daemon.write_text(json.dumps({"runtimes": runtimes}))
    return daemon, etc, arms, about


def run_world(base: Path, ws, machine, daemon: Path, etc: Path, arms: dict, rounds: int,
              roots: list[int] | None = None) -> tuple[dict, str]:
    """Every arm ``rounds`` times; ``roots`` gets the pid of the world's first process (the root
    of every process the runs make, for ``benchmarks.dockertrace``)."""
    argv = []
    for i, (arm, args) in enumerate(arms.items()):
        argv += (["--next"] if i else []) + [arm, *args]
    inner = ["bash", "-c", SCRIPT, "bash", str(base), str(daemon), str(etc), str(ws.python), str(base / "node" / "served.toml"),
             str(rounds), *argv]
    outer = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private", "--",
             *fake_proc_command(machine, inner)]
    env = {"PATH": workspace.SERVER_ENV["PATH"], "HOME": str(base)}
    proc = subprocess.Popen(outer, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if roots is not None:
        roots.append(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=3600)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    samples, errors = samples_of(stdout, arms)
    return samples, "\n".join(errors[-20:]) + stderr[-2000:]


def samples_of(stdout: str, arms) -> tuple[dict[str, list[tuple[int, float, int]]], list[str]]:
    """The world's "T <arm> <round> <us> <rc>" lines as (round, ms, rc) per arm; the other lines."""
    samples: dict[str, list[tuple[int, float, int]]] = {arm: [] for arm in arms}
    errors = []
    for line in stdout.splitlines():
        if line.startswith("T "):
            _, arm, rnd, us, rc = line.split()
            samples[arm].append((int(rnd), int(us) / 1000, int(rc)))
        elif line.strip():
            errors.append(line)
    return samples, errors


def judged(samples: dict[str, list[tuple[int, float, int]]], baseline: str = "runc") -> dict:
    """How a round-robin world's samples (:func:`samples_of`) are judged, in every benchmark
    of the engines' path (``benchmarks.docker``, ``benchmarks.cri``, the real-GPU engines step):
    round 0 is each arm's first start, apart; the later rounds that exited 0 are the timed ones,
    cut to the count every arm that ran has, so the pairs stay rounds; each arm's overhead is
    its paired median over ``baseline``. Keys: first ((ms, rc) or None), failed (later rounds
    that did not exit 0), timed, n, over."""
    first = {arm: next(((ms, rc) for r, ms, rc in s if r == 0), None) for arm, s in samples.items()}
    failed = {arm: sum(1 for r, _, rc in s if r > 0 and rc != 0) for arm, s in samples.items()}
    timed = {arm: [ms for r, ms, rc in s if r > 0 and rc == 0] for arm, s in samples.items()}
    n = min((len(s) for s in timed.values() if s), default=0)   # arms that all failed are reported apart
    timed = {arm: s[:n] for arm, s in timed.items()}
    over = {arm: stats.paired_median(s, timed.get(baseline, [])) for arm, s in timed.items() if arm != baseline}
    return {"first": first, "failed": failed, "timed": timed, "n": n, "over": over}


def ratio_to_nvidia(over: dict, arm: str = "served") -> float | None:
    """``arm``'s overhead over NVIDIA's, or None without both (or with NVIDIA's not above 0)."""
    ours, theirs = over.get(arm), over.get("nvidia")
    return ours / theirs if ours is not None and theirs is not None and theirs > 0 else None


def verdict(what: str, value: float, limit: float, unit: str) -> str:
    """One target's line: a ratio (``unit`` "x") or milliseconds."""
    shown = f"{value:.2f}x" if unit == "x" else f"{value:+.1f} ms"
    return f"{what}: {shown} (target <= {limit}{unit}: {'met' if value <= limit else 'NOT MET'})"


def table(judging: dict, columns: tuple[str, ...] = ("median", "p95", "min"), *, first: bool = False,
          failed: bool = False) -> list[str]:
    """The arms' lines of :func:`judged`'s figures, ms: the first start where asked, the timed
    rounds' ``columns``, the paired overhead over runc, the failed rounds where asked; an arm
    whose rounds all failed says so."""
    head = (f"{'arm':<14}" + (f"{'first':>9}" if first else "") + "".join(f"{c:>9}" for c in columns)
            + f"{'over runc':>11}")
    lines = [head + ("  failed" if failed else "")]
    for arm, s in judging["timed"].items():
        if s:
            m, o, start = stats.summary(s), judging["over"].get(arm), judging["first"].get(arm)
            cells = ((f"{start[0] if start else float('nan'):9.1f}" if first else "")
                     + "".join(f"{m[c]:9.1f}" for c in columns) + ("" if o is None else f"{o:+11.1f}"))
        else:
            cells = f"{'all failed':>{9 * (len(columns) + first)}}"
        line = f"{arm:<14}{cells}"
        lines.append(f"{line:<{len(head)}}  {judging['failed'][arm]}" if failed else line)
    return lines


# A containerd CRI runtime handler executing the runtime at {path} (the runc v2 shim's BinaryName),
# as `nvcontainer setup containerd` and the installer register ours: benchmarks.cri and the
# real-GPU check's engines step register each arm's runtime so.
CRI_HANDLER = """[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{name}]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{name}.options]
    BinaryName = "{path}"
"""


# The rounds of a timed client program, in Python (benchmarks.cri's pods, the real-GPU engines
# step's pods and Docker containers): argv[3] rounds, argv[4] {arm: its settings}, the arms
# rotated by one each round. The program defines start(arm, round, settings) -> (exit status,
# what to do after the clock stops, or None), ERRORS (what a failed start raises) and
# why(exc) (its one line). Prints "T <arm> <round> <us> <rc>", and "E <arm> <why>" on a failure.
ROUND_ROBIN = r"""
import time
rounds, arms = int(sys.argv[3]), json.loads(sys.argv[4])
names = list(arms)
for r in range(rounds):
    for k in range(len(names)):
        arm = names[(k + r) % len(names)]
        t0 = time.perf_counter()
        rc, after = -1, None
        try:
            rc, after = start(arm, r, arms[arm])
            us = int((time.perf_counter() - t0) * 1e6)
            if after:
                after()
        except ERRORS as exc:
            us = int((time.perf_counter() - t0) * 1e6)
            print(f"E {arm} {why(exc)}"[:600], flush=True)
        print(f"T {arm} {r} {us} {rc}", flush=True)
"""

# The kubelet's part, timed (benchmarks.cri, and the real-GPU check's engines step): argv[1] socket,
# argv[2] logs, then ROUND_ROBIN's, each arm's settings [handler, env]: a pod from RunPodSandbox
# to its container's exit, the sandbox's removal after the clock.
CRI_LOOP = r"""
ERRORS = grpc.RpcError

def why(exc):
    return f"{exc.code()}: {exc.details()}"

def start(arm, r, settings):
    handler, env = settings
    pod = msg(1, msg(1, f"p-{arm}-{r}"), msg(2, f"u-{arm}-{r}"), msg(3, "default")) + msg(3, logs) \
        + msg(8, msg(2, msg(1, num(1, 2))))
    sandbox = call("RunPodSandbox", msg(1, pod) + msg(2, handler))[1][0].decode()
    config = msg(1, msg(1, "c")) + msg(2, msg(1, IMAGE)) + msg(3, "/bin/true") \
        + b"".join(msg(6, msg(1, a), msg(2, b)) for a, b in (e.split("=", 1) for e in env)) \
        + msg(11, f"{arm}-{r}.log")
    container = call("CreateContainer", msg(1, sandbox) + msg(2, config) + msg(3, pod))[1][0].decode()
    call("StartContainer", msg(1, container))
    while True:
        status = fields(call("ContainerStatus", msg(1, container))[1][0])
        if status.get(3, [0])[0] == 2:
            break
        time.sleep(0.002)

    def remove():
        call("StopPodSandbox", msg(1, sandbox))
        call("RemovePodSandbox", msg(1, sandbox))
    return status.get(7, [0])[0], remove
""" + ROUND_ROBIN


def cri_loop_client(image: str) -> str:
    """:data:`CRI_LOOP` as one ``python -I -c`` program over the CRI socket, pods of ``image``
    (the protobuf helpers are the tests' CRI client's: raw bytes, no generated code)."""
    from tests.fixtures import cri

    helpers = cri.CLIENT[:cri.CLIENT.index("sock, logs, wanted")]
    return (helpers + "sock, logs = sys.argv[1], sys.argv[2]\nIMAGE = " + json.dumps(image)
            + "\nchannel = grpc.insecure_channel('unix://' + sock)\n"
            + "def call(method, request):\n    rpc = channel.unary_unary('/runtime.v1.RuntimeService/' + method, "
            "request_serializer=None, response_deserializer=None)\n    return fields(rpc(request, timeout=120))\n"
            + CRI_LOOP)
