"""``python -m benchmarks.realgpu --work DIR --tools DIR --venv DIR --out DIR [--runs N] [--only
STEPS]``: what ``benchmarks/realgpu.sh`` runs on a bare GPU node (``benchmarks/realgpu/__init__.py``
says what the steps check)."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

from .. import nvidia
from . import engines, installer, k8s, metrics
from .node import Node
from .starts import StartSteps



class GpuNode(Node, StartSteps):
    """The node with its timed steps."""


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.realgpu", description="What nvcontainer does on a node with a real NVIDIA GPU and driver, beside NVIDIA's own tools.")
    parser.add_argument("--work", required=True, help="scratch directory (removed by the caller)")
    parser.add_argument("--tools", required=True, help="runc, busybox, their libraries, NVIDIA's tools, wheels")
    parser.add_argument("--venv", required=True, help="the environment nvcontainer is installed in")
    parser.add_argument("--out", required=True, help="where realgpu.json and realgpu.txt are written")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--at-once", type=int, default=32, help="starts spawned together (concurrent step)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the concurrent step")
    parser.add_argument("--only", default="facts,parity,extras,deviceplugin,configure,runc,timing,concurrent,"
                                          "profile,shim,engines,mps,dra,ps,installer,metrics", help="the steps to run, comma-separated (default: %(default)s)")
    args = parser.parse_args()
    node = GpuNode(args)
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
        if {"configure", "runc", "timing", "concurrent", "profile", "shim", "mps", "dra", "ps", "installer",
            "metrics", "engines"} & set(parts):
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
                               ("engines", lambda: engines.engines(node, template, args.runs)),
                               ("mps", lambda: k8s.mps(node, template)),
                               ("dra", lambda: k8s.dra(node, template)),
                               ("ps", lambda: k8s.ps(node, template)),
                               ("installer", lambda: installer.installer(node, template)),
                               ("metrics", lambda: metrics.metrics(node, template))):
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
