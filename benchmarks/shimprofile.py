"""Where the milliseconds of the runtime shim's GPU ``create`` go: its Python half
(``python -I -m nvcontainer.runtime``, what the native front runs for a spec that may ask for a
GPU), step by step, on the fake GPU machine.

    .venv/bin/python -m benchmarks.shimprofile [--runs N]      # as root, from the repository root

Each round, in turn, each a fresh process from the production-like interpreter
(benchmarks/workspace.py), timed from spawn to exit:

* ``python -I -S -c pass``: the bare interpreter;
* ``python -I -c pass``: with ``site`` (the install's ``.pth``);
* ``import prepare``: ``python -I -c "import nvcontainer.runtime.prepare"``, the half's imports
  before it reads anything;
* ``create``: the whole half on a docker-like GPU bundle (``NVIDIA_VISIBLE_DEVICES=0``), as the
  front runs it (``--reply-fd``), the spec put back before each run, untimed;
* ``create (no GPU)``: the same with ``NVIDIA_VISIBLE_DEVICES=void`` (decided, left alone);
* ``steps``: one more run of the same create in a harness that wraps the half's own functions
  (configuration, spec read, inventory, the edit without it, the write) with clock reads, so the
  whole is split into the steps of issue 27's "How"; the rest is the interpreter and imports.

Then once: ``-X importtime`` of the create (the heaviest imports, cumulative). The inventory
comes from the per-boot cache (``/run/nvcontainer``, a private tmpfs here), warmed first, as on a
node. Results: ``benchmarks/results/shimprofile-<time>.json`` and ``shimprofile-latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.fixtures.fakegpu.runner import fake_proc_command

from . import stats, workspace

RESULTS = workspace.REPO / "benchmarks" / "results"

# Run in a fresh `python -I`: the half's run() with its steps timed (monotonic ns, printed as JSON).
HARNESS = r"""
import sys, time, json
t0 = time.perf_counter_ns()
from nvcontainer.runtime import prepare, bundle, edit as editmod
from nvcontainer.config import load as loadmod
from nvcontainer.inventory import cache
t_import = time.perf_counter_ns()
steps = {"import": (t_import - t0) / 1e6}
def timed(owner, name, key):
    real = getattr(owner, name)
    def wrapper(*a, **k):
        s = time.perf_counter_ns()
        try:
            return real(*a, **k)
        finally:
            steps[key] = steps.get(key, 0) + (time.perf_counter_ns() - s) / 1e6
    setattr(owner, name, wrapper)
