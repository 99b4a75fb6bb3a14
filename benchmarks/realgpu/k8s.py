"""The real-GPU check's Kubernetes-side steps (``mps``, ``dra``, ``ps``): what the
tests prove on the fake GPU machine, checked once against a real GPU and driver.

Why a module of its own: these steps share the image, bundles and hook registration of
:class:`benchmarks.realgpu.node.Node`, but each drives a node agent (the MPS control daemon, the DRA
kubelet plugin) or a reader of the node (``nvcontainer ps``) as Kubernetes would, and what a
container gets is computed by the product's own pure code (the device plugin's Allocate, the
claim's CDI spec applied as engines apply it), never restated here; so a real run checks the
same decisions the tests check. The helpers at the top are pure; the steps below them run
whole on the fake machine too (tests/test_realgpu_steps.py, through ``node.proc``, ``sysfs`` and
``extra_config`` and a stand-in runc), all but the GPU's own answers.

Nothing here changes the GPU's settings: MPS is run without touching the compute mode (it is
read before and after, and recorded), a DRA claim without a sharing configuration sets no
time-slice. Every process started is stopped with a bounded wait, every mount and directory
made is undone in :meth:`Node.cleanup` (through ``node.undo``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

from .shell import GPU_ENV, collect, end_container, first_line, gpu_program, sh

MPS_TABLE = {"sharing": "mps", "replicas": 2}
NODE_NAME = "realgpu-node"
SLICE_ATTRIBUTES = ("type", "uuid", "productName", "brand", "architecture", "pcieBusID",
                    "resource.kubernetes.io/pciBusID", "cudaComputeCapability", "driverVersion", "cudaDriverVersion")
SLICE_VERSIONS = ("cudaComputeCapability", "driverVersion", "cudaDriverVersion")
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(\+[0-9A-Za-z.]+)?")
BUS_ID = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
WAIT = 60.0
CLIENT_WAIT = 30.0                  # for both MPS clients to be listed by the control daemon


# --- pure: what a container is given, what a slice must say -------------------------------------

def mps_config(cache_dir: str, mps_root: str, socket_dir: str) -> str:
    """The configuration file both ``mps-daemon`` and the allocation below read."""
    table = "".join(f"{k} = {json.dumps(v)}\n" for k, v in MPS_TABLE.items())
    return (f"cache-dir = {json.dumps(cache_dir)}\n[device-plugin]\n{table}"
            f"mps-root = {json.dumps(mps_root)}\nsocket-dir = {json.dumps(socket_dir)}\n")


def mps_allocation(inv, device_plugin: dict, gpu_index: int = 0, replica: int = 0):
    """(the GPU's :class:`mps.Share`, the plugin's ContainerResponse for one of its replicas),
    computed by the device plugin's own code from ``device_plugin`` (the ``[device-plugin]``
    table) and the inventory, as the plugin answers Allocate."""
    from nvcontainer.deviceplugin import allocate, devices, mps, settings as settings_module

    settings = settings_module.parse(device_plugin)
    resources = devices.advertise(inv, settings)
    shares = {s.uuid: s for s in mps.shares(resources, settings)}
    for resource in resources:
        mine = [d for d in resource.devices if d.unit.mig is None and d.unit.gpu.index == gpu_index]
        if len(mine) > replica:
            return shares[mine[replica].unit.gpu.uuid], allocate.allocate(
                [mine[replica].id], resource, frozenset(), settings, f"realgpu-{replica}", shares)
    raise LookupError(f"GPU {gpu_index} is not advertised with {device_plugin}")


def with_allocation(spec: dict, response) -> dict:
    """``spec`` given what the kubelet passes on from an Allocate answer: its variables (replacing
    one of the same name) and its mounts as binds (replacing one at the same destination)."""
    process = spec.setdefault("process", {})
    env = [e for e in process.get("env", []) if e.split("=", 1)[0] not in dict(response.envs)]
    process["env"] = env + [f"{k}={v}" for k, v in response.envs]
    mounts = [m for m in spec.get("mounts", []) if m.get("destination") not in
              {r.container_path for r in response.mounts}]
    spec["mounts"] = mounts + [{"destination": r.container_path, "source": r.host_path, "type": "bind",
                                "options": ["rbind", "ro" if r.read_only else "rw"]} for r in response.mounts]
    return spec


def slice_problems(slices: list[dict]) -> list[str]:
    """What is wrong with a node's slices for a whole GPU: an attribute missing, a version that
    is not strict semver, a bus id not as NVIDIA writes it (``0000:07:00.0``)."""
    problems = []
    gpus = [d for s in slices for d in s["spec"]["devices"] if d["attributes"]["type"]["string"] == "gpu"]
    if not gpus:
        return ["no whole GPU in the slices"]
    for device in gpus:
        attrs = device["attributes"]
        where = device["name"]
        problems += [f"{where}: no attribute {name}" for name in SLICE_ATTRIBUTES if name not in attrs]
        for name in SLICE_VERSIONS:
            value = attrs.get(name, {}).get("version", "")
            if value and not SEMVER.fullmatch(value):
                problems.append(f"{where}: {name} {value!r} is not semver")
        for name in ("pcieBusID", "resource.kubernetes.io/pciBusID"):
            value = attrs.get(name, {}).get("string", "")
            if value and not BUS_ID.fullmatch(value):
                problems.append(f"{where}: {name} {value!r} is not a bus id as NVIDIA writes it")
        if "memory" not in device.get("capacity", {}):
            problems.append(f"{where}: no memory capacity")
    return problems


def with_cdi_device(spec: dict, spec_path: str, name: str) -> dict:
    """``spec`` with CDI device ``name``'s edits from the spec file, then that file's common
    edits, applied as engines apply them (the product's :mod:`nvcontainer.runtime.cdiedits`)."""
    from nvcontainer.cdi import check, store
    from nvcontainer.runtime import cdiedits

    cdi = store.read_spec(spec_path).spec
    kind = cdi["kind"]
    device = next(d for d in cdi["devices"] if f"{kind}={d['name']}" == name)
    cdiedits.apply(spec, device.get("containerEdits") or {}, f"{spec_path}: {name}", check.probe)
    cdiedits.apply(spec, cdi.get("containerEdits") or {}, f"{spec_path}: containerEdits", check.probe)
    return spec


def ps_container(doc: dict, container_id: str, gpu_index: int = 0) -> dict | None:
    """The container's entry under GPU ``gpu_index`` in ``nvcontainer ps --json``'s document
    (``{"gpus": [...]}``), or None."""
    for gpu in doc.get("gpus", []):
        if gpu.get("index") == gpu_index:
            return next((c for c in gpu.get("containers", []) if c.get("id") == container_id), None)
    return None


def kube_fixtures():
    """tests/fixtures/kubeapi.py and dra_kubelet.py; kubeapi declares pytest fixtures, and a GPU
    node has no pytest: a stand-in whose ``fixture`` leaves the function as it is."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        sys.modules["pytest"] = types.SimpleNamespace(fixture=lambda *a, **k: (a[0] if a and callable(a[0])
                                                                              else (lambda f: f)))
    from tests.fixtures.dra_kubelet import FakeDraKubelet
    from tests.fixtures.kubeapi import FakeApiServer, validate_slice
    return FakeApiServer, FakeDraKubelet, validate_slice


# --- the steps (a real GPU) ------------------------------------------------------------------------

def _inventory(node, config_path: Path):
    from nvcontainer.config.load import load
    from nvcontainer.inventory.cache import cached_inventory

    return cached_inventory(load(str(config_path)), proc=node.proc)


def _stop(proc: subprocess.Popen, timeout: float = 30) -> object:
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "killed"


def _tail(path: Path, n: int = 8000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _compute_mode() -> str:
    return sh(["nvidia-smi", "-i", "0", "--query-gpu=compute_mode", "--format=csv,noheader"])["stdout"].strip()


def _clients(control: list[str], env: dict, timeout: float) -> tuple[dict, dict]:
    """``get_server_list`` and the first server's ``get_client_list``, asked until it has as
    many clients as replicas or ``timeout`` passes; the last answers."""

    end = time.monotonic() + timeout
    while True:
        servers = sh(control, env=env, input=b"get_server_list\n", timeout=20)
        pids = servers["stdout"].split()
        clients = sh(control, env=env, input=f"get_client_list {pids[0]}\n".encode(), timeout=20) if pids else \
            {"argv": control, "rc": -1, "ms": 0, "stdout": "", "stderr": "no server"}
        if len(clients["stdout"].split()) >= MPS_TABLE["replicas"] or time.monotonic() > end:
            return servers, clients
        time.sleep(0.5)


def mps(node, template: Path) -> None:
    """Two runc containers at once on GPU 0's MPS daemon, each given what Allocate hands out."""
    from nvcontainer.deviceplugin import mps as mps_module
    from nvcontainer.deviceplugin.mpsdaemon import control_binary

    node.say("\n== MPS: nvcontainer mps-daemon and two containers on GPU 0's replicas")
    out: dict = {"compute_mode_before": _compute_mode()}
    root = node.work / "mps"
    config = node.work / "mps.toml"
    config.write_text(mps_config(str(node.work / "plugin-cache"), str(root), str(node.work / "mps-sockets"))
                      + node.extra_config)
    inv = _inventory(node, config)
    from nvcontainer.config.load import load
    table = load(str(config)).device_plugin      # the very table mps-daemon reads
    share, response = mps_allocation(inv, table)
    out["allocation"] = {"envs": dict(response.envs), "mounts": [[m.container_path, m.host_path]
                                                               for m in response.mounts]}
    node.say(f"allocate (the plugin's code): {out['allocation']}")
    nvc = [str(node.ours), "--config", str(config)]
    node.undo.append(lambda: shutil.rmtree(root, True))
    # each GPU's daemon gets its own /dev/shm (<dir>/shm, bound in its own mount namespace)
    debug, stderr = node.work / "mps-debug.log", open(node.work / "mps.stderr", "wb")
    daemon = subprocess.Popen([*nvc, "--debug", str(debug), "mps-daemon", "--interval", "1"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd="/")
    node.undo.append(lambda: _stop(daemon))
    try:
        end = time.monotonic() + WAIT
        while not os.path.exists(share.ready) and daemon.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        out["ready"] = Path(share.ready).read_text() if os.path.exists(share.ready) else None
        node.say(f"marker {share.ready}: {out['ready']!r}")
        control = [control_binary(inv)]
        env = mps_module.daemon_env(share)
        work = "/cudatest 10; nvidia-smi -L; echo CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY; ls /mps/*/*/pipe"
        bundles, procs = [], []
        for replica in range(MPS_TABLE["replicas"]):
            _, answer = mps_allocation(inv, table, replica=replica)
            bundle = node.bundle(template, [node.entries()["hook"]], GPU_ENV, ["/bin/sh", "-c", work])
            spec = json.loads((bundle / "config.json").read_text())
            (bundle / "config.json").write_text(json.dumps(with_allocation(spec, answer)))
            bundles.append(bundle)
            node.undo.append(lambda name=bundle.name: sh([*node.runc, "delete", "-f", name], env=node.runc_env))
        for bundle in bundles:
            procs.append(subprocess.Popen([*node.runc, "run", *node.no_pivot, "--bundle", str(bundle), bundle.name],
                                          env=node.runc_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE))
        # both clients hold the GPU for 10 s after their kernel: asked until the server has two
        out["servers_during"], out["clients_during"] = _clients(control, env, CLIENT_WAIT)
        node.block("get_server_list (during)", out["servers_during"])
        node.block("get_client_list (during)", out["clients_during"])
        runs = []
        for bundle, proc in zip(bundles, procs):
            result = collect(proc)
            node.block(f"MPS client {bundle.name}", result)
            runs.append(result)
            sh([*node.runc, "delete", "-f", bundle.name], env=node.runc_env)
            shutil.rmtree(bundle, ignore_errors=True)
        out["clients"] = runs
        out["control_log"] = _tail(Path(share.log) / "control.log")
        out["server_log"] = _tail(Path(share.log) / "server.log")
        out["new_clients_logged"] = out["control_log"].count("New client")
        node.say(f"control.log ({out['new_clients_logged']} 'New client' lines):\n{out['control_log'][-3000:]}")
    finally:
        out["daemon_exit"] = _stop(daemon)
        stderr.close()
        out["daemon_stderr"] = _tail(node.work / "mps.stderr", 4000)
        out["daemon_debug"] = _tail(debug)
        out["pipe_left"] = os.path.exists(share.control)
        out["compute_mode_after"] = _compute_mode()
        node.say(f"daemon exit {out['daemon_exit']}; control pipe left: {out['pipe_left']}; compute mode "
                 f"{out['compute_mode_before']!r} -> {out['compute_mode_after']!r}\n{out['daemon_stderr'].strip()}")
        node.report["mps"] = out


def dra(node, template: Path) -> None:
    """The slices of the real GPU; one claim prepared by ``nvcontainer dra-driver`` and run."""
    from nvcontainer.dra.publishing import publish, slices

    node.say("\n== DRA: the real GPU's slice, and a claim prepared, run and unprepared")
    try:      # dra-driver's API client: TOOLS/whl must hold it and what it needs (docs/real-gpu.md)
        import lightkube  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"no lightkube for the node's Python ({exc}): add its wheels to TOOLS/whl") from None
    out: dict = {}
    config = node.work / "dra.toml"
    config.write_text(f'cache-dir = "{node.work}/plugin-cache"\n' + node.extra_config)
    inv = _inventory(node, config)        # before any thread starts here (building it may fork)
    built = slices.build(inv, NODE_NAME, roots=publish.pcie_roots(node.sysfs, inv))
    FakeApiServer, FakeDraKubelet, validate_slice = kube_fixtures()
    out["slices"] = built
    out["problems"] = slice_problems(built)
    from nvcontainer.dra.kubeapi import _in_version      # each version's shape, as the publisher writes it
    out["api_validation"] = {v: [validate_slice(_in_version(s, v), v) for s in built]
                             for v in ("v1", "v1beta2", "v1beta1")}
    node.say(json.dumps(built, indent=1))
    node.say(f"-> slice problems: {out['problems'] or 'none'}; API validation: {out['api_validation']}")
    base = node.work / "dra"
    dirs = {name: base / name for name in ("registrar", "plugins", "cdi")}
    for d in dirs.values():
        d.mkdir(parents=True, mode=0o700, exist_ok=True)
    server = FakeApiServer()
    node.undo.append(server.stop)
    server.put_node(NODE_NAME)
    device = next(d["name"] for d in built[0]["spec"]["devices"] if d["attributes"]["type"]["string"] == "gpu")
    claim = server.put_claim({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                              "metadata": {"namespace": "default", "name": "realgpu", "uid": "0000-realgpu"},
                              "status": {"allocation": {"devices": {"results": [
                                  {"request": "gpu", "driver": slices.DRIVER, "pool": NODE_NAME,
                                   "device": device}], "config": []}}}})
    ref = ("default", "realgpu", claim["metadata"]["uid"])
    debug, stderr = base / "debug.log", open(base / "stderr", "wb")
    plugin = subprocess.Popen(
        [str(node.ours), "--config", str(config), "--debug", str(debug), "dra-driver", "--node-name", NODE_NAME,
         "--cdi-root", str(dirs["cdi"]), "--kubelet-registrar-directory-path", str(dirs["registrar"]),
         "--kubelet-plugins-directory-path", str(dirs["plugins"]), "--kubeconfig",
         server.write_kubeconfig(str(base / "kubeconfig")), "--hook-path", str(node.venv / "bin" / "nvcontainer-hook"),
         "--sysfs", node.sysfs],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd="/")
    node.undo.append(lambda: _stop(plugin))
    kubelet = FakeDraKubelet(dirs["registrar"], dirs["plugins"], timeout=45)
    try:
        out["registered"] = str(kubelet.wait_registered(WAIT))
        end = time.monotonic() + WAIT
        while ("registered with the kubelet" not in _tail(base / "stderr") or not server.node_slices(NODE_NAME)) \
                and plugin.poll() is None and time.monotonic() < end:
            time.sleep(0.1)            # registered, and its slices published
        got = kubelet.prepare(ref)[ref[2]]
        out["prepare"] = got
        out["published"] = server.node_slices(NODE_NAME)
        node.say(f"prepare: {got}; slices the plugin published: {len(out['published'])}")
        (error, [(_, names)]) = got
        spec_file = dirs["cdi"] / os.listdir(dirs["cdi"])[0]
        out["cdi_spec"] = spec_file.read_text()
        node.say(out["cdi_spec"])
        bundle = node.bundle(template, [], [], ["/bin/sh", "-c", "nvidia-smi -L; /cudatest; ls /dev | grep -i nvidia"
                                                              " | tr '\\n' ' '; echo"])
        spec = json.loads((bundle / "config.json").read_text())
        (bundle / "config.json").write_text(json.dumps(with_cdi_device(spec, str(spec_file), names[0])))
        out["run"] = node.run_bundle(bundle)
        node.block(f"runc with CDI device {names[0]}", out["run"])
        out["unprepare"] = kubelet.unprepare(ref)
        out["cdi_left"] = os.listdir(dirs["cdi"])
        node.say(f"unprepare: {out['unprepare']}; CDI specs left: {out['cdi_left'] or 'none'}")
        gpus = [d["name"] for d in built[0]["spec"]["devices"] if d["attributes"]["type"]["string"] == "gpu"]
        out["mps"] = dra_mps(node, template, server, kubelet, dirs, gpus, inv)
    finally:
        kubelet.close()
        out["exit"] = _stop(plugin)
        stderr.close()
        out["stderr"] = _tail(base / "stderr", 4000)
        out["debug"] = _tail(debug)
        node.say(f"dra-driver exit {out['exit']}\n{out['stderr'].strip()}")
        node.report["dra"] = out


DRA_MPS = {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "4Gi"}
DRA_CLIENT = "env | grep ^CUDA_MPS_ | sort | tr '\\n' ' '; echo; /cudatest 10"


def dra_mps_claim(gpus: list[str]) -> dict:
    """NVIDIA's MPS demo in one claim: request ``mps-gpu`` under an MPS config (two clients);
    with a second GPU, NVIDIA's gpu-test5 too: request ``ts-gpu`` time-sliced, in the same claim."""
    from nvcontainer.dra.publishing import slices

    def config(request, sharing):
        return {"source": "FromClaim", "requests": [request], "opaque": {"driver": slices.DRIVER, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": sharing}}}

    results = [{"request": "mps-gpu", "driver": slices.DRIVER, "pool": NODE_NAME, "device": gpus[0]}]
    configs = [config("mps-gpu", {"strategy": "MPS", "mpsConfig": DRA_MPS})]
    if len(gpus) > 1:
        results.append({"request": "ts-gpu", "driver": slices.DRIVER, "pool": NODE_NAME, "device": gpus[1]})
        configs.append(config("ts-gpu", {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}))
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": "default", "name": "realgpu-mps", "uid": "0000-realgpu-mps"},
            "status": {"allocation": {"devices": {"results": results, "config": configs}}}}


def dra_mps(node, template: Path, server, kubelet, dirs: dict, gpus: list[str], inv) -> dict:
    """Two CUDA clients of the claim's MPS GPU at once, under its limits (the daemon lists both);
    with a second GPU, a container of the claim's time-sliced GPU, which is no MPS client."""

    out: dict = {"compute_mode_before": _compute_mode()}
    claim = server.put_claim(dra_mps_claim(gpus))
    ref = ("default", "realgpu-mps", claim["metadata"]["uid"])
    error, devices = kubelet.prepare(ref)[ref[2]]
    out["prepare"] = [error, devices]
    node.say(f"MPS claim prepare: {error or devices}")
    if error:
        return out
    names = dict(devices)
    spec_file = str(dirs["cdi"] / next(n for n in os.listdir(dirs["cdi"]) if ref[2] in n))
    out["cdi_spec"] = Path(spec_file).read_text()
    runs = [("mps-1", names[gpus[0]][0]), ("mps-2", names[gpus[0]][0])]
    if len(gpus) > 1:
        runs.append(("time-sliced", names[gpus[1]][0]))
    procs = []
    for label, cdi_name in runs:
        bundle = node.bundle(template, [], [], ["/bin/sh", "-c", DRA_CLIENT])
        spec = json.loads((bundle / "config.json").read_text())
        (bundle / "config.json").write_text(json.dumps(with_cdi_device(spec, spec_file, cdi_name)))
        node.undo.append(lambda name=bundle.name: sh([*node.runc, "delete", "-f", name], env=node.runc_env))
        procs.append((label, bundle, subprocess.Popen(
            [*node.runc, "run", *node.no_pivot, "--bundle", str(bundle), bundle.name], env=node.runc_env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    pipe = dirs["plugins"] / "gpu.nvidia.com" / "mps" / ref[2] / "config-0" / "pipe"
    from nvcontainer.mps.control import control_binary
    control = [control_binary(inv)]
    out["servers_during"], out["clients_during"] = _clients(control, {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
                                                            CLIENT_WAIT)
    node.block("claim daemon: get_server_list (during)", out["servers_during"])
    node.block("claim daemon: get_client_list (during)", out["clients_during"])
    out["compute_mode_during"] = _compute_mode()
    out["clients"] = {}
    for label, bundle, proc in procs:
        result = collect(proc)
        node.block(f"claim container {label}", result)
        out["clients"][label] = result
        sh([*node.runc, "delete", "-f", bundle.name], env=node.runc_env)
        shutil.rmtree(bundle, ignore_errors=True)
    out["compat"] = dra_compat(node, template, spec_file, names[gpus[0]][0], inv)
    out["unprepare"] = kubelet.unprepare(ref)
    out["compute_mode_after"] = _compute_mode()
    node.say(f"MPS claim: clients listed {out['clients_during']['stdout'].split()}; compute mode "
             f"{out['compute_mode_before']!r} -> {out['compute_mode_during']!r} -> {out['compute_mode_after']!r}")
    return out


COMPAT_CHECK = ("LD_DEBUG=libs /cudatest 1 > /tmp/out 2>&1; echo \"rc=$?\"; "
                "grep -o '[^ ]*libcuda[.]so[^ ]*' /tmp/out | sort -u | tr '\\n' ' '; echo; grep -v '^ *[0-9]*:' /tmp/out")


def dra_compat(node, template: Path, spec_file: str, cdi_name: str, inv) -> dict:
    """CUDA forward compatibility through the claim's spec: an image whose
    ``/usr/local/cuda/compat`` holds a ``libcuda.so.999.0.0`` (the node's own libcuda, renamed, so
    it works with this driver) gets it first from the spec's update-ldcache hook
    (``--host-driver-version``): the CUDA program's loader names the compat path, and it runs."""
    host = next((lib.path for lib in inv.libraries if os.path.basename(lib.path).startswith("libcuda.so.")), None)
    if host is None or not getattr(node, "has_cuda", False):   # the fake machine's node has no CUDA program
        node.say("compat: no libcuda or no CUDA program: left out")
        return {"skipped": True}
    bundle = node.bundle(template, [], [], ["/bin/sh", "-c", COMPAT_CHECK])
    compat = bundle / "rootfs" / "usr" / "local" / "cuda" / "compat"
    compat.mkdir(parents=True)
    shutil.copy(host, compat / "libcuda.so.999.0.0")
    spec = json.loads((bundle / "config.json").read_text())
    (bundle / "config.json").write_text(json.dumps(with_cdi_device(spec, spec_file, cdi_name)))
    result = node.run_bundle(bundle)
    node.block("claim container with a compat libcuda 999", result)
    lines = result["stdout"].splitlines()
    out = {"result": result, "loaded": [w for w in (lines[1].split() if len(lines) > 1 else []) if w.startswith("/")],
           "ran": bool(lines) and lines[0] == "rc=0"}
    out["used"] = out["ran"] and any(p.startswith("/usr/local/cuda/compat/") for p in out["loaded"])
    node.say(f"-> compat: loader found {out['loaded']}; CUDA program ran: {out['ran']}; compat used: {out['used']}")
    return out


def ps(node, template: Path) -> None:
    """A container holding GPU memory, as ``nvcontainer ps --json`` shows it under GPU 0."""

    node.say("\n== nvcontainer ps: a running container on GPU 0")
    config = node.work / "ps.toml"
    config.write_text(node.extra_config)          # the defaults, on a real node
    nvc = [str(node.ours), "--config", str(config)]
    runc, name, proc = gpu_program(node, template, 60)
    out: dict = {"container": name}
    try:
        out["program"] = first_line(proc, WAIT)
        node.say(f"in the container: {out['program']}")
        result = sh([*nvc, "ps", "--json"], timeout=60)
        node.block("nvcontainer ps --json", result)
        out["ps"] = result
        entry = ps_container(json.loads(result["stdout"]) if result["rc"] == 0 else {}, name)
        out["entry"] = entry
        out["seen"] = bool(entry and entry["processes"] and any(p["memory"] for p in entry["processes"]))
        node.say(f"-> container {name} under GPU 0: {json.dumps(entry)}; a CUDA process with memory: {out['seen']}")
        out["text"] = sh([*nvc, "ps"], timeout=60)
        node.block("nvcontainer ps", out["text"])
    finally:
        end_container(runc, name, proc, node.runc_env)
        node.report["ps"] = out
