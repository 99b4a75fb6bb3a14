"""``sudo .venv/bin/python -m benchmarks [--runs N]`` from the repository root: container start
latency on the fake GPU machine (see ``benchmarks/__init__.py`` for what is measured and
``docs/performance.md`` for the results). :mod:`benchmarks.run` collects, :mod:`benchmarks.report`
makes the table; this is only the command line."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import nvidia, workspace
from .machine import RESULTS, cleanup_cache, machine_facts
from .report import report
from .run import PARTS, collect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per series (default 30)")
    parser.add_argument("--concurrency", type=int, default=32, help="containers started at once (default 32)")
    parser.add_argument("--nvml-delay-ms", type=int, default=300, help="slow NVML initialisation (default 300)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON record")
    parser.add_argument("--keep", action="store_true", help="keep the temporary workspace")
    parser.add_argument("--only", action="append", choices=PARTS, help="run only these parts (repeatable)")
    parser.add_argument("--anchors", type=Path, default=nvidia.TARBALL,
                        help="NVIDIA's tools to time beside ours (default: %(default)s; absent: no NVIDIA arm)")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=TREE",
                        help="also time the hook of another tree (a directory holding nvcontainer/, or git:REV) "
                             "in the cgroup v1 series")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root (runc, mount namespaces, device nodes)")
    for tool in ("runc", "gcc", "unshare", "busybox"):
        if shutil.which(tool) is None and not Path(f"/bin/{tool}").exists():
            parser.error(f"{tool} is not installed")
    facts = machine_facts()
    base = Path(tempfile.mkdtemp(prefix="nvc-bench-"))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        compare = dict(item.split("=", 1) for item in args.compare)
        ws = workspace.create(base, compare)
        results = collect(ws, args.runs, args.concurrency, args.nvml_delay_ms, base, args.only or PARTS,
                          args.anchors)
    finally:
        cleanup_cache(base)
        if not args.keep:
            workspace.remove(base)
    facts["loadavg_end"] = os.getloadavg()[0]
    text, derived = report(results, facts, args.runs, args.concurrency, args.nvml_delay_ms)
    sys.stdout.write(text)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"started": started, "machine": facts, "runs": args.runs, "concurrency": args.concurrency,
              "nvml_delay_ms": args.nvml_delay_ms, **derived, "samples": results, "table": text}
    name = f"{started.replace(':', '')}.json"
    (args.out / name).write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "latest.json").write_text(json.dumps(record, indent=1) + "\n")
    sys.stdout.write(f"\nwritten: {args.out / name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
