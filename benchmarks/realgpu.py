"""What nvcontainer does on a node with a real NVIDIA GPU and driver, beside NVIDIA's own tools.

The tests and ``python -m benchmarks`` run on the fake GPU machine (``tests/fixtures/fakegpu``):
a mock NVML and real ELF files laid out as a driver install. This module is the check that the
fake machine stands for a real one: run as root on a GPU node (``benchmarks/realgpu.sh`` sets it
up on a bare machine), it records, into one JSON file and one text report,

* the node: GPU, driver, kernel, cgroup hierarchy, where the driver's files are;
* ``info``, ``info --csv`` and ``list`` of ours beside NVIDIA's ``nvidia-container-cli`` 1.17.0
  (the anchors' build), output compared line by line;
* ``configure --pid`` into a fresh mount and PID namespace, ours and NVIDIA's cli each into its
  own, with what each mounted and created, and ``nvidia-smi -L`` and a CUDA program (a kernel
  launched, its result copied back and checked) run chrooted in each;
* real ``runc run`` starts with each prestart registration (our in-process hook, our served
  path with the native client, NVIDIA's hook with its cli): the container runs nvidia-smi and
  the CUDA program behind runc's deny-by-default device cgroup, so a GPU that works inside
  proves the cgroup step too; a container that asks for no GPU gets nothing;
* start latency, interleaved rounds of ``runc run`` of ``true`` with every registration and
  without a hook, as ``python -m benchmarks`` times them on the fake machine, with CPU per
  start (runc's children, plus the server's whole tree for the served arms); and 32 starts at
  once per registration, the p95 each adds over the no-hook arm's; from these two steps, issue
  27's targets 1 to 3 with a real node's limits, against NVIDIA's arm of the same run
  (``benchmarks/targets.py``, the table ``python -m benchmarks`` ends with on the fake machine);
* the Kubernetes side (``benchmarks/realgpu_k8s.py``): two containers at once on GPU 0's MPS
  replicas (``nvcontainer mps-daemon`` and what the device plugin's Allocate hands out), the
  real GPU's DRA ResourceSlice and one claim prepared by ``nvcontainer dra-driver`` and run
  through its CDI spec, and a running container as ``nvcontainer ps --json`` shows it.

Nothing here changes the GPU's settings (no persistence mode, no clocks, no MIG): the node is
only read, and the namespaces, cgroups and runc state it makes are removed at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from . import nvidia, realgpu_installer, realgpu_k8s as k8s, stats, targets

HOOK_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
GPU_ENV = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]

CUDA_TEST = r"""
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
__global__ void twice(int *x) { x[threadIdx.x] = 2 * threadIdx.x; }
int main(int argc, char **argv) {   // argv[1]: seconds to hold the GPU memory after the kernel
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) { printf("cuda: cudaGetDeviceCount: %s\n", cudaGetErrorString(e)); return 1; }
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    int *d = 0, h[64] = {0};
    if ((e = cudaMalloc(&d, sizeof h)) != cudaSuccess) { printf("cuda: cudaMalloc: %s\n", cudaGetErrorString(e)); return 1; }
    twice<<<1, 64>>>(d);
    if ((e = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost)) != cudaSuccess) {
        printf("cuda: kernel or copy: %s\n", cudaGetErrorString(e)); return 1; }
    long sum = 0;
    for (int i = 0; i < 64; i++) sum += h[i];
    printf("cuda: %d device(s), %s, %d SMs, kernel result %s (sum %ld)\n", n, p.name, p.multiProcessorCount,
           sum == 4032 ? "correct" : "WRONG", sum);
    fflush(stdout);
    if (argc > 1) sleep(atoi(argv[1]));
    return sum == 4032 ? 0 : 1;
}
"""


def sh(argv: list[str], *, env: dict | None = None, timeout: float = 120, input: bytes | None = None) -> dict:
    """Run ``argv``; its exit status, output and wall milliseconds (never raises)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, input=input, capture_output=True, env=env, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        rc, out, err = -1, b"", str(exc).encode()
    return {"argv": argv, "rc": rc, "ms": round((time.perf_counter() - start) * 1000, 1),
            "stdout": out.decode(errors="replace")[-20000:], "stderr": err.decode(errors="replace")[-4000:]}


