"""The GPU node the real-GPU check runs on: its tools, a rootfs that runs nvidia-smi and a
CUDA program, namespaces and runc bundles, our server, and the steps that check what each
registration does (facts, parity, extras, configure, runc); the clean-up of all of it."""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from .. import nvidia
from .shell import GPU_ENV, HOOK_ENV, sh


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
        self.undo: list = []               # the k8s steps' clean-up (benchmarks/realgpu/k8s.py), run last first
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

    def busybox_root(self, dest: Path, extra_dirs: tuple[str, ...] = ()) -> Path:
        """A root of busybox and its applets, the image's library directories and an
        ``ld.so.conf`` naming them: every image the check makes starts from it."""
        for d in ("bin", "usr/bin", "lib64", "lib/x86_64-linux-gnu", *extra_dirs, "etc", "proc", "sys", "dev", "tmp"):
            (dest / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.tools / "busybox", dest / "bin" / "busybox")
        for applet in ("sh", "ls", "cat", "true", "sleep", "mount", "grep", "find", "head"):
            os.symlink("busybox", dest / "bin" / applet)
        (dest / "etc" / "ld.so.conf").write_text("/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n")
        return dest

    def build_rootfs(self) -> Path:
        """busybox, the node's C and C++ runtime libraries (what the image would bring) and a
        CUDA program built here with nvcc (CUDA's runtime linked in statically, as nvcc does by
        default): the driver's libraries and nvidia-smi come from the configure step."""
        self.say("\n== container image")
        rootfs = self.busybox_root(self.work / "image")
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

