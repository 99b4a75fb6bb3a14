"""The runtime shim's cost: a container's whole lifecycle through ``nvidia-container-runtime``
against runc alone, interleaved run by run.

    .venv/bin/python -m benchmarks.shim [--runs N]      # as root, from the repository root

The shim is on every container's path and is called for each step of its life, so the row that
matters is a container that asks for no GPU: ``create``, ``start``, ``state``, ``kill`` and
``delete --force`` of a busybox ``sleep``, each step a separate runtime call as an engine makes
them (containerd's runc shim and conmon do). Arms, in each round in turn:

* ``runc``: runc alone;
* ``shim``: the native front in front of runc (the program ``nvidia-container-runtime``);
* ``shim-python``: a spec that names ``NVIDIA_VISIBLE_DEVICES=void``, so that the front hands
  the ``create`` to the Python half (a production-like install: no editable finder), which
  decides it is not a GPU request and leaves the spec alone; the cost of a container the front
  cannot rule out by itself.

Target (issue 16): the ``shim`` arm within 2 ms of ``runc`` (the paired median of the
differences). Because runc's own time varies by more than that from one lifecycle to the next on a
busy machine, the front's own cost per call is measured too, with little noise: the front built
to run ``/bin/true`` as its low-level runtime against ``/bin/true`` alone, interleaved, many times
(a non-create call: what ``start``, ``state``, ``kill`` and ``delete`` cost it). The record goes to ``benchmarks/results/shim-<time>.json`` and ``shim-latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nvcontainer.native import build as native

from . import stats, workspace

RESULTS = workspace.REPO / "benchmarks" / "results"
TARGET_MS = 2.0
STEPS = (("create", "--bundle", "{bundle}", "{id}"), ("start", "{id}"), ("state", "{id}"), ("kill", "{id}", "KILL"),
         ("delete", "--force", "{id}"))


def bundle(base: Path, template: Path, env: list[str], name: str) -> Path:
    b = base / "bundles" / name
    b.mkdir(parents=True)
    subprocess.run(["runc", "spec"], cwd=b, check=True)
    spec = json.loads((b / "config.json").read_text())
    spec["process"].update(terminal=False, args=["/bin/sleep", "30"], env=["PATH=/bin", *env])
    spec["root"] = {"path": str(template), "readonly": True}   # one read-only rootfs for all
    spec["linux"]["cgroupsPath"] = f"/nvc-bench/{name}"
    (b / "config.json").write_text(json.dumps(spec))
    return b


def lifecycle(program: str, state: Path, b: Path, name: str) -> float:
    """Milliseconds for the five calls; raises if one fails."""
    errors = b / "errors"
    with open(errors, "w+") as err:   # a file: the container keeps the stdio of create open
        start = time.perf_counter()
        for step in STEPS:
            argv = [program, "--root", str(state), *(a.format(bundle=b, id=name) for a in step)]
            if subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err).returncode:
                raise RuntimeError(f"{' '.join(argv)}: {errors.read_text().strip()}")
        return (time.perf_counter() - start) * 1000


def per_call(python: Path, base: Path, calls: int) -> dict:
    """The front's cost per call: itself in front of /bin/true, against /bin/true, interleaved."""
    config = base / "true.toml"
    config.write_text('[nvidia-container-runtime]\nruntimes = ["/bin/true"]\n')
    front = base / "front-true"
    native.build_runtime(str(front), str(python), str(config))
    out: dict[str, list[float]] = {"true": [], "front+true": []}
    for _ in range(calls):
        for arm, argv in (("true", ["/bin/true"]), ("front+true", [str(front), "state", "x"])):
            start = time.perf_counter()
            subprocess.run(argv, check=True)
            out[arm].append((time.perf_counter() - start) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shim", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="lifecycles per arm (default 40)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="nvc-bench-shim-"))
    try:
        python, _, _ = workspace.production_venv(base / "venv")
        config = base / "config.toml"
        config.write_text('[nvidia-container-runtime]\nruntimes = ["runc"]\n')
        front = base / "nvidia-container-runtime"
        native.build_runtime(str(front), str(python), str(config))
        template = workspace.busybox_rootfs(base / "rootfs")
        state = base / "state"
        arms = {"runc": ("runc", []), "shim": (str(front), ["HOME=/root"]),
                "shim-python": (str(front), ["NVIDIA_VISIBLE_DEVICES=void"])}
        samples: dict[str, list[float]] = {arm: [] for arm in arms}
        for i in range(args.runs + 2):            # two rounds of warm-up, not recorded
            for arm, (program, env) in arms.items():
                name = f"{arm}-{i}"
                ms = lifecycle(program, state, bundle(base, template, env, name), name)
                if i >= 2:
                    samples[arm].append(ms)
        floor = per_call(python, base, args.runs * 10)
        over = stats.paired_median(samples["shim"], samples["runc"])
        per_call_ms = stats.paired_median(floor["front+true"], floor["true"])
        over_python = stats.paired_median(samples["shim-python"], samples["runc"])
        record = {
            "machine": {"cpu": platform.processor() or "?", "cpus": os.cpu_count(), "kernel": platform.release(),
                        "python": sys.version.split()[0], "loadavg_start": os.getloadavg()[0]},
            "runs": args.runs, "steps": [s[0] for s in STEPS],
            "arms": {arm: {"summary": stats.summary(s), "ms": s} for arm, s in samples.items()},
            "shim_over_runc_ms": over, "shim_python_over_runc_ms": over_python, "target_ms": TARGET_MS,
            "per_call": {arm: stats.summary(s) for arm, s in floor.items()}, "front_per_call_ms": per_call_ms,
            "target_met": over is not None and over <= TARGET_MS,
        }
        lines = [f"{'arm':<14}{'median':>9}{'p95':>9}{'min':>9}{'max':>9}   (ms, one lifecycle: "
                 f"{', '.join(s[0] for s in STEPS)})"]
        for arm, s in samples.items():
            m = stats.summary(s)
            lines.append(f"{arm:<14}{m['median']:9.2f}{m['p95']:9.2f}{m['min']:9.2f}{m['max']:9.2f}")
        lines.append(f"shim over runc (paired median): {over:.2f} ms, target {TARGET_MS} ms: "
                     f"{'met' if record['target_met'] else 'NOT MET'}")
        lines.append(f"shim-python over runc (paired median): {over_python:.2f} ms")
        lines.append(f"the front per call (in front of /bin/true, paired median of {len(floor['true'])}): "
                     f"{per_call_ms:.3f} ms; x{len(STEPS)} calls = {per_call_ms * len(STEPS):.2f} ms per lifecycle")
        sys.stdout.write("\n".join(lines) + "\n")
        workspace.save(args.out, "shim", record)
        return 0
    finally:
        subprocess.run(["sh", "-c", f"for c in $(runc --root {base}/state list -q 2>/dev/null); do "
                                    f"runc --root {base}/state delete -f $c; done"], capture_output=True)
        for parent in Path("/sys/fs/cgroup").glob("*/nvc-bench"):   # runc leaves the parent behind
            try:
                parent.rmdir()
            except OSError:
                pass
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
