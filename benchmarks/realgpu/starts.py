"""The real-GPU check's timed steps, mixed into its Node: start latency and starts at once per
registration, issue 27's table from them, the runtime shim, the device plugin's RPCs and a
profile of one in-process start."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

from .. import stats, targets
from ..stats import importtime_top
from .shell import GPU_ENV, sh



class StartSteps:
    """Methods of the check's node (``benchmarks/realgpu/node.py``) that time starts."""

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