class Node:
    def __init__(self, args):
        self.work = Path(args.work)
        self.tools = Path(args.tools)
        self.venv = Path(args.venv)
        self.python = self.venv / "bin" / "python"
        self.ours = self.venv / "bin" / "nvcontainer"
        self.report: dict = {"argv": sys.argv}
        self.text: list[str] = []
        self.anchors = self.work / "nvidia-anchors"   # unpacked by main()
        self.nvidia_env = dict(os.environ, LD_LIBRARY_PATH=f"{self.anchors}/lib:{self.tools}/lib")
        self.runc = [str(self.tools / "runc"), "--root", str(self.work / "runc-state")]
        self.runc_env = dict(os.environ, LD_LIBRARY_PATH=str(self.tools / "lib"))
        self.no_pivot: list[str] = []
        self.cgroups: list[Path] = []      # made for the namespaces, removed at the end
        self.has_cuda = False
        self.undo: list = []               # the k8s steps' clean-up (benchmarks/realgpu_k8s.py), run last first
        # where the k8s steps read the node (tests/test_realgpu_steps.py points them at the fake machine)
        self.proc, self.sysfs, self.extra_config = "/proc", "/sys", ""

    def say(self, line: str = "") -> None:
        self.text.append(line)
        print(line, flush=True)

    def block(self, title: str, result: dict) -> None:
        self.say(f"$ {' '.join(result['argv'])}   # rc {result['rc']}, {result['ms']} ms  [{title}]")
        for stream in ("stdout", "stderr"):
            body = result[stream].rstrip()
            if body:
                self.say("\n".join(("  " if stream == "stdout" else "! ") + line for line in body.splitlines()))

    # --- the node ---------------------------------------------------------------------------

    def facts(self) -> None:
        self.say("== node")
        facts = {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version()}
        for name, argv in {
            "gpu": ["nvidia-smi", "--query-gpu=name,uuid,pci.bus_id,driver_version,persistence_mode,mig.mode.current",
                    "--format=csv"],
            "cgroup": ["stat", "-f", "-c", "%T", "/sys/fs/cgroup"],
            "driver-version": ["cat", "/proc/driver/nvidia/version"],
            "devices": ["sh", "-c", "ls -l /dev/nvidia* /dev/nvidia-caps 2>&1"],
            "ldcache": ["sh", "-c", "ldconfig -p | grep -E 'libnvidia|libcuda|libnvcuvid|libEGL_nvidia|libGLX_nvidia'"],
            "driver-binaries": ["sh", "-c", "ls -l $(command -v nvidia-smi nvidia-debugdump nvidia-persistenced "
                                "nvidia-cuda-mps-control nvidia-cuda-mps-server 2>/dev/null)"],
            "firmware": ["sh", "-c", "ls -l /lib/firmware/nvidia/*/ 2>&1 | head -20"],
            "mounts": ["sh", "-c", "grep -E ' / | /tmp | /sys/fs/cgroup|nvidia' /proc/self/mountinfo"],
            "os": ["sh", "-c", ". /etc/os-release; echo $PRETTY_NAME"],
        }.items():
            result = sh(argv)
            facts[name] = result["stdout"].strip() or result["stderr"].strip()
            self.block(name, result)
        self.report["facts"] = facts

    # --- info / list against NVIDIA's cli ---------------------------------------------------

    def parity(self) -> None:
        self.say("\n== info and list: ours beside NVIDIA's nvidia-container-cli 1.17.0")
        theirs = [str(self.anchors / "bin" / "nvidia-container-cli")]
        dropin = [str(self.venv / "bin" / "nvidia-container-cli")]
        rows = {}
        for label, args in {"info": ["info"], "info --csv": ["info", "--csv"], "list": ["list"],
                            "list --device 0": ["list", "--device", "0"]}.items():
            ours = sh([str(self.ours), *args])
            drop = sh([*dropin, *args])
            nvidia = sh([*theirs, *args], env=self.nvidia_env)
            for title, result in (("ours", ours), ("ours, drop-in name", drop), ("NVIDIA", nvidia)):
                self.block(f"{label}: {title}", result)
            a, b = ours["stdout"].splitlines(), nvidia["stdout"].splitlines()
            rows[label] = {"ours": ours, "dropin": drop, "nvidia": nvidia, "same": a == b,
                           "only_ours": [x for x in a if x not in b], "only_nvidia": [x for x in b if x not in a],
                           "dropin_same_as_ours": drop["stdout"] == ours["stdout"]}
            self.say(f"-> {label}: {'identical output' if a == b else 'DIFFERS'}; "
                     f"only ours {rows[label]['only_ours']}; only NVIDIA's {rows[label]['only_nvidia']}")
        self.report["parity"] = rows

    def extras(self) -> None:
        self.say("\n== doctor, dry run, CDI")
        rootfs = self.work / "dry-rootfs"
        rootfs.mkdir(exist_ok=True)
        out = {}
        for label, argv, env in (
                ("doctor", [str(self.ours), "doctor"], None),
                ("configure --dry-run", [str(self.ours), "configure", "--dry-run", "--device", "0", "--compute",
                                         "--utility", str(rootfs)], None),
                ("cdi generate (ours)", [str(self.ours), "cdi", "generate"], None),
                ("cdi generate (NVIDIA)", [str(self.anchors / "bin" / "nvidia-ctk"), "cdi", "generate"], None)):
            result = sh(argv, env=env)
            out[label] = result
            self.block(label, result)
        self.report["extras"] = out

    # --- a rootfs that can run nvidia-smi and a CUDA program --------------------------------

    def build_rootfs(self) -> Path:
        """busybox, the node's C and C++ runtime libraries (what the image would bring) and a
        CUDA program built here with nvcc (CUDA's runtime linked in statically, as nvcc does by
        default): the driver's libraries and nvidia-smi come from the configure step."""
        self.say("\n== container image")
        rootfs = self.work / "image"
        for d in ("bin", "usr/bin", "lib64", "lib/x86_64-linux-gnu", "etc", "proc", "sys", "dev", "tmp"):
            (rootfs / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.tools / "busybox", rootfs / "bin" / "busybox")
        for applet in ("sh", "ls", "cat", "true", "sleep", "mount", "grep", "find", "head"):
            os.symlink("busybox", rootfs / "bin" / applet)
        (rootfs / "etc" / "ld.so.conf").write_text("/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n")
        nvcc = shutil.which("nvcc") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)
        cuda = None
        if nvcc:
            source = self.work / "cudatest.cu"
            source.write_text(CUDA_TEST)
            built = sh([nvcc, "-O2", "-o", str(rootfs / "cudatest"), str(source)], timeout=300)
            self.block("nvcc", built)
            if built["rc"] == 0:
                cuda = rootfs / "cudatest"
        else:
            self.say("no nvcc: the CUDA program is left out")
        libs = set()
        for program in filter(None, [cuda, shutil.which("nvidia-smi")]):
            for line in sh(["ldd", str(program)])["stdout"].splitlines():
                parts = line.split("=>")
                path = (parts[1] if len(parts) > 1 else parts[0]).split("(")[0].strip()
                if path.startswith("/") and "nvidia" not in path and "libcuda" not in path:
                    libs.add(path)
        for lib in sorted(libs):
            real = os.path.realpath(lib)
            dest = rootfs / ("lib64" if "ld-linux" in lib else "lib/x86_64-linux-gnu") / os.path.basename(lib)
            shutil.copy2(real, dest)
        self.say(f"image: busybox, {len(libs)} C/C++ runtime libraries ({', '.join(sorted(os.path.basename(x) for x in libs))})"
                 f"{', cudatest' if cuda else ''}")
        sh(["/sbin/ldconfig", "-r", str(rootfs)])
        self.has_cuda = cuda is not None
        return rootfs

    def fresh(self, template: Path, name: str) -> Path:
        dest = self.work / name
        subprocess.run(["cp", "-a", str(template), str(dest)], check=True)
        return dest

    # --- configure into a namespace ---------------------------------------------------------

    def namespace(self, rootfs: Path) -> tuple[subprocess.Popen, int]:
        """A process in new mount and PID namespaces with the runtime's usual mounts on the
        rootfs (proc, a tmpfs /dev, sysfs read-only), as a runtime leaves it for a prestart hook."""
        bb = str(self.tools / "busybox")
        script = (f"{bb} mount -t proc proc {rootfs}/proc && {bb} mount -t tmpfs -o mode=755 tmpfs {rootfs}/dev && "
                  f"{bb} mount -t sysfs -o ro sysfs {rootfs}/sys && echo ready && exec {bb} sleep 600")
        proc = subprocess.Popen(["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "--kill-child",
                                 bb, "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.readline()
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        pid = int(children[0])
        # its own cgroup, as a container has (never the node's root cgroup): the cgroup v2
        # hierarchy where it is mounted there, the v1 devices controller where there is one
        for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/devices"):
            if not os.path.exists(f"{base}/cgroup.procs"):
                continue
            group = Path(base) / f"nvc-real-{pid}"
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(pid))
            self.cgroups.append(group)
        return proc, pid

    def inside(self, pid: int, rootfs: Path, argv: list[str]) -> dict:
        return sh(["nsenter", "-t", str(pid), "-m", "-p", "--", "chroot", str(rootfs), *argv], timeout=120)

    def mounted(self, pid: int, rootfs: Path) -> list[str]:
        prefix = str(rootfs)
        lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        points = [line.split()[4] for line in lines]
        return sorted(p[len(prefix):] for p in points
                      if p.startswith(prefix + "/") and p[len(prefix):] not in ("/proc", "/dev", "/sys"))

    def configure(self, template: Path) -> None:
        self.say("\n== configure --pid into a namespace: ours, then NVIDIA's cli")
        results = {}
        for who in ("ours", "nvidia", "nvidia --no-cgroups"):
            if who == "nvidia --no-cgroups" and results["nvidia"]["configure"]["rc"] == 0:
                continue
            rootfs = self.fresh(template, f"ns-{who.split()[0]}-{len(results)}")
            proc, pid = self.namespace(rootfs)
            try:
                if who == "ours":
                    argv = [str(self.ours), "--debug", str(self.work / "configure-debug.log"), "configure",
                            "--pid", str(pid), "--device", "0", "--compute", "--utility", str(rootfs)]
                    env = None
                else:   # the failure of its cgroup step is recorded, then it is run without that step
                    argv = [str(self.anchors / "bin" / "nvidia-container-cli"), "--debug",
                            str(self.work / f"nvidia-debug-{len(results)}.log"), "configure", "--pid", str(pid),
                            "--device", "0", "--compute", "--utility", "--ldconfig", "@/sbin/ldconfig",
                            *(["--no-cgroups"] if "no-cgroups" in who else []), str(rootfs)]
                    env = self.nvidia_env
                result = sh(argv, env=env)
                self.block(f"configure: {who}", result)
                entry = {"configure": result, "mounts": self.mounted(pid, rootfs),
                         "dev": sorted(os.listdir(rootfs / "dev")) if os.path.isdir(rootfs / "dev") else []}
                entry["dev"] = self.inside(pid, rootfs, ["/bin/ls", "-l", "/dev"])["stdout"]
                entry["smi"] = self.inside(pid, rootfs, ["/usr/bin/nvidia-smi", "-L"])
                self.block(f"nvidia-smi -L inside ({who})", entry["smi"])
                if self.has_cuda:
                    entry["cuda"] = self.inside(pid, rootfs, ["/cudatest"])
                    self.block(f"CUDA program inside ({who})", entry["cuda"])
                self.say(f"mounted by {who} ({len(entry['mounts'])}): " + " ".join(entry["mounts"]))
                self.say(f"/dev inside ({who}):\n" + entry["dev"].rstrip())
                results[who] = entry
            finally:
                proc.kill()
                proc.wait()
        a, b = set(results["ours"]["mounts"]), set(results.get("nvidia --no-cgroups", results["nvidia"])["mounts"])
        results["only_ours"], results["only_nvidia"] = sorted(a - b), sorted(b - a)
        self.say(f"-> mounts only ours: {results['only_ours']}\n-> mounts only NVIDIA's: {results['only_nvidia']}")
        log = self.work / "configure-debug.log"
        results["debug_log"] = log.read_text()[-12000:] if log.exists() else ""
        for n in (1, 2):
            theirs = self.work / f"nvidia-debug-{n}.log"
            if theirs.exists():
                results[f"nvidia_debug_log_{n}"] = theirs.read_text(errors="replace")[-12000:]
        self.report["configure"] = results

    # --- runc -------------------------------------------------------------------------------

    def spec(self) -> dict:
        d = self.work / "spec"
        d.mkdir(exist_ok=True)
        if not (d / "config.json").exists():
            subprocess.run([*self.runc, "spec"], cwd=d, check=True, env=self.runc_env)
        return json.loads((d / "config.json").read_text())

    def bundle(self, template: Path, prestart: list[dict], env: list[str], args: list[str]) -> Path:
        name = f"b-{uuid.uuid4().hex[:10]}"
        bundle = self.work / "bundles" / name
        bundle.mkdir(parents=True)
        subprocess.run(["cp", "-al", str(template), str(bundle / "rootfs")], check=True)
        spec = copy.deepcopy(self.base_spec)
        spec["process"].update(terminal=False, args=args, env=["PATH=/usr/bin:/bin", *env])
        spec["root"] = {"path": "rootfs", "readonly": False}
        spec["hooks"] = {"prestart": prestart} if prestart else {}
        spec["linux"]["cgroupsPath"] = f"/nvc-real/{name}"
        (bundle / "config.json").write_text(json.dumps(spec))
        return bundle

    def run_bundle(self, bundle: Path) -> dict:
        result = sh([*self.runc, "run", *self.no_pivot, "--bundle", str(bundle), bundle.name], env=self.runc_env)
        sh([*self.runc, "delete", "-f", bundle.name], env=self.runc_env)
        shutil.rmtree(bundle, ignore_errors=True)
        return result

    def entries(self) -> dict:
        bin_ = self.venv / "bin"
        entries = {
            "hook": {"path": str(bin_ / "nvcontainer-hook"), "args": ["nvcontainer-hook", "prestart"],
                     "env": HOOK_ENV, "timeout": 60},
            "served": {"path": str(self.client), "args": [str(self.client), "--socket", str(self.socket), "prestart"],
                       "env": HOOK_ENV, "timeout": 60},
            "nvidia": {"path": str(self.anchors / "bin" / "nvidia-container-runtime-hook"),
                       "args": ["nvidia-container-runtime-hook", "-config", str(self.work / "nvidia-config.toml"),
                                "prestart"], "env": HOOK_ENV, "timeout": 60},
            "empty": {"path": str(self.tools / "busybox"), "args": ["true"], "env": HOOK_ENV, "timeout": 60},
        }
        nvidia.write_config(self.work / "nvidia-config.toml", self.work / "nvidia-container-cli",
                            f"{self.anchors}/lib:{self.tools}/lib", legacy=True)
        return entries

    def start_server(self) -> None:
        self.socket = self.work / "serve" / "hook.sock"
        self.socket.parent.mkdir(mode=0o700, exist_ok=True)
        self.server = subprocess.Popen([str(self.python), "-m", "nvcontainer", "serve", "--socket", str(self.socket)],
                                       env={"PATH": HOOK_ENV[0][5:]}, cwd="/", stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        start = time.perf_counter()
        line = self.server.stderr.readline().decode(errors="replace").strip()
        self.report["server_start"] = {"line": line, "ms": round((time.perf_counter() - start) * 1000, 1)}
        self.say(f"server: {line} ({self.report['server_start']['ms']} ms)")

    def server_cpu_ms(self) -> float:
        """The server's CPU and that of every child it has reaped, plus its live children's."""
        def stat(pid: str) -> list[int]:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return [int(x) for x in fields[11:15]]
        tick = os.sysconf("SC_CLK_TCK")
        total = sum(stat(str(self.server.pid)))
        for child in Path(f"/proc/{self.server.pid}/task/{self.server.pid}/children").read_text().split():
            try:
                total += sum(stat(child))
            except OSError:
                pass
        return total * 1000 / tick

    def settle(self) -> None:
        last, still = -1.0, 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and still < 3:
            now = self.server_cpu_ms()
            still = still + 1 if now == last else 0
            last = now
            time.sleep(0.02)

    def probe_pivot(self, template: Path) -> dict:
        """runc run of ``true``, no hook; where pivot_root fails (a rootfs on the initramfs),
        ``--no-pivot`` from then on."""
        probe = self.run_bundle(self.bundle(template, [], [], ["/bin/true"]))
        if probe["rc"] != 0 and "pivot" in probe["stderr"]:
            self.no_pivot = ["--no-pivot"]
            probe = self.run_bundle(self.bundle(template, [], [], ["/bin/true"]))
        return probe

    def runc_checks(self, template: Path) -> None:
        self.say("\n== runc run with each registration (GPU 0, compute+utility; runc's device cgroup denies by default)")
        self.block("runc, no hook", self.probe_pivot(template))
        entries = self.entries()
        work = "nvidia-smi -L; " + ("/cudatest; " if self.has_cuda else "") + "ls /dev | grep -i nvidia | tr '\\n' ' '; echo"
        checks = {}
        for arm in ("hook", "served", "nvidia"):
            result = self.run_bundle(self.bundle(template, [entries[arm]], GPU_ENV, ["/bin/sh", "-c", work]))
            self.block(f"runc: {arm}", result)
            checks[arm] = result
        for arm in ("hook", "served", "nvidia"):
            result = self.run_bundle(self.bundle(template, [entries[arm]], [],
                                                 ["/bin/sh", "-c", "ls /dev; ls /usr/bin; grep -c nvidia /proc/mounts || true"]))
            self.block(f"runc, no GPU asked: {arm}", result)
            checks[f"{arm}-nogpu"] = result
        self.report["runc"] = checks

    def timing(self, template: Path, runs: int) -> None:
        self.say(f"\n== start latency: runc run of true, {runs} interleaved rounds")
        entries = self.entries()
        arms = {"none": ([], GPU_ENV), "empty": ([entries["empty"]], []),
                "served": ([entries["served"]], GPU_ENV), "hook": ([entries["hook"]], GPU_ENV),
                "nvidia": ([entries["nvidia"]], GPU_ENV),
                "served-nogpu": ([entries["served"]], []), "hook-nogpu": ([entries["hook"]], []),
                "nvidia-nogpu": ([entries["nvidia"]], [])}
        samples = {arm: {"ms": [], "cpu_ms": [], "failed": []} for arm in arms}
        for round_ in range(runs + 2):
            for arm, (prestart, env) in arms.items():
                bundle = self.bundle(template, prestart, env, ["/bin/true"])
                self.settle()
                server_before = self.server_cpu_ms()
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                result = sh([*self.runc, "run", *self.no_pivot, "--bundle", str(bundle), bundle.name], env=self.runc_env)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000
                if arm.startswith("served"):
                    self.settle()
                    cpu += self.server_cpu_ms() - server_before
                sh([*self.runc, "delete", "-f", bundle.name], env=self.runc_env)
                shutil.rmtree(bundle, ignore_errors=True)
                if round_ < 2:
                    continue
                if result["rc"] != 0:
                    samples[arm]["failed"].append(result["stderr"][-300:])
                    continue
                samples[arm]["ms"].append(result["ms"])
                samples[arm]["cpu_ms"].append(round(cpu, 2))
        none = stats.summary(samples["none"]["ms"]).get("median")
        none_cpu = stats.summary(samples["none"]["cpu_ms"]).get("median")
        summary = {}
        self.say(f"{'arm':14} {'median':>8} {'p95':>8} {'over none':>10} {'CPU/start':>10} {'CPU over none':>14} failed")
        for arm, s in samples.items():
            if not s["ms"]:
                self.say(f"{arm:14} all {len(s['failed'])} runs failed: {s['failed'][:1]}")
                continue
            wall, cpu = stats.summary(s["ms"]), stats.summary(s["cpu_ms"])["median"]
            med, p95 = wall["median"], wall["p95"]
            summary[arm] = {"median": med, "p95": p95, "over_none": med - none, "cpu": cpu, "cpu_over_none": cpu - none_cpu,
                            "n": wall["n"], "failed": len(s["failed"])}
            self.say(f"{arm:14} {med:8.1f} {p95:8.1f} {med - none:+10.1f} {cpu:10.1f} {cpu - none_cpu:+14.1f} {len(s['failed'])}")
        if "nvidia" in summary and summary["nvidia"]["over_none"] > 0:
            for arm in ("served", "hook"):
                if arm in summary:
                    ratio = summary[arm]["over_none"] / summary["nvidia"]["over_none"]
                    summary[arm]["vs_nvidia"] = ratio
                    self.say(f"{arm}: {ratio:.2f}x NVIDIA's overhead; CPU over none "
                             f"{summary[arm]['cpu_over_none']:.1f} ms vs NVIDIA's {summary['nvidia']['cpu_over_none']:.1f} ms")
        self.report["timing"] = {"runs": runs, "summary": summary, "samples": samples,
                                 "load": os.getloadavg()}

    def concurrent(self, template: Path, at_once: int, rounds: int) -> None:
        """``at_once`` starts of ``true`` spawned together, per arm, rounds interleaved; each
        start timed from its own spawn to its exit (as ``python -m benchmarks`` does)."""
        self.say(f"\n== {at_once} starts at once, {rounds} rounds per arm")
        entries = self.entries()
        arms = {"none": [], "served": [entries["served"]], "hook": [entries["hook"]], "nvidia": [entries["nvidia"]]}
        samples = {arm: {"ms": [], "failed": []} for arm in arms}
        for _ in range(rounds):
            for arm, prestart in arms.items():
                bundles = [self.bundle(template, prestart, GPU_ENV, ["/bin/true"]) for _ in range(at_once)]
                self.settle()
                procs = {}
                for b in bundles:
                    procs[b] = (time.perf_counter(), subprocess.Popen(
                        [*self.runc, "run", *self.no_pivot, "--bundle", str(b), b.name], env=self.runc_env,
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
                for b, (start, proc) in procs.items():
                    err = proc.communicate(timeout=300)[1]
                    ms = (time.perf_counter() - start) * 1000
                    if proc.returncode == 0:
                        samples[arm]["ms"].append(round(ms, 1))
                    else:
                        samples[arm]["failed"].append(err.decode(errors="replace")[-300:])
                for b in bundles:
                    sh([*self.runc, "delete", "-f", b.name], env=self.runc_env)
                    shutil.rmtree(b, ignore_errors=True)
        single = self.report.get("timing", {}).get("summary", {})

        summary = {}
        none = stats.summary(samples["none"]["ms"]).get("p95")
        for arm, s in samples.items():
            if not s["ms"]:
                self.say(f"{arm:8} all failed: {s['failed'][:1]}")
                continue
            wall = stats.summary(s["ms"])
            row = {"median": wall["median"], "p95": wall["p95"], "n": wall["n"], "failed": len(s["failed"])}
            if arm != "none" and none is not None:
                row["p95_added"] = row["p95"] - none
                if arm in single and single[arm]["over_none"] > 0:
                    row["p95_added_over_single"] = row["p95_added"] / single[arm]["over_none"]
            summary[arm] = row
            self.say(f"{arm:8} median {row['median']:7.1f}  p95 {row['p95']:7.1f}  "
                     + (f"p95 added {row['p95_added']:+7.1f}" if "p95_added" in row else "")
                     + (f"  ({row['p95_added_over_single']:.2f}x its single-start overhead)"
                        if "p95_added_over_single" in row else "") + f"  failed {row['failed']}")
        # what a fork of the server copies (its page tables grow with its resident memory): the
        # request children of a burst are forked one after another by this one process
        status = dict(line.split(":", 1) for line in Path(f"/proc/{self.server.pid}/status").read_text().splitlines()
                      if line.startswith(("VmRSS", "VmPTE")))
        server = {k: v.strip() for k, v in status.items()}
        self.say(f"server: {server}")
        self.report["concurrent"] = {"at_once": at_once, "rounds": rounds, "summary": summary, "samples": samples,
                                     "server": server}

    def issue27(self) -> None:
        """Issue 27's targets 1 to 3 (and the no-GPU rows of 5) from the ``timing`` and
        ``concurrent`` steps' figures, judged with a real node's limits."""
        if "timing" not in self.report and "concurrent" not in self.report:
            return
        rows = targets.judge(targets.from_realgpu(self.report), real_node=True)
        self.report["issue27"] = targets.record(rows)
        self.say("\n" + targets.render(rows, "== issue 27's targets (real node): medians over the no-hook arm, "
                                             "against NVIDIA's hook 1.17.9 + cli 1.17.0 in the same run",
                                       targets.FOOTER_REAL).rstrip())

    def shim(self, template: Path) -> None:
        """Our ``nvidia-container-runtime`` in place of runc, as an engine runs it: a spec with no
        hook asking for GPU 0 gets the hook and the GPU's device nodes written into it (legacy
        mode); a spec asking for nothing is left byte for byte."""
        from nvcontainer.native import build

        self.say("\n== the runtime shim (ours) in place of runc")
        config = self.work / "shim-config.toml"
        config.write_text("[nvidia-container-runtime]\n"
                          f'runtimes = ["{self.tools}/runc"]\n'
                          'mode = "legacy"\n'
                          "[nvidia-container-runtime-hook]\n"
                          f'path = "{self.venv}/bin/nvidia-container-runtime-hook"\n')
        shim = self.work / "nvidia-container-runtime"
        build.build_runtime(str(shim), str(self.python), str(config))
        work = "nvidia-smi -L; " + ("/cudatest; " if self.has_cuda else "") + "ls /dev | grep -i nvidia | tr '\\n' ' '; echo"
        out = {}
        for label, env in (("GPU 0", GPU_ENV), ("no GPU", [])):
            bundle = self.bundle(template, [], env, ["/bin/sh", "-c", work])
            before = (bundle / "config.json").read_bytes()
            result = sh([str(shim), "--root", str(self.work / "runc-state"), "run", *self.no_pivot, "--bundle",
                         str(bundle), bundle.name], env=self.runc_env)
            after = (bundle / "config.json").read_bytes()
            spec = json.loads(after)
            entry = {"run": result, "unchanged": before == after, "prestart": spec.get("hooks", {}).get("prestart", []),
                     "devices": [d.get("path") for d in spec.get("linux", {}).get("devices", [])]}
            sh([*self.runc, "delete", "-f", bundle.name], env=self.runc_env)
            shutil.rmtree(bundle, ignore_errors=True)
            self.block(f"shim, {label}", result)
            self.say(f"-> config.json {'left byte for byte' if entry['unchanged'] else 'written'}; prestart hooks "
                     f"{[h.get('path') for h in entry['prestart']]}; linux.devices {entry['devices']}")
            out[label] = entry
        self.report["shim"] = out

    def deviceplugin(self) -> None:
        """``nvcontainer device-plugin`` against the real NVML, registered with the tests' fake
        kubelet: what it advertises, its health, and an Allocate of the GPU."""
        self.say("\n== the device plugin against the real driver (the tests' fake kubelet)")
        from tests.fixtures.kubelet import FakeKubelet, Watch
        from nvcontainer.deviceplugin.v1beta1 import api_pb2 as pb

        directory = self.work / "device-plugins"
        directory.mkdir(mode=0o700, exist_ok=True)
        config = self.work / "plugin.toml"
        config.write_text(f'cache-dir = "{self.work}/plugin-cache"\n[device-plugin]\nsocket-dir = "{directory}"\n')
        debug = self.work / "plugin-debug.log"
        kubelet = FakeKubelet(directory).start()
        stderr = open(self.work / "plugin.stderr", "wb")
        plugin = subprocess.Popen([str(self.ours), "--config", str(config), "--debug", str(debug), "device-plugin"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd="/")
        out: dict = {}
        try:
            (reg,) = kubelet.wait_registered(1, timeout=30)
            out["registered"] = {"resource": reg.resource_name, "endpoint": reg.endpoint, "version": reg.version}
            stub = kubelet.plugin(reg.endpoint)
            watch = Watch(stub)
            devices = watch.next(30)
            out["advertised"] = {k: list(v) for k, v in devices.items()}
            time.sleep(3)   # health: the real NVML's event wait runs meanwhile
            later = {}
            while True:
                try:
                    later = watch.next(0.5)
                except Exception:
                    break
            out["after_3s"] = {k: list(v) for k, v in later.items()} if later else "no change"
            watch.cancel()
            ids = list(devices)
            response = stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids[:1])]))
            (answer,) = response.container_responses
            out["allocate"] = {"envs": dict(answer.envs), "mounts": [m.host_path for m in answer.mounts],
                               "devices": [d.host_path for d in answer.devices],
                               "cdi": [d.name for d in answer.cdi_devices]}
            options = stub.GetDevicePluginOptions(pb.Empty())
            out["options"] = {"pre_start": options.pre_start_required,
                              "preferred": options.get_preferred_allocation_available}
        finally:
            plugin.send_signal(signal.SIGTERM)
            try:
                out["exit"] = plugin.wait(30)
            except subprocess.TimeoutExpired:
                plugin.kill()
                out["exit"] = "killed"
            kubelet.stop()
            stderr.close()
            out["stderr"] = (self.work / "plugin.stderr").read_text(errors="replace")[-3000:]
            out["debug"] = debug.read_text(errors="replace")[-6000:] if debug.exists() else ""
            self.report["deviceplugin"] = out
            for key in ("registered", "advertised", "after_3s", "allocate", "options", "exit"):
                self.say(f"{key}: {out.get(key)}")
            if out["stderr"].strip():
                self.say("stderr: " + out["stderr"].strip())

    def profile(self, template: Path, runs: int = 5) -> None:
        """Where an in-process start goes on this node: interpreter and imports (timed, and
        ``-X importtime``), then the steps of the hook's debug log in runc starts."""
        from .hookprofile import importtime_top

        self.say("\n== where an in-process start spends its time")
        py = str(self.python)
        out: dict = {}
        for label, argv in {"python -I -S -c pass": [py, "-I", "-S", "-c", "pass"],
                            "python -I -c pass": [py, "-I", "-c", "pass"],
                            "python -I -c 'import nvcontainer.hook.main'": [py, "-I", "-c", "import nvcontainer.hook.main"]
                            }.items():
            ms = statistics.median(sh(argv)["ms"] for _ in range(10))
            out[label] = ms
            self.say(f"{ms:7.1f} ms  {label}")
        imports = sh([py, "-I", "-X", "importtime", "-c", "import nvcontainer.hook.main"])["stderr"]
        out["importtime"] = importtime_top(imports, 20)
        self.say("\n".join(out["importtime"]))
        out["sys.path"] = sh([py, "-I", "-c", "import sys; print(sys.path)"])["stdout"].strip()
        self.say(f"sys.path: {out['sys.path']}")
        logs = []
        for i in range(runs):
            log = self.work / f"hook-debug-{i}.log"
            entry = dict(self.entries()["hook"], args=["nvcontainer-hook", "--debug", str(log), "prestart"])
            result = self.run_bundle(self.bundle(template, [entry], GPU_ENV, ["/bin/true"]))
            text = log.read_text() if log.exists() else ""
            logs.append({"ms": result["ms"], "rc": result["rc"], "log": text})
        self.say(f"runc run with the hook and --debug: {[x['ms'] for x in logs]} ms; the last run's log:")
        self.say(logs[-1]["log"].rstrip())
        out["debug_runs"] = logs
        # one start under cProfile (imports included), the hook entered as the front enters it
        script = self.work / "profiled-hook.py"
        stats = self.work / "hook.prof"
        script.write_text(
            "import cProfile, sys\n"
            "profile = cProfile.Profile()\n"
            "sys.argv = ['nvcontainer-hook', 'prestart']\n"
            "profile.enable()\n"
            "try:\n"
            "    from nvcontainer.hook.main import main\n"
            "    code = main()\n"
            "except SystemExit as exc:\n"
            "    code = exc.code\n"
            "finally:\n"
            "    profile.disable()\n"
            f"    profile.dump_stats({str(stats)!r})\n"
            "sys.exit(code)\n")
        entry = dict(self.entries()["hook"], path=str(self.python), args=[str(self.python), "-I", str(script)])
        for _ in range(2):   # the second: the inventory cache is warm for this PATH
            result = self.run_bundle(self.bundle(template, [entry], GPU_ENV, ["/bin/true"]))
        if stats.exists():
            import io
            import pstats
            text = io.StringIO()
            pstats.Stats(str(stats), stream=text).sort_stats("cumulative").print_stats(45)
            pstats.Stats(str(stats), stream=text).sort_stats("tottime").print_stats(25)
            out["cprofile"] = text.getvalue()
            self.say(f"cProfile of one in-process start (runc {result['ms']} ms, rc {result['rc']}):")
            self.say(text.getvalue())
        self.report["profile"] = out

    def cleanup(self) -> None:
        for undo in reversed(self.undo):
            try:
                undo()
            except Exception as exc:   # the rest of the clean-up still runs
                self.say(f"!! clean-up: {type(exc).__name__}: {exc}")
        if getattr(self, "server", None):
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
        for group in [*self.cgroups, *Path("/sys/fs/cgroup").glob("*/nvc-real"), Path("/sys/fs/cgroup/nvc-real")]:
            try:
                group.rmdir()
            except OSError:
                pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="scratch directory (removed by the caller)")
    parser.add_argument("--tools", required=True, help="runc, busybox, their libraries, NVIDIA's tools, wheels")
    parser.add_argument("--venv", required=True, help="the environment nvcontainer is installed in")
    parser.add_argument("--out", required=True, help="where realgpu.json and realgpu.txt are written")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--at-once", type=int, default=32, help="starts spawned together (concurrent step)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the concurrent step")
    parser.add_argument("--only", default="facts,parity,extras,deviceplugin,configure,runc,timing,concurrent,"
                                          "profile,shim,mps,dra,ps,installer", help="the steps to run, comma-separated (default: %(default)s)")
    args = parser.parse_args()
    node = Node(args)
    parts = args.only.split(",")
    node.work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xJf", str(node.tools / "nvidia-anchors.tar.xz"), "-C", str(node.work)], check=True)
    nvidia.build_cli_shim(node.work, node.anchors / "bin" / "nvidia-container-cli")
    # a caller's timeout (SIGTERM) still leaves the record of the steps that ran
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    from nvcontainer.native import build
    node.client = node.venv / "bin" / build.NAME
    if not node.client.exists():
        build.build(str(node.client), str(node.python))
    steps = {"facts": node.facts, "parity": node.parity, "extras": node.extras, "deviceplugin": node.deviceplugin}
    try:
        for name in parts:
            if name in steps:
                try:
                    steps[name]()
                except Exception as exc:  # one broken step must not lose the others' record
                    node.say(f"!! step {name} failed: {type(exc).__name__}: {exc}")
        if {"configure", "runc", "timing", "concurrent", "profile", "shim", "mps", "dra", "ps", "installer"} & set(parts):
            template = node.build_rootfs()
            node.base_spec = node.spec()
            node.start_server()
            if "runc" not in parts:
                node.probe_pivot(template)
            for name, step in (("configure", lambda: node.configure(template)),
                               ("runc", lambda: node.runc_checks(template)),
                               ("timing", lambda: node.timing(template, args.runs)),
                               ("concurrent", lambda: node.concurrent(template, args.at_once, args.rounds)),
                               ("profile", lambda: node.profile(template)),
                               ("shim", lambda: node.shim(template)),
                               ("mps", lambda: k8s.mps(node, template)),
                               ("dra", lambda: k8s.dra(node, template)),
                               ("ps", lambda: k8s.ps(node, template)),
                               ("installer", lambda: realgpu_installer.installer(node, template))):
                if name in parts:
                    try:
                        step()
                    except Exception as exc:
                        import traceback
                        node.say(f"!! step {name} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        node.cleanup()
        try:
            node.issue27()
        except Exception as exc:   # the record of the steps is still written
            node.say(f"!! issue 27's table: {type(exc).__name__}: {exc}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "realgpu.json").write_text(json.dumps(node.report, indent=1))
        (out / "realgpu.txt").write_text("\n".join(node.text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