timed(loadmod, "load", "config")
timed(bundle, "read", "read spec")
timed(cache, "cached_inventory", "inventory (cached)")
timed(editmod, "edit", "edit and inventory")
timed(bundle, "write_back", "write")
s = time.perf_counter_ns()
status, runtime = prepare.run(sys.argv[1:])
steps["run"] = (time.perf_counter_ns() - s) / 1e6
steps["edit (inventory apart)"] = steps.pop("edit and inventory") - steps.get("inventory (cached)", 0)
print(json.dumps({"status": status, "steps": steps}))
"""

# In the fake machine's /proc view: a private /run with the cache directory, as on a node.
WORLD = 'mount -t tmpfs -o mode=755 nvc-run /run && mkdir -m 700 /run/nvcontainer && exec "$@"'


def inner(job: dict) -> dict:
    python, config, bundles = job["python"], job["config"], job["bundles"]

    def half(b: str) -> list[str]:
        return ["-I", "-m", "nvcontainer.runtime", "--config", config, "--cwd", "/", "--reply-fd", "1", "--",
                "create", "--bundle", b, "x"]

    def reset(b: str) -> None:
        shutil.copyfile(os.path.join(b, "config.pristine"), os.path.join(b, "config.json"))

    arms = {"python -I -S -c pass": (None, [python, "-I", "-S", "-c", "pass"]),
            "python -I -c pass": (None, [python, "-I", "-c", "pass"]),
            "import prepare": (None, [python, "-I", "-c", "import nvcontainer.runtime.prepare"]),
            "create": (bundles["gpu"], [python, *half(bundles["gpu"])]),
            "create (no GPU)": (bundles["void"], [python, *half(bundles["void"])])}
    reset(bundles["gpu"])
    warm = subprocess.run([python, *half(bundles["gpu"])], capture_output=True, text=True)   # fills the cache
    if warm.returncode:
        raise SystemExit(f"the shim's half failed: {warm.stderr}")
    out: dict = {arm: [] for arm in arms}
    steps: list[dict] = []
    for _ in range(job["runs"]):
        for arm, (b, argv) in arms.items():
            if b:
                reset(b)
            start = time.perf_counter()
            res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            out[arm].append((time.perf_counter() - start) * 1000)
            if res.returncode:
                raise SystemExit(f"{arm}: {res.stderr.decode(errors='replace')}")
        reset(bundles["gpu"])
        start = time.perf_counter()
        res = subprocess.run([python, "-I", "-c", HARNESS, *half(bundles["gpu"])[3:]], capture_output=True, text=True)
        whole = (time.perf_counter() - start) * 1000
        if res.returncode or not res.stdout.strip():
            raise SystemExit(f"harness: {res.stderr[-2000:]}")
        record = json.loads(res.stdout.splitlines()[-1])["steps"]
        record["whole process"] = whole
        steps.append(record)
    reset(bundles["gpu"])
    imp = subprocess.run([python, "-X", "importtime", *half(bundles["gpu"])], capture_output=True, text=True).stderr
    rows = []
    for line in imp.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0].split(":")[1]), parts[2].rstrip()))
    top = [{"cumulative_us": us, "self_us": own, "module": name} for us, own, name in sorted(rows, reverse=True)[:25]]
    top_self = [{"self_us": own, "module": name.strip()} for us, own, name in
                sorted(rows, key=lambda r: -r[1])[:15]]
    return {"arms": out, "steps": steps, "importtime": top, "importtime_self": top_self, "modules": len(rows),
            "import_self_total_us": sum(r[1] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--inner":
        job = json.loads(Path(sys.argv[2]).read_text())
        Path(job["result"]).write_text(json.dumps(inner(job)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shimprofile", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    ws, machine = workspace.with_machine("nvc-bench-shimprofile-")
    base = ws.base.parent
    try:
        config = base / "config.toml"
        config.write_text(f'[nvidia-container-cli]\nroot = "{machine.root}"\n'
                          f'[nvidia-container-runtime]\nruntimes = ["runc"]\n'
                          f'[nvidia-container-runtime-hook]\npath = "{ws.native_client}"\n')
        bundles = {}
        for name, env in (("gpu", ["NVIDIA_VISIBLE_DEVICES=0"]), ("void", ["NVIDIA_VISIBLE_DEVICES=void"])):
            b = ws.bundle([], env=env)
            spec = json.loads((b / "config.json").read_text())
            spec["hooks"] = {}
            (b / "config.pristine").write_text(json.dumps(spec))
            bundles[name] = str(b)
        job = base / "job.json"
        result = base / "result.json"
        job.write_text(json.dumps({"python": str(ws.python), "config": str(config), "bundles": bundles,
                                   "runs": args.runs, "result": str(result)}))
        cmd = fake_proc_command(machine, ["sh", "-c", WORLD, "sh", sys.executable, "-m", "benchmarks.shimprofile",
                                          "--inner", str(job)])
        res = subprocess.run(cmd, env=workspace.world_python_env(), cwd=workspace.REPO, capture_output=True,
                             text=True)
        if res.returncode:
            sys.stderr.write(res.stderr[-3000:])
            return 1
        data = json.loads(result.read_text())
        load_end = os.getloadavg()
        steps = {key: stats.summary([s[key] for s in data["steps"] if key in s]) for key in data["steps"][0]}
        record = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "loadavg_start": load_start,
                              "loadavg_end": load_end}, "runs": args.runs,
                  "arms": {arm: {"summary": stats.summary(s), "ms": s} for arm, s in data["arms"].items()},
                  "steps": steps, "importtime_top": data["importtime"], "importtime_self_top": data["importtime_self"],
                  "modules_imported": data["modules"], "import_self_total_us": data["import_self_total_us"]}
        lines = [f"the shim's Python half, {args.runs} rounds, load {load_start[0]:.1f} -> {load_end[0]:.1f}",
                 f"{'':<34}{'median':>9}{'p95':>9}{'min':>9}{'max':>9}  ms"]
        for arm, s in [*data["arms"].items()]:
            m = stats.summary(s)
            lines.append(f"{arm:<34}{m['median']:9.1f}{m['p95']:9.1f}{m['min']:9.1f}{m['max']:9.1f}")
        lines.append("create, split (one harness run per round):")
        for key, m in steps.items():
            lines.append(f"  {key:<32}{m['median']:9.2f}{m['p95']:9.2f}{m['min']:9.2f}{m['max']:9.2f}")
        lines.append(f"-X importtime: {data['modules']} modules, {data['import_self_total_us'] / 1000:.1f} ms in all "
                     "(inflated by the tracing); heaviest by own time (us):")
        for row in data["importtime_self"][:12]:
            lines.append(f"  {row['self_us']:8d} {row['module']}")
        sys.stdout.write("\n".join(lines) + "\n")
        workspace.save(args.out, "shimprofile", record)
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
