"""``nvcontainer ps``'s pure parts on made-up facts, and its readers on made-up files."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from nvcontainer.cgroups import access
from nvcontainer.cgroups.bpf import JMP, JSGT, Insn, exit_insn, mov64_imm
from nvcontainer.cgroups.rules import Rule
from nvcontainer.cgroups.v2 import rules_prefix
from nvcontainer.inventory.model import Gpu
from nvcontainer.ps import ocistate, render, scan
from nvcontainer.ps.assemble import assemble, owner, select_gpu
from nvcontainer.ps.naming import from_cgroup, name_from_annotations
from nvcontainer.ps.model import Container, LeaseView, Process

from .test_cgroups_v2 import runc_like

ID = "0123456789abcdef" * 4


@pytest.mark.parametrize(("path", "expected"), [
    (f"/system.slice/docker-{ID}.scope", ("docker", ID)),
    (f"/docker/{ID}", ("docker", ID)),
    (f"/sys/fs/cgroup/devices/docker/{ID}", ("docker", ID)),
    (f"/machine.slice/libpod-{ID}.scope", ("podman", ID)),
    (f"/libpod_parent/libpod-{ID}", ("podman", ID)),
    (f"/system.slice/crio-{ID}.scope", ("cri-o", ID)),
    (f"/system.slice/cri-containerd-{ID}.scope", ("containerd", ID)),
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podabc.slice/cri-containerd-{ID}.scope",
     ("kubernetes", ID)),
    (f"/kubepods/besteffort/pod1234/{ID}", ("kubernetes", ID)),
    (f"/default/{ID}", ("", ID)),
    ("/nvc-test/bundle-1", ("", "")),
    (f"/docker/{ID[:-1]}", ("", "")),
    ("/", ("", "")),
])
def test_engine_and_id_from_cgroup_path(path, expected):
    assert from_cgroup(path) == expected


def test_names_from_annotations():
    cri = {"io.kubernetes.cri.container-name": "cuda", "io.kubernetes.cri.sandbox-name": "train-0",
           "io.kubernetes.cri.sandbox-namespace": "ml"}
    assert name_from_annotations(cri) == "ml/train-0/cuda"
    crio = {"io.kubernetes.container.name": "c", "io.kubernetes.pod.name": "p", "io.kubernetes.pod.namespace": "n"}
    assert name_from_annotations(crio) == "n/p/c"
    assert name_from_annotations({"nerdctl/name": "web"}) == "web"
    assert name_from_annotations({}) == ""


# --- device access ------------------------------------------------------------------------------


def test_devices_list_v1():
    text = "c 1:3 rwm\nc 195:1 rwm\nc 195:255 rw\nc 195:0 r\nb 195:2 rwm\nc 195:3 rw\n"
    assert access.parse_devices_list(text, 195) == (frozenset({1, 3, 255}), False)
    assert access.parse_devices_list("a *:* rwm\n", 195) == (frozenset(), True)
    assert access.parse_devices_list("c 195:* rwm\n", 195) == (frozenset(), True)
    assert access.parse_devices_list("c *:1 rwm\n", 195) == (frozenset({1}), False)
    assert access.parse_devices_list("garbage\nc 195:x rw\n", 195) == (frozenset(), False)


def test_v2_programs_are_interpreted():
    runc = runc_like([(1, 3), (195, 255), (195, 2)])
    assert access.programs_allow([runc], 195, [0, 1, 2, 3]) == (frozenset({2}), False)
    ours = rules_prefix((Rule("c", 195, 1, "rw"), Rule("c", 195, 3, "r"))) + runc
    assert access.programs_allow([ours], 195, [0, 1, 2, 3]) == (frozenset({1, 2}), False)
    # programs are ANDed: a second program that allows only minor 1 narrows the first
    assert access.programs_allow([ours, runc_like([(195, 1)])], 195, [0, 1, 2, 3]) == (frozenset({1}), False)
    allow_all = [mov64_imm(0, 1), exit_insn()]
    assert access.programs_allow([allow_all], 195, [0, 1]) == (frozenset(), True)
    assert access.run_program(runc, access.DEV_CHAR, access.ACC_READ, 1, 3) == 1
    assert access.run_program(runc, access.DEV_CHAR, access.ACC_READ, 1, 4) == 0


def test_v2_unknown_instructions_are_refused():
    with pytest.raises(ValueError):
        access.run_program([Insn(JMP | JSGT, 1, 0, 0, 0), mov64_imm(0, 1), exit_insn()], 2, 6, 195, 0)
    with pytest.raises(ValueError, match="off its end"):
        access.run_program([mov64_imm(0, 1)], 2, 6, 195, 0)


# --- mount tables, procfs ----------------------------------------------------------------------


def test_mounted_minors():
    lines = [
        "610 600 0:5 /nvidia1 /dev/nvidia1 ro,nosuid - devtmpfs udev rw",
        "611 600 0:5 /nvidiactl /dev/nvidiactl ro,nosuid - devtmpfs udev rw",
        "612 600 0:5 /nvidia-uvm /dev/nvidia-uvm ro,nosuid - devtmpfs udev rw",
        "613 600 0:5 /x /dev/nvidia255 ro - devtmpfs udev rw",
        "614 600 0:5 /x /tmp/dev/nvidia2 ro - devtmpfs udev rw",
        "615 600 0:5 /x /dev/nvidia3\\040 ro - devtmpfs udev rw",
        "not a mountinfo line",
    ]
    assert scan.mounted_minors(lines) == (1,)


def test_parent_of_survives_any_command_name():
    assert scan.parent_of("42 (sh) S 7 42 42 0") == 7
    assert scan.parent_of("42 (a) S 9 (b) S 3 4) R 11 1 1") == 11
    assert scan.parent_of("garbage") is None


def test_vanished_processes_are_none():
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert scan.cgroup_of(gone.pid) is None
    assert scan.read_container(gone.pid, "pid:[1]", [0], 195) is None
    assert scan.command(gone.pid) == "" and scan.pidns(gone.pid) == ""


# --- OCI state ----------------------------------------------------------------------------------


def test_runtime_states(tmp_path):
    runc, crun = tmp_path / "runc", tmp_path / "crun"
    labels = ["bundle=/b", "io.kubernetes.cri.container-name=cuda", "io.kubernetes.cri.sandbox-name=pod"]
    (runc / "good").mkdir(parents=True)
    (runc / "good/state.json").write_text(json.dumps({"id": "good", "init_process_pid": 101,
                                                      "config": {"labels": labels}}))
    (runc / "link").mkdir()
    os.symlink(runc / "good/state.json", runc / "link/state.json")
    (runc / "huge").mkdir()
    (runc / "huge/state.json").write_text(json.dumps({"init_process_pid": 103, "pad": "x" * ocistate.MAX_STATE}))
    (runc / "bad").mkdir()
    (runc / "bad/state.json").write_text('{"init_process_pid": true}')
    os.mkfifo(runc / "fifo")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"annotations": {"nerdctl/name": "web"}}))
    (crun / "c1").mkdir(parents=True)
    (crun / "c1/status").write_text(json.dumps({"pid": 202, "bundle": str(bundle)}))
    got = ocistate.states((("runc", str(runc)), ("crun", str(crun)), ("runc", str(tmp_path / "none/*"))))
    assert got == {101: ("runc", "good", "pod/cuda"), 202: ("crun", "c1", "web")}


def test_docker_name(tmp_path):
    (tmp_path / ID).mkdir()
    (tmp_path / ID / "config.v2.json").write_text(json.dumps({"Name": "/trainer"}))
    assert ocistate.docker_name(ID, str(tmp_path)) == "trainer"
    assert ocistate.docker_name("../" + ID, str(tmp_path)) == ""


# --- assembly -----------------------------------------------------------------------------------

GPUS = [Gpu(index=i, minor=i, model="Tesla T4", brand="Tesla", uuid=f"GPU-{i}", bus_id="", arch="7.5")
        for i in range(3)]


def test_assemble_per_gpu():
    a = Container(pid=10, cgroup="/cg/a", pidns="pid:[1]", id=ID, engine="docker", cgroup_minors=(1,), mount_minors=(1,))
    b = Container(pid=20, cgroup="/cg/b", pidns="pid:[2]", id="b", engine="runc", cgroup_minors=(2,))
    priv = Container(pid=30, cgroup="/cg/p", pidns="pid:[3]", cgroup_all=True)
    procs = [
        Process(pid=11, gpu="GPU-1", memory=5 << 20, sm=3, pidns="pid:[1]", cgroup="/elsewhere"),
        Process(pid=12, gpu="GPU-1", memory=None, pidns="pid:[0]", cgroup="/cg/a/sub"),    # exec'd in by cgroup
        Process(pid=31, gpu="GPU-0", memory=7, pidns="pid:[3]"),                          # privileged one
        Process(pid=99, gpu="GPU-0", memory=1, pidns="pid:[0]", cgroup="/"),               # the host's
    ]
    leases = [LeaseView(container="b", pid=20, gpus=("GPU-2",)), LeaseView(container="gone", pid=77, gpus=("GPU-0",), alive=False),
              LeaseView(container=ID, pid=10, gpus=("GPU-1",), alive=False)]   # a restarted container kept its ID
    view = assemble(GPUS, {"GPU-0": {"utilization": 5, "memory_utilization": 1}}, [a, b, priv], procs, leases)
    g0, g1, g2 = view
    assert [(c["pid"], c["how"], c["running"], c["evidence"]) for c in g0["containers"]] == [
        (30, "request", True, ["process"]), (77, "lease", False, ["lease"])]
    assert [p["pid"] for p in g0["host_processes"]] == [99] and g0["utilization"] == 5
    ca, stale = g1["containers"]
    assert (stale["id"], stale["running"], stale["how"]) == (ID, False, "lease")
    assert (ca["id"], ca["how"], ca["evidence"], ca["memory"]) == (ID, "request", ["cgroup", "mount", "process"], 5 << 20)
    assert [p["pid"] for p in ca["processes"]] == [11, 12]
    (cb,) = g2["containers"]
    assert (cb["pid"], cb["how"], cb["evidence"], cb["memory"]) == (20, "lease", ["cgroup", "lease"], None)
    assert g1["utilization"] is None
    assert select_gpu(view, "2") == [g2] and select_gpu(view, "GPU-1") == [g1] and select_gpu(view, "9") == []


def test_a_lease_holds_only_the_init_it_names():
    c = Container(pid=10, start=500, cgroup_minors=(0,))
    def how(lease):
        return [e["how"] for e in assemble(GPUS[:1], {}, [c], [], [lease])[0]["containers"] if e["pid"] == 10]
    assert how(LeaseView(container="x", pid=10, gpus=("GPU-0",), start=500)) == ["lease"]
    assert how(LeaseView(container="x", pid=10, gpus=("GPU-0",), start=499)) == ["request", "lease"]   # pid reused
    assert how(LeaseView(container="x", pid=11, gpus=("GPU-0",), start=500)) == ["request"]


def test_owner_ignores_the_callers_own_cgroup():
    host_like = Container(pid=5, cgroup="/sys/fs/cgroup/devices", pidns="pid:[9]")
    p = Process(pid=1, gpu="GPU-0", cgroup="/sys/fs/cgroup/devices", pidns="pid:[0]")
    assert owner(p, [host_like]) is host_like
    assert owner(p, [host_like], ignore_cgroup="/sys/fs/cgroup/devices") is None


def test_pending_and_gone_leases_in_the_table():
    view = assemble(GPUS[:1], {}, [], [], [LeaseView(container="p", pid=0, gpus=("GPU-0",)),
                                           LeaseView(container="q", pid=0, gpus=("GPU-0",), alive=False),
                                           LeaseView(container="r", pid=9, gpus=("GPU-0",), alive=False)])
    text = render.text(view)
    assert "lease (pending)" in text and "lease (never started)" in text and "lease (container gone)" in text


def test_text_escapes_container_controlled_values():
    view = assemble(GPUS[:1], {}, [Container(pid=1, id="x", name="evil\nGPU 9", cgroup_minors=(0,))],
                    [Process(pid=2, gpu="GPU-0", memory=3 << 30, pidns="", command="a\x1bb")], [])
    text = render.text(view)
    assert "evil\\nGPU 9" in text and "\x1b" not in text and "3.0 GiB" in text
    assert text.count("\n") == 4
    assert render.text([]) == "no GPUs\n"
    assert json.loads(render.as_json(view))["gpus"][0]["containers"][0]["name"] == "evil\nGPU 9"


def test_ps_options_are_documented_and_the_page_renders():
    import shutil
    from pathlib import Path

    from click.testing import CliRunner

    from nvcontainer.cli.main import cli

    root = Path(__file__).resolve().parent.parent
    page = (root / "man" / "nvcontainer-ps.1").read_text()
    out = CliRunner().invoke(cli, ["ps", "--help"]).output
    for option in ("--json", "--gpu"):
        assert option in out and option.replace("-", "\\-") in page
    assert "\\fBps\\fR" in (root / "man" / "nvcontainer.1").read_text()
    from .test_ps_e2e import CONTAINER_KEYS, GPU_KEYS, PROCESS_KEYS

    for key in GPU_KEYS | CONTAINER_KEYS | PROCESS_KEYS | {"gpus"}:
        assert f"\\fB{key}\\fR" in page, f"--json key {key} is not in man/nvcontainer-ps.1"
    if shutil.which("man"):
        res = subprocess.run(["man", "--warnings", "-l", str(root / "man" / "nvcontainer-ps.1")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, MANWIDTH="80"), timeout=60)
        assert res.returncode == 0 and res.stderr == ""


def test_podman_names_from_its_storage(tmp_path):
    storage = tmp_path / "vfs-containers"
    (storage / ID / "userdata").mkdir(parents=True)
    (storage / "containers.json").write_text(json.dumps([{"id": "x" * 64, "names": ["other"]},
                                                         {"id": ID, "names": ["trainer", "alias"]}]))
    bundle = str(storage / ID / "userdata")
    assert ocistate.storage_name(bundle, ID) == "trainer"
    assert ocistate.storage_name(bundle, "y" * 64) == ""
    assert ocistate.storage_name(str(storage / ID), ID) == ""          # not a podman bundle
    crun = tmp_path / "crun"
    (crun / ID).mkdir(parents=True)
    (crun / ID / "status").write_text(json.dumps({"pid": 303, "bundle": bundle}))
    assert ocistate.states((("crun", str(crun)),)) == {303: ("crun", ID, "trainer")}


def test_device_nodes_are_checked_in_the_container_root(tmp_path):
    """A mount point named /dev/nvidiaN counts only where it is that GPU's node; a symlink in the
    root is not followed out of it (the fake /proc/PID/root here is a plain directory)."""
    proc = tmp_path / "proc"
    root = proc / "42" / "root"
    (root / "dev").mkdir(parents=True)
    os.mknod(root / "dev/nvidia0", 0o600 | 0o020000, os.makedev(195, 0))
    os.mknod(root / "dev/nvidia1", 0o600 | 0o020000, os.makedev(195, 7))     # wrong minor
    (root / "dev/nvidia2").write_text("")                                     # a file
    os.symlink("/dev/null", root / "dev/nvidia3")                            # a link out
    host = tmp_path / "host-node"
    os.mknod(host, 0o600 | 0o020000, os.makedev(195, 4))
    os.symlink(str(host), root / "dev/nvidia4")                              # the host's node, by link
    assert scan.device_nodes(42, [0, 1, 2, 3, 4, 5], 195, str(proc)) == (0,)
    assert scan.device_nodes(43, [0], 195, str(proc)) == ()
