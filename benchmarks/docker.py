"""Docker's ``--runtime=nvidia`` (issue 27, target 4): ``docker run --rm`` of busybox ``true``
under a private dockerd on the fake GPU machine, each runtime beside plain runc, alternating.

    .venv/bin/python -m benchmarks.docker [--runs N]      # as root, from the repository root

Why a benchmark of its own: NVIDIA's install guide registers ``nvidia-container-runtime`` with
Docker, so every GPU ``create`` runs the shim's Python half (an interpreter start, the
configuration, the inventory, the spec edit and its atomic write) before runc and then the hook;
what a user feels is the whole ``docker run``, daemon, containerd shim and all. One dockerd
(``tests/fixtures/dockerd.py``'s private daemon: its own data root, ``/run`` tmpfs, PID and
mount namespaces, vfs, no network) serves every arm, so the daemon's cost cancels out. Arms, in
each round in turn (the order rotates round by round):

* ``runc``: plain runc, the default runtime;
* ``shim-nogpu``: ``--runtime=nvidia`` without a GPU request (the native front alone);
* ``served``: ``--runtime=nvidia -e NVIDIA_VISIBLE_DEVICES=0``, the shim registered as
  ``nvcontainer setup docker`` writes it (``runtimes.nvidia.path``), its hook the native client
  of the resident ``nvcontainer serve``;
* ``inprocess``: a node whose ``nvcontainer serve`` is down: the same front, finding no server,
  runs its Python half, and the in-process hook (``nvcontainer-hook --socket=``) does the run in
  its own interpreter (without ``--socket=`` it would ask the server this world has);
* ``nvidia`` / ``nvidia-nogpu``: NVIDIA's runtime 1.17.9 (legacy mode) + hook + cli 1.17.0 from
  ``../shared/anchors`` (benchmarks/nvidia.py), with and without the GPU; left out, and said so,
  without the tarball.

Every container gets ``--tmpfs /proc/driver`` (runc's included, so it cancels): the fake
machine's containers have no ``/proc/driver/nvidia``, which a real driver's procfs has and both
hooks mount over; each GPU hook is registered behind a tiny static program that makes that
directory in the container and then executes the real hook with the same state (workspace.py's
``mkdir-proc-driver``, made to chain).

The first start of each arm after dockerd came up is reported apart and kept out of the
statistics; the arm that goes first (``--first``, default runc) has the daemon's very first
container. Results: ``benchmarks/results/docker-<time>.json`` and ``docker-latest.json``, with the
load average before and after (these machines are shared).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from tests.fixtures import dockerd

from . import dockernode, nvidia, stats, workspace
from .dockernode import NOGPU_TARGET_MS, RATIO_TARGET, RESULTS, run_world, setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.docker", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per arm, after the first (default 20)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--anchors", type=Path, default=nvidia.TARBALL,
                        help=f"NVIDIA's tools (default {nvidia.TARBALL}; a worktree names the lead's)")
    parser.add_argument("--first", default="runc", help="the arm that runs first after dockerd came up, whose "
                        "'first' is the daemon's very first container (default runc)")
    parser.add_argument("--debug", type=Path, help="a directory for the shim's and our hook's traces (timestamps "
                        "per step; they cost time, so the figures of such a run are not the record's)")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    ws, machine = workspace.with_machine("nvc-bench-docker-")
    base = ws.base.parent
    try:
        dockerd.prepare(base)
        daemon, etc, arms, about = setup(base, ws, machine, args.anchors, args.debug)
        if args.first not in arms:
            parser.error(f"--first: no arm {args.first!r} (arms: {', '.join(arms)})")
        arms = {args.first: arms[args.first], **arms}
        if args.debug:
            args.debug.mkdir(parents=True, exist_ok=True)
            args.out = args.debug
        samples, errors = run_world(base, ws, machine, daemon, etc, arms, args.runs + 1)
        load_end = os.getloadavg()
        j = dockernode.judged(samples)
        first, timed, over = j["first"], j["timed"], j["over"]
        if (any(j["failed"].values()) or any(f is None or f[1] for f in first.values())
                or any(len(s) != args.runs for s in timed.values())):
            sys.stderr.write(f"benchmarks.docker: failed runs {j['failed']}, first runs {first}\n{errors}\n"
                             f"{dockerd.log(base)[-1500:]}\n")
            return 1
        ratio = {arm: dockernode.ratio_to_nvidia(over, arm) for arm in ("served", "inprocess")}
        record = {
            "machine": {"cpu": platform.processor() or "?", "cpus": os.cpu_count(), "kernel": platform.release(),
                        "python": sys.version.split()[0], "docker": _version(["dockerd", "--version"]),
                        "runc": _version(["runc", "--version"]), "loadavg_start": load_start,
                        "loadavg_end": load_end},
            "runs": args.runs, "nvidia_arm": about, "first_start": first, "first_arm": args.first,
            "arms": {arm: {"summary": stats.summary(s), "ms": s} for arm, s in timed.items()},
            "over_runc_ms": over, "ratio_to_nvidia": ratio,
            "targets": {"served": f"<= {RATIO_TARGET}x", "inprocess": f"<= {RATIO_TARGET}x",
                        "shim-nogpu": f"<= {NOGPU_TARGET_MS} ms"},
        }
        lines = [f"docker run --rm busybox true, {args.runs} runs per arm after the first, alternating; "
                 f"load {load_start[0]:.1f} -> {load_end[0]:.1f}; {about}",
                 *dockernode.table(j, ("median", "p95", "min", "max"), first=True)]
        lines += [dockernode.verdict(f"{arm} overhead / NVIDIA's", ratio[arm], RATIO_TARGET, "x")
                  for arm in ("served", "inprocess") if ratio[arm] is not None]
        lines.append(dockernode.verdict("no GPU through the shim over runc", over["shim-nogpu"], NOGPU_TARGET_MS,
                                        " ms"))
        sys.stdout.write("\n".join(lines) + "\n")
        workspace.save(args.out, "docker", record)
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _version(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
