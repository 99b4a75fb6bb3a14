"""``benchmarks/realgpu.py --only metrics``: ``nvcontainer metrics`` scraped while a CUDA container
holds GPU memory, on a real GPU (issue 34).

What it checks, recorded in the report's ``metrics`` entry: the exporter answers with
dcgm-exporter's series for GPU 0 (temperature, power, framebuffer used, utilisation), the
container's GPU memory is attributed to it (``nvcontainer_container_gpu_memory_bytes`` with its
runc container ID, more than zero), and on Hopper and later the GPM ratios are there
(``DCGM_FI_PROF_SM_ACTIVE``, ``PIPE_TENSOR_ACTIVE``, ``DRAM_ACTIVE``). The container runs the
image's ``/cudatest`` held 30 seconds, as the ``ps`` step does; the exporter listens on
127.0.0.1 only and is stopped with a bounded wait; nothing on the GPU is changed.

The helpers at the top are pure and tested on made-up bodies (tests/test_realgpu_steps.py).
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path

from .shell import end_container, first_line, gpu_program, sh

PORT = 19499
WAIT = 60.0
GPM = ("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE")
GPU_SERIES = ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_UTIL")


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    """(labels, value) of each sample named ``name`` in a text-format body; a small reader of
    our own so a bare GPU node needs nothing beyond the package."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        labels = {}
        if "{" in head:
            body = head[head.index("{") + 1:head.rindex("}")]
            key, buf, i = "", "", 0
            while i < len(body):
                if not key:
                    eq = body.index("=", i)
                    key, i = body[i:eq], eq + 2          # past ="
                    buf = ""
                    continue
                ch = body[i]
                if ch == "\\" and i + 1 < len(body):
                    buf += {"n": "\n", "\\": "\\", '"': '"'}.get(body[i + 1], body[i + 1])
                    i += 2
                elif ch == '"':
                    labels[key], key = buf, ""
                    i += 2                                # past ",
                else:
                    buf += ch
                    i += 1
        out.append((labels, float(value)))
    return out


def judge(text: str, container_id: str, hopper: bool) -> dict:
    """What the scrape shows for GPU 0 and the container."""
    gpu0 = {name: [v for labels, v in samples(text, name) if labels.get("gpu") == "0"] for name in GPU_SERIES + GPM}
    mine = [v for labels, v in samples(text, "nvcontainer_container_gpu_memory_bytes")
            if labels.get("gpu") == "0" and labels.get("container_id") == container_id]
    return {"gpu0": {k: v[0] if v else None for k, v in gpu0.items()},
            "container_memory": mine[0] if mine else None,
            "attributed": bool(mine and mine[0] > 0),
            "gpm_present": all(gpu0[name] for name in GPM) if hopper else None,
            "dcgm_series": all(gpu0[name] for name in GPU_SERIES)}


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def metrics(node, template: Path) -> None:
    node.say("\n== nvcontainer metrics: a CUDA container's memory, and GPM, on GPU 0")
    runc, name, proc = gpu_program(node, template, 30)
    out: dict = {"container": name}
    config = node.work / "metrics.toml"
    config.write_text(node.extra_config)
    err = node.work / "metrics.err"
    url = f"http://127.0.0.1:{PORT}/metrics"
    exporter = subprocess.Popen([str(node.ours), "--config", str(config), "metrics", "--listen",
                                 f"127.0.0.1:{PORT}", "--kubernetes", "off"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    try:
        out["program"] = first_line(proc, WAIT)
        node.say(f"in the container: {out['program']}")
        cc = sh(["nvidia-smi", "-i", "0", "--query-gpu=compute_cap", "--format=csv,noheader"])["stdout"].strip()
        hopper = cc[:1].isdigit() and float(cc or 0) >= 9.0
        text, start = "", time.monotonic()
        while time.monotonic() - start < WAIT:
            try:
                _scrape(url)           # the first GPM sample pair
                time.sleep(1.0)
                start_scrape = time.perf_counter()
                text = _scrape(url)
                out["scrape_ms"] = round((time.perf_counter() - start_scrape) * 1000, 1)
                break
            except OSError:
                time.sleep(0.2)
        out.update(judge(text, name, hopper), compute_capability=cc)
        out["series"] = [ln for ln in text.splitlines()
                         if ln.startswith(("DCGM_FI_PROF_", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP",
                                           "nvcontainer_container_gpu", "nvcontainer_gpu_up"))][:40]
        node.say("\n".join(out["series"]))
        node.say(f"-> container {name}: {out['container_memory']} bytes on GPU 0 (attributed: {out['attributed']}); "
                 f"GPM ratios present: {out['gpm_present']}; dcgm series: {out['dcgm_series']}; "
                 f"scrape {out.get('scrape_ms')} ms")
    finally:
        exporter.terminate()
        try:
            exporter.wait(timeout=20)
        except subprocess.TimeoutExpired:
            exporter.kill()
            exporter.wait()
        out["exporter_stderr"] = err.read_text(errors="replace")[-4000:] if err.exists() else ""
        end_container(runc, name, proc, node.runc_env)
        node.report["metrics"] = out
