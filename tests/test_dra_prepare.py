"""Preparing and unpreparing claims on the fake GPU machines, in process: the transient CDI
spec (what ``cdi generate`` gives the same devices, under the claim's names), the checkpoint
(idempotent, kept over a restart, rebuilt when damaged), one claim at a time, and the faults
(claim deleted, API server slow). The claim source is a dict behind the same call the API
client offers; the API server itself is test_dra_driver's."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from nvcontainer.cdi import generate, store
from nvcontainer.dra.node import checkpoint, claimspec
from nvcontainer.dra.command import device_table
from nvcontainer.dra.node.prepare import Preparer
from nvcontainer.errors import NvcError
from nvcontainer.inventory.build import build
from tests.fixtures.fakegpu import FakeSpec
from tests.test_deviceplugin_mps import has, record, told
from tests.test_deviceplugin_mps import shm_seen as shm_of

HOOK = "/usr/local/bin/nvcontainer-hook"
NODE = "node-a"
UID1 = "3f1c8f36-0000-4000-8000-000000000001"
UID2 = "3f1c8f36-0000-4000-8000-000000000002"
MIG2 = FakeSpec(gpus=2, mig=True, mig_gpus=1, mig_devices=2, mig_profiles=("1g.10gb", "2g.20gb"))


class Claims:
    """ResourceClaims by (namespace, name), served as the API client serves them."""

    def __init__(self, delay: float = 0.0):
        self.objects: dict[tuple[str, str], dict] = {}
        self.calls = 0
        self.delay = delay
        self.lock = threading.Lock()

    def put(self, uid: str, devices, name: str = "c", namespace: str = "ns", configs=()) -> tuple[str, str, str]:
        results = [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": d} for d in devices]
        self.objects[(namespace, name)] = {
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
            "status": {"allocation": {"devices": {"results": results, "config": list(configs)}}}}
        return namespace, name, uid

    def get(self, namespace: str, name: str, deadline: float) -> dict:
        with self.lock:
            self.calls += 1
        if self.delay:
            time.sleep(min(self.delay, max(deadline - time.monotonic(), 0)))
            if time.monotonic() >= deadline:
                raise NvcError("kubernetes", f"get resourceclaim {namespace}/{name}: no answer in time")
        if (namespace, name) not in self.objects:
            raise NvcError("kubernetes", f"get resourceclaim {namespace}/{name}: not found")
        return self.objects[(namespace, name)]


def table_of(inv) -> dict:
    return device_table(inv, None)


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


@pytest.fixture(scope="module")
def inv(machine):
    return build(str(machine.root), proc=str(machine.proc))


@pytest.fixture
def dirs(tmp_path):
    return str(tmp_path / "cdi"), str(tmp_path / "plugin")


def preparer(inv, dirs, source: Claims, lines=None, unhealthy=dict) -> Preparer:
    lines = lines if lines is not None else []
    return Preparer(inv, table_of(inv), NODE, dirs[0], dirs[1], generate.Options(hook_path=HOOK), source.get,
                    lines.append, unhealthy)


def spec_of(dirs, uid) -> dict:
    return store.read_spec(os.path.join(dirs[0], claimspec.file_name(uid))).spec


def test_one_gpu_claim_gets_a_spec_of_its_own(inv, dirs):
    source = Claims()
    p = preparer(inv, dirs, source)
    devices = asyncio.run(p.prepare(*source.put(UID1, ["gpu-1"])))
    assert [d.cdi for d in devices] == [(f"k8s.gpu.nvidia.com/claim={UID1}-gpu-1",)]
    spec = spec_of(dirs, UID1)
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
    assert [d["name"] for d in spec["devices"]] == [f"{UID1}-gpu-1"]
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidia1" in nodes and "/dev/nvidia0" not in nodes
    # the same edits cdi generate makes for that GPU
    full = generate.generate(inv, generate.Options(hook_path=HOOK, strategies=("uuid",))).to_dict()
    gpu1 = next(d for d in full["devices"] if d["name"] == inv.gpus[1].uuid)
    assert spec["devices"][0]["containerEdits"] == gpu1["containerEdits"]
    assert spec["containerEdits"] == full["containerEdits"]
    # CUDA forward compatibility, as the node's own spec and the hook path give it
    (ld,) = [h["args"] for h in spec["containerEdits"]["hooks"] if h["args"][1] == "update-ldcache"]
    assert ld[-2:] == ["--host-driver-version", inv.driver_version]
    assert os.listdir(dirs[0]) == [claimspec.file_name(UID1)]     # nothing else, no temporary left


def test_prepare_is_idempotent_and_survives_a_restart(inv, dirs):
    source = Claims()
    claim = source.put(UID1, ["gpu-0", "gpu-1"])
    first = asyncio.run(preparer(inv, dirs, source).prepare(*claim))
    assert [d.device for d in first] == ["gpu-0", "gpu-1"]
    again = preparer(inv, dirs, source)                           # a restarted plugin
    assert asyncio.run(again.prepare(*claim)) == first
    assert source.calls == 1                                      # answered from the checkpoint
    asyncio.run(again.unprepare(*claim))
    assert os.listdir(dirs[0]) == []
    assert json.load(open(os.path.join(dirs[1], checkpoint.NAME)))["claims"] == {}
    asyncio.run(again.unprepare(*claim))                          # a repeated unprepare is fine


def test_unprepare_removes_exactly_what_prepare_made(inv, dirs):
    source = Claims()
    a, b = source.put(UID1, ["gpu-0"], name="a"), put_admin(source, UID2, ["gpu-0"], "b")   # a shared GPU
    p = preparer(inv, dirs, source)
    os.makedirs(dirs[0])
    open(os.path.join(dirs[0], "nvidia.yaml"), "w").write("not ours\n")
    asyncio.run(p.prepare(*a))
    asyncio.run(p.prepare(*b))
    asyncio.run(p.unprepare(*a))
    assert sorted(os.listdir(dirs[0])) == sorted(["nvidia.yaml", claimspec.file_name(UID2)])
    assert set(p.claims) == {UID2}


def test_two_prepares_of_one_claim_at_once_ask_once(inv, dirs):
    source = Claims(delay=0.3)
    claim = source.put(UID1, ["gpu-0"])
    p = preparer(inv, dirs, source)

    async def both():
        return await asyncio.gather(p.prepare(*claim), p.prepare(*claim))

    one, two = asyncio.run(both())
    assert one == two and source.calls == 1 and p.locks == {}


@pytest.mark.parametrize("damage", ["garbage", "truncated", "huge", "symlink", "shape", "sharing"])
def test_a_damaged_checkpoint_is_rebuilt_from_the_specs(inv, dirs, damage, tmp_path):
    source = Claims()
    claim = source.put(UID1, ["gpu-1"])
    expected = asyncio.run(preparer(inv, dirs, source).prepare(*claim))
    path = os.path.join(dirs[1], checkpoint.NAME)
    text = open(path).read()
    os.unlink(path)
    if damage == "garbage":
        open(path, "wb").write(b"\x00\xff{[")
    elif damage == "truncated":
        open(path, "w").write(text[:len(text) // 2])
    elif damage == "huge":
        with open(path, "wb") as f:
            f.truncate(checkpoint.MAX_BYTES + 10)
    elif damage == "symlink":
        (tmp_path / "elsewhere").write_text(text)
        os.symlink(tmp_path / "elsewhere", path)
    else:
        doc = json.loads(text)
        if damage == "shape":
            doc["claims"][UID1]["devices"][0]["cdi"] = "k8s.gpu.nvidia.com/claim=x"
        else:
            doc["claims"][UID1]["devices"][0]["sharing"] = "TimeSlicing"
        open(path, "w").write(json.dumps(doc))
    lines = []
    p = preparer(inv, dirs, source, lines)
    assert len(lines) == 1 and lines[0].startswith("checkpoint refused") and "rebuilt from 1 claim specs" in lines[0]
    assert asyncio.run(p.prepare(*claim)) == expected and source.calls == 1
    assert checkpoint.load(dirs[1], dirs[0], lines.append) == p.claims and len(lines) == 1   # written back


def test_a_deleted_claim_is_an_error_and_nothing_is_written(inv, dirs):
    p = preparer(inv, dirs, Claims())
    with pytest.raises(NvcError, match="claim ns/gone: deleted"):
        asyncio.run(p.prepare("ns", "gone", UID1))
    assert not os.path.exists(dirs[0]) or os.listdir(dirs[0]) == []


def test_a_slow_api_server_gives_an_error_within_the_deadline(inv, dirs):
    source = Claims(delay=30)
    p = preparer(inv, dirs, source)
    start = time.monotonic()
    with pytest.raises(NvcError, match="no answer in time|did not answer in time"):
        asyncio.run(p.prepare(*source.put(UID1, ["gpu-0"]), deadline=time.monotonic() + 3))
    assert time.monotonic() - start < 3


def test_an_unhealthy_device_is_an_error_naming_it(inv, dirs):
    source = Claims()
    p = preparer(inv, dirs, source, unhealthy=lambda: {inv.gpus[0].uuid: "XID 79"})
    with pytest.raises(NvcError, match=f"device gpu-0 \\({inv.gpus[0].uuid}\\) is unhealthy: XID 79"):
        asyncio.run(p.prepare(*source.put(UID1, ["gpu-0"])))


def test_a_mig_claim(fake_machine_factory, dirs):
    machine = fake_machine_factory(MIG2)
    mig_inv = build(str(machine.root), proc=str(machine.proc))
    source = Claims()
    name, (gpu, mig) = next((n, u) for n, u in table_of(mig_inv).items() if u[1] is not None)
    devices = asyncio.run(preparer(mig_inv, dirs, source).prepare(*source.put(UID1, [name])))
    assert devices[0].uuid == mig.uuid
    nodes = [n["path"] for n in spec_of(dirs, UID1)["devices"][0]["containerEdits"]["deviceNodes"]]
    assert f"/dev/nvidia{gpu.minor}" in nodes and mig.gi_cap.path in nodes and mig.ci_cap.path in nodes


@pytest.mark.parametrize("uid", ["../../etc/x", "a/b", "", "x" * 80, "-leading"])
def test_a_uid_that_is_not_one_is_refused_before_it_names_a_file(inv, dirs, uid):
    p = preparer(inv, dirs, Claims())
    for call in (p.prepare("ns", "c", uid), p.unprepare("ns", "c", uid)):
        with pytest.raises(NvcError, match="not a UID"):
            asyncio.run(call)
    assert not os.path.exists(dirs[0])


def time_slicing(interval: str, requests=()) -> dict:
    return {"source": "FromClaim", "requests": list(requests), "opaque": {"driver": "gpu.nvidia.com", "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}}}}


def test_time_slices_are_set_and_reset_by_the_last_claim(inv, dirs):
    calls = []
    source = Claims()
    p = Preparer(inv, table_of(inv), NODE, dirs[0], dirs[1], generate.Options(hook_path=HOOK), source.get,
                 lambda line: None, run=calls.append)
    smi = os.path.join(inv.root, next(b.path for b in inv.binaries if b.name == "nvidia-smi").lstrip("/"))
    g0, g1 = inv.gpus[0].uuid, inv.gpus[1].uuid
    a = source.put(UID1, ["gpu-0", "gpu-1"], name="a", configs=[time_slicing("Long")])
    b = put_admin(source, UID2, ["gpu-1"], "b", configs=[time_slicing("Short")])
    asyncio.run(p.prepare(*a))
    asyncio.run(p.prepare(*b))
    # NVIDIA's order: the compute mode back to DEFAULT (an MPS claim's may have been left), then the slice
    assert calls == [[smi, "-i", g0, "-c", "DEFAULT"], [smi, "compute-policy", "-i", g0, "--set-timeslice=3"],
                     [smi, "-i", g1, "-c", "DEFAULT"], [smi, "compute-policy", "-i", g1, "--set-timeslice=3"],
                     [smi, "-i", g1, "-c", "DEFAULT"], [smi, "compute-policy", "-i", g1, "--set-timeslice=1"]]
    del calls[:]
    asyncio.run(p.unprepare(*a))                     # GPU 1 is still b's
    assert calls == [[smi, "compute-policy", "-i", g0, "--set-timeslice=0"]]
    asyncio.run(p.unprepare(*b))
    assert calls[1:] == [[smi, "compute-policy", "-i", g1, "--set-timeslice=0"]]


def test_a_time_slice_that_cannot_be_set_fails_the_prepare(inv, dirs):
    def fail(argv):
        raise NvcError("device", f"{' '.join(argv[1:])}: exit status 2: Insufficient Permissions")

    source = Claims()
    p = Preparer(inv, table_of(inv), NODE, dirs[0], dirs[1], generate.Options(hook_path=HOOK), source.get,
                 lambda line: None, run=fail)
    with pytest.raises(NvcError, match=f"-i {inv.gpus[0].uuid} -c DEFAULT: exit status 2"):
        asyncio.run(p.prepare(*source.put(UID1, ["gpu-0"], configs=[time_slicing("Medium")])))
    assert not os.path.exists(dirs[0]) and p.claims == {}


def mps(threads=None, limit=None, per=None) -> dict:
    config = {k: v for k, v in (("defaultActiveThreadPercentage", threads), ("defaultPinnedDeviceMemoryLimit", limit),
                                ("defaultPerDevicePinnedMemoryLimit", per)) if v is not None}
    return {"source": "FromClaim", "requests": [], "opaque": {"driver": "gpu.nvidia.com", "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": config}}}}


@pytest.fixture
def fresh_record(machine):
    state = Path(f"{machine.mps_record}.state")
    for path in (machine.mps_record, state):
        path.unlink(missing_ok=True)
    yield machine.mps_record
    state.unlink(missing_ok=True)


def kill(pid: int) -> None:
    """SIGKILL, and wait until the daemon is gone (dead or a zombie): its pipe then has no reader."""
    os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX":
                return
        except OSError:
            return
        time.sleep(0.02)


def daemons(machine) -> list[int]:
    return [pid for kind, pid, _ in record(machine) if kind == "start"] if machine.mps_record.exists() else []


def test_an_mps_claim_gets_its_own_daemon_reached_through_its_spec(machine, inv, dirs, fresh_record):
    source = Claims()
    claim = source.put(UID1, ["gpu-0", "gpu-1"], configs=[mps(threads=40, limit="1Gi", per={"1": "2Gi"})])
    lines = []
    p = preparer(inv, dirs, source, lines)
    asyncio.run(p.prepare(*claim))
    here = os.path.join(dirs[1], "mps", UID1, "config-0")
    [pid] = daemons(machine)
    env = dict(text.split("=", 1) for kind, p_, text in record(machine) if kind == "env" and p_ == pid)
    assert env == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CUDA_MPS_PIPE_DIRECTORY": f"{here}/pipe",
                   "CUDA_MPS_LOG_DIRECTORY": f"{here}/log",
                   "CUDA_VISIBLE_DEVICES": f"{inv.gpus[0].uuid},{inv.gpus[1].uuid}"}
    threads = "set_default_active_thread_percentage 40"
    assert told(machine, pid, has(threads)) == ["set_default_device_pinned_mem_limit 0 1024M",
                                               "set_default_device_pinned_mem_limit 1 2048M", threads]
    spec = spec_of(dirs, UID1)
    assert not [m for m in spec["containerEdits"]["mounts"] if m["containerPath"] == "/tmp/nvidia-mps"]  # the host's
    for device in spec["devices"]:
        edits = device["containerEdits"]
        assert {"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M,1=2048M"} <= set(edits["env"])
        assert {"hostPath": f"{here}/pipe", "containerPath": "/tmp/nvidia-mps",
                "options": ["rbind", "rprivate"]} in edits["mounts"]
        assert {"hostPath": f"{here}/shm", "containerPath": "/dev/shm",
                "options": ["rbind", "rprivate"]} in edits["mounts"]
    assert shm_of(machine, pid) == os.stat(f"{here}/shm")[1:3][::-1] and os.stat(f"{here}/shm").st_mode & 0o7777 == 0o1777
    assert not lines
    # a restarted plugin keeps the daemon that answers; one that died is started again
    again = preparer(inv, dirs, source)
    asyncio.run(again.prepare(*claim))
    assert daemons(machine) == [pid]
    kill(pid)
    asyncio.run(again.prepare(*claim))
    [_, second] = daemons(machine)
    assert told(machine, second, has(threads))[-1] == threads
    assert source.calls == 1
    asyncio.run(again.unprepare(*claim))
    assert told(machine, second, has("quit"))[-1] == "quit"
    assert [p_ for kind, p_, _ in record(machine) if kind == "quit"] == [second]
    assert not os.path.exists(os.path.join(dirs[1], "mps")) and os.listdir(dirs[0]) == []


def test_a_claim_without_mps_starts_no_daemon(inv, dirs, machine, fresh_record):
    source = Claims()
    asyncio.run(preparer(inv, dirs, source).prepare(*source.put(UID1, ["gpu-0"])))
    assert daemons(machine) == [] and not os.path.exists(os.path.join(dirs[1], "mps"))
    assert not any(e.startswith("CUDA_MPS") for e in spec_of(dirs, UID1)["containerEdits"].get("env", []))


def test_an_mps_daemon_that_does_not_start_fails_the_prepare_with_nothing_left(machine, inv, dirs, fresh_record):
    Path(f"{machine.mps_record}.state").write_text("fail_start\n")
    source = Claims()
    p = preparer(inv, dirs, source)
    with pytest.raises(NvcError, match="claim ns/c: the MPS daemon of config\\[0\\] did not start: nvidia-cuda-mps-control -d "
                                       "failed") as err:
        asyncio.run(p.prepare(*source.put(UID1, ["gpu-0"], configs=[mps(threads=50)])))
    assert "\n" not in str(err.value)
    assert p.claims == {} and not os.path.exists(os.path.join(dirs[0]))       # no spec
    assert sorted(os.listdir(dirs[1])) == []           # no daemon directory, no checkpoint written


def put_admin(source: Claims, uid: str, devices, name: str, configs=()) -> tuple[str, str, str]:
    claim = source.put(uid, devices, name=name, configs=configs)
    for result in source.objects[(claim[0], claim[1])]["status"]["allocation"]["devices"]["results"]:
        result["adminAccess"] = True
    return claim


UID3 = "3f1c8f36-0000-4000-8000-000000000003"


def test_a_gpu_prepared_for_one_claim_is_refused_to_a_second(inv, dirs):
    source = Claims()
    first = source.put(UID1, ["gpu-0"], name="first")
    second = source.put(UID2, ["gpu-1", "gpu-0"], name="second")
    p = preparer(inv, dirs, source)
    asyncio.run(p.prepare(*first))
    with pytest.raises(NvcError, match=r"claim ns/second: device gpu-0 \(GPU-[0-9a-f-]+\) is prepared for claim "
                                       r"ns/first \(gpu-0\); a device serves one claim at a time"):
        asyncio.run(p.prepare(*second))
    assert os.listdir(dirs[0]) == [claimspec.file_name(UID1)]            # nothing written for it
    # admin access (monitoring) may share it
    assert asyncio.run(p.prepare(*put_admin(source, UID3, ["gpu-0"], "watch")))[0].admin is True
    # after a plugin restart the checkpoint still holds it
    again = preparer(inv, dirs, source)
    with pytest.raises(NvcError, match="is prepared for claim ns/first"):
        asyncio.run(again.prepare(*second))
    asyncio.run(again.unprepare(*first))
    assert [d.device for d in asyncio.run(again.prepare(*second))] == ["gpu-1", "gpu-0"]


def test_a_mig_device_and_its_gpu_overlap(fake_machine_factory, dirs):
    machine = fake_machine_factory(MIG2)
    inv = build(str(machine.root), proc=str(machine.proc))
    table = table_of(inv)
    mig = next(n for n in table if "-mig-" in n)
    source = Claims()
    p = Preparer(inv, {**table, "whole": (table[mig][0], None)}, NODE, dirs[0], dirs[1],
                 generate.Options(hook_path=HOOK), source.get, [].append)
    asyncio.run(p.prepare(*source.put(UID1, [mig], name="part")))
    with pytest.raises(NvcError, match=f"device whole .* is prepared for claim ns/part \\({mig}\\)"):
        asyncio.run(p.prepare(*source.put(UID2, ["whole"], name="all")))


def test_a_prepare_racing_the_unprepare_of_the_same_gpu_is_refused_until_it_ends(inv, dirs):
    source = Claims()
    first = source.put(UID1, ["gpu-0"], name="first")
    second = source.put(UID2, ["gpu-0"], name="second")
    p = preparer(inv, dirs, source)
    asyncio.run(p.prepare(*first))
    stopping, go = threading.Event(), threading.Event()

    def slow_stop(entry):             # the first claim's unprepare, stopping its daemon
        stopping.set()
        go.wait(10)

    p._mps_stop = slow_stop

    async def race():
        unprepare = asyncio.create_task(p.unprepare(*first))
        await asyncio.to_thread(stopping.wait, 10)
        with pytest.raises(NvcError, match="is prepared for claim ns/first"):
            await p.prepare(*second)
        go.set()
        await unprepare
        return await p.prepare(*second)

    assert [d.device for d in asyncio.run(race())] == ["gpu-0"]


def test_a_daemon_directory_planted_as_a_link_to_another_daemon_s_is_never_followed(machine, inv, tmp_path,
                                                                                   fresh_record):
    """Issue 35: a GPU's (or claim's) MPS directory replaced by a link to another daemon's: the
    other daemon is never told to quit through it, and keeps running."""
    from nvcontainer.mps import control as mpscontrol

    binary = mpscontrol.control_binary(inv)
    other = mpscontrol.Control("other", str(tmp_path / "other"), inv.gpus[1].uuid, binary, 10)
    assert other.start(()) == ""
    [pid] = daemons(machine)
    planted = tmp_path / "planted"
    planted.symlink_to(tmp_path / "other")
    mine = mpscontrol.Control("mine", str(planted), inv.gpus[0].uuid, binary, 10)
    assert mine.answers()
    assert mine.stop() == "" and not planted.exists()
    planted.symlink_to(tmp_path / "other")
    assert mine.start(()) == ""                      # a fresh daemon of its own, in a real directory
    assert not planted.is_symlink() and len(daemons(machine)) == 2
    assert told(machine, pid) == [] and other.answers() == ""
    assert "quit" not in told(machine, pid) and [k for k, p, _ in record(machine) if p == pid and k == "quit"] == []
    assert mine.stop() == "" and other.stop() == ""


def put_requests(source: Claims, uid: str, requests: dict[str, list[str]], configs=(), name="c"):
    """A claim whose results name ``requests`` (request → devices)."""
    claim = source.put(uid, [], name=name, configs=configs)
    source.objects[(claim[0], claim[1])]["status"]["allocation"]["devices"]["results"] = [
        {"request": r, "driver": "gpu.nvidia.com", "pool": NODE, "device": d} for r, ds in requests.items() for d in ds]
    return claim


def for_requests(config: dict, *requests: str) -> dict:
    return {**config, "requests": list(requests)}


def env_of(device: dict) -> set[str]:
    return {e for e in device["containerEdits"].get("env", ()) if e.startswith("CUDA_MPS")}


def test_gpu_test5_one_time_sliced_and_one_mps_gpu_in_one_claim(machine, inv, dirs, fresh_record):
    """NVIDIA's gpu-test5: only the MPS group's GPU is an MPS client; the time-sliced one is not."""
    calls = []
    source = Claims()
    claim = put_requests(source, UID1, {"ts-gpu": ["gpu-0"], "mps-gpu": ["gpu-1"]}, configs=[
        for_requests(time_slicing("Long"), "ts-gpu"), for_requests(mps(threads=50, limit="2Gi"), "mps-gpu")])
    p = Preparer(inv, table_of(inv), NODE, dirs[0], dirs[1], generate.Options(hook_path=HOOK), source.get,
                 [].append, run=calls.append)
    asyncio.run(p.prepare(*claim))
    [pid] = daemons(machine)
    env = dict(text.split("=", 1) for kind, p_, text in record(machine) if kind == "env" and p_ == pid)
    assert env["CUDA_VISIBLE_DEVICES"] == inv.gpus[1].uuid                    # the MPS group's GPU only
    assert told(machine, pid, has("set_default_active_thread_percentage 50")) == [
        "set_default_device_pinned_mem_limit 0 2048M", "set_default_active_thread_percentage 50"]
    spec = spec_of(dirs, UID1)
    ts, shared = (next(d for d in spec["devices"] if d["name"] == f"{UID1}-{n}") for n in ("gpu-0", "gpu-1"))
    assert env_of(ts) == set() and not any("CUDA_MPS" in e for e in spec["containerEdits"].get("env", ()))
    assert not [m for m in ts["containerEdits"].get("mounts", ()) if m["containerPath"] in ("/tmp/nvidia-mps",
                                                                                         "/dev/shm")]
    assert env_of(shared) == {"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
                              "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M"}
    g0, g1 = inv.gpus[0].uuid, inv.gpus[1].uuid
    # compute modes: EXCLUSIVE_PROCESS on the MPS GPU before its daemon, DEFAULT before the time-slice
    assert [c[1:] for c in calls] == [["-i", g1, "-c", "EXCLUSIVE_PROCESS"], ["-i", g0, "-c", "DEFAULT"],
                                      ["compute-policy", "-i", g0, "--set-timeslice=3"]]
    del calls[:]
    asyncio.run(p.unprepare(*claim))
    assert [p_ for kind, p_, _ in record(machine) if kind == "quit"] == [pid]
    assert [c[1:] for c in calls] == [["-i", g1, "-c", "DEFAULT"], ["compute-policy", "-i", g0, "--set-timeslice=0"]]


def test_two_mps_configs_in_one_claim_get_two_daemons_with_their_own_limits(machine, inv, dirs, fresh_record):
    source = Claims()
    claim = put_requests(source, UID1, {"a": ["gpu-0"], "b": ["gpu-1"]}, configs=[
        for_requests(mps(threads=30, limit="1Gi"), "a"), for_requests(mps(threads=60, per={"0": "3Gi"}), "b")])
    p = preparer(inv, dirs, source)
    asyncio.run(p.prepare(*claim))
    first, second = daemons(machine)
    seen = {}
    for pid in (first, second):
        env = dict(t.split("=", 1) for kind, p_, t in record(machine) if kind == "env" and p_ == pid)
        seen[env["CUDA_VISIBLE_DEVICES"]] = (told(machine, pid, lambda got: len(got) == 2), shm_of(machine, pid))
    g0, g1 = inv.gpus[0].uuid, inv.gpus[1].uuid
    assert seen[g0][0] == ["set_default_device_pinned_mem_limit 0 1024M", "set_default_active_thread_percentage 30"]
    # the per-device key "0" is the first device of config[1]'s group (gpu-1), not the claim's gpu-0
    assert seen[g1][0] == ["set_default_device_pinned_mem_limit 0 3072M", "set_default_active_thread_percentage 60"]
    assert seen[g0][1] != seen[g1][1]                                          # a /dev/shm each
    spec = spec_of(dirs, UID1)
    envs = {d["name"]: env_of(d) for d in spec["devices"]}
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in envs[f"{UID1}-gpu-0"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60" in envs[f"{UID1}-gpu-1"]
    asyncio.run(p.unprepare(*claim))
    assert sorted(p_ for kind, p_, _ in record(machine) if kind == "quit") == sorted([first, second])
    assert not os.path.exists(os.path.join(dirs[1], "mps"))


def test_a_device_in_two_configuration_groups_is_refused(inv, dirs):
    source = Claims()
    claim = put_requests(source, UID1, {"a": ["gpu-0"], "b": ["gpu-0"]}, configs=[
        for_requests(mps(threads=30), "a"), for_requests(time_slicing("Short"), "b")])
    with pytest.raises(NvcError, match=r"claim ns/c: device gpu-0 is in two configuration groups \(config\[0\] for "
                                       r"request a, config\[1\] for request b\): a device is shared one way"):
        asyncio.run(preparer(inv, dirs, source).prepare(*claim))


def test_a_per_device_key_past_its_group_is_refused(inv, dirs):
    source = Claims()
    claim = put_requests(source, UID1, {"a": ["gpu-0"], "b": ["gpu-1"]}, configs=[
        for_requests(mps(per={"1": "1Gi"}), "b")])
    with pytest.raises(NvcError, match=r"config\[0\]: mpsConfig.defaultPerDevicePinnedMemoryLimit: 1: names no "
                                       r"device of the claim \(an index below 1"):
        asyncio.run(preparer(inv, dirs, source).prepare(*claim))


def test_a_daemon_that_dies_while_its_clients_run_is_one_line_and_started_again(machine, inv, dirs, fresh_record):
    source = Claims()
    claim = source.put(UID1, ["gpu-0"], configs=[mps(threads=20)])
    lines = []
    p = preparer(inv, dirs, source, lines)
    asyncio.run(p.prepare(*claim))
    asyncio.run(p.check_daemons())
    assert lines == []                                       # it answers: nothing said
    [pid] = daemons(machine)
    kill(pid)
    asyncio.run(p.check_daemons())
    assert lines == ["MPS daemon of claim ns/c (config[0]) died while its clients ran; started again: its "
                     "clients must start again"]
    [_, second] = daemons(machine)
    assert told(machine, second, has("set_default_active_thread_percentage 20"))
    asyncio.run(p.unprepare(*claim))
