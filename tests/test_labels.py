"""``nvcontainer labels`` on fake GPU machines: NVIDIA's GPU Feature Discovery names and values.

The golden files under tests/golden/labels/ were written by hand from NVIDIA's documented
labels (k8s-device-plugin docs/gpu-feature-discovery/README.md: names, MiB, family names,
``-SHARED``, ``-MIG-<profile>``, ``-MIG-INVALID``) and from what each fake machine is built with
(tests/fixtures/fakegpu/spec.py: models, memory, MIG profiles' attributes), not from our output.
versions.txt holds the lines every machine shares (driver 550.54.14, CUDA 12.4).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvcontainer.errors import NvcError
from nvcontainer.labels import publish
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import fake_proc_command, run_in_fake_proc

GOLDEN = Path(__file__).resolve().parent / "golden" / "labels"
NOW = 1700000000
MACHINE = "DGX A100 920-23687-2530-000\n"
A100 = "NVIDIA A100-SXM4-80GB"
MIG_SINGLE = FakeSpec(gpus=2, mig=True, mig_gpus=2, mig_devices=3, names=(A100, A100), archs=("8.0", "8.0"))
CASES = {
    "2gpu": (FakeSpec(), ""),
    "2gpu-mps": (FakeSpec(), 'sharing = "mps"\nreplicas = 4\n'),
    "8gpu": (FakeSpec(gpus=8), ""),
    "8gpu-time-slicing": (FakeSpec(gpus=8), 'sharing = "time-slicing"\nreplicas = 4\n'),
    "mig-mixed": (FakeSpec(mig=True), 'mig-strategy = "mixed"\n'),
    "mig-single": (MIG_SINGLE, 'mig-strategy = "single"\n'),
    "mig-single-invalid": (FakeSpec(mig=True), 'mig-strategy = "single"\n'),
}


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("labels")
    os.chmod(where, 0o755)
    (where / "product_name").write_text(MACHINE)
    return where


def config_file(where: Path, name: str, table: str) -> Path:
    path = where / f"{name}.toml"
    path.write_text(f'cache-dir = "{where}/cache-{name}"\n[device-plugin]\n{table}')
    return path


def labels_argv(machine, where: Path, name: str, table: str, *args, machine_type: str = "product_name") -> list[str]:
    cfg = config_file(where, name, table)
    return [sys.executable, "-m", "nvcontainer", "--root", str(machine.root), "--config", str(cfg), "labels",
            "--machine-type-file", str(where / machine_type), *args]


def labels(machine, where: Path, name: str, table: str, *args, timeout=60, **kw):
    argv = labels_argv(machine, where, name, table, *args, **kw)
    return run_in_fake_proc(machine, argv, capture_output=True, text=True, timeout=timeout)


def labeller(machine, where: Path, name: str, target: Path, period: int, stdout=subprocess.DEVNULL, now=None):
    """``nvcontainer labels`` kept running, in the background."""
    argv = labels_argv(machine, where, name, "", "--output-file", str(target), "--period", str(period),
                       *(["--now", str(now)] if now else []))
    return subprocess.Popen(fake_proc_command(machine, argv), stdout=stdout, stderr=subprocess.PIPE, text=True)


def wait_for(what, seconds=20.0):
    """``what()`` once it is true, or its last value after ``seconds``."""
    end = time.time() + seconds
    while not what() and time.time() < end:
        time.sleep(0.1)
    return what()


def golden(name: str) -> str:
    lines = (GOLDEN / "versions.txt").read_text().splitlines() + (GOLDEN / f"{name}.txt").read_text().splitlines()
    return "".join(f"{line}\n" for line in sorted(lines))


@pytest.mark.parametrize("name", sorted(CASES))
def test_labels_are_nvidias(fake_machine_factory, setup_dir, name):
    spec, table = CASES[name]
    done = labels(fake_machine_factory(spec), setup_dir, name, table, "--now", str(NOW))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout == golden(name)


def test_the_timestamp_is_the_clock_s_unless_left_out(fake_machine, setup_dir):
    before = int(time.time())
    out = labels(fake_machine, setup_dir, "clock", "").stdout
    stamp = int(dict(line.split("=", 1) for line in out.splitlines())["nvidia.com/gfd.timestamp"])
    assert before <= stamp <= time.time()
    out = labels(fake_machine, setup_dir, "clock", "", "--no-timestamp").stdout
    assert "gfd.timestamp" not in out and "nvidia.com/gpu.product=" in out


def test_an_unreadable_machine_type_is_unknown(fake_machine, setup_dir):
    out = labels(fake_machine, setup_dir, "nomachine", "", machine_type="absent").stdout
    assert "nvidia.com/gpu.machine=unknown\n" in out


def test_the_feature_file_is_nfd_s_format(fake_machine, setup_dir, tmp_path):
    features = tmp_path / "features.d"
    features.mkdir()
    done = labels(fake_machine, setup_dir, "file", "", "--now", str(NOW), "--output-file", str(features / "nvcontainer"))
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""
    text = (features / "nvcontainer").read_text()
    # one-shot: expires an hour later; 1700000000 + 3600 is 2023-11-14T23:13:20Z
    assert text == "# +expiry-time=2023-11-14T23:13:20Z\n" + golden("2gpu")
    assert os.listdir(features) == ["nvcontainer"]
    assert (features / "nvcontainer").stat().st_mode & 0o777 == 0o644


def test_the_expiry_is_four_periods(fake_machine, setup_dir, tmp_path):
    """A labeller that keeps running dates its file four periods ahead: NFD drops the labels of
    one that stopped (or that NFD never read in time) after that."""
    target = tmp_path / "nvcontainer"
    proc = labeller(fake_machine, setup_dir, "expiry", target, 2, now=NOW)
    try:
        wait_for(target.exists)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    # 1700000000 + 4 * 2 s
    assert target.read_text().splitlines()[0] == "# +expiry-time=2023-11-14T22:13:28Z"


def test_a_missing_directory_is_one_line_and_nothing_written(fake_machine, setup_dir, tmp_path):
    target = tmp_path / "absent" / "nvcontainer"
    done = labels(fake_machine, setup_dir, "missing", "", "--output-file", str(target))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"nvcontainer: labels error: cannot write {target}: {target.parent}: no such file or directory"]
    assert not target.parent.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount")
def test_an_unwritable_directory_keeps_the_old_file(tmp_path):
    """Not writable (a read-only mount, which even root cannot write): one error naming the
    file, the old file whole, no temporary file left."""
    features = tmp_path / "features.d"
    features.mkdir()
    publish.write(str(features / "nvcontainer"), "old\n")
    subprocess.run(["mount", "--bind", str(features), str(features)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(features)], check=True)
        with pytest.raises(NvcError) as caught:
            publish.write(str(features / "nvcontainer"), "new\n")
        assert caught.value.line() == (f"nvcontainer: labels error: cannot write {features / 'nvcontainer'}: "
                                       "read-only file system")
    finally:
        subprocess.run(["umount", str(features)], check=True)
    assert (features / "nvcontainer").read_text() == "old\n"
    assert os.listdir(features) == ["nvcontainer"]


def test_the_labeller_keeps_running_and_recovers(fake_machine, setup_dir, tmp_path):
    """With --period, a directory that is not there yet costs one line, not the process; the
    file appears once the directory does, and its labels are the machine's."""
    features = tmp_path / "features.d"
    target = features / "nvcontainer"
    proc = labeller(fake_machine, setup_dir, "loop", target, 1)
    try:
        time.sleep(2.5)
        assert proc.poll() is None, proc.stderr.read()
        features.mkdir()
        assert wait_for(target.exists)
        assert "nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB\n" in target.read_text()
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    errors = proc.stderr.read().splitlines()
    assert errors[0] == f"nvcontainer: labels error: cannot write {target}: {features}: no such file or directory"
    assert errors[1:] == [f"nvcontainer: labels published again to {target}"]


def test_bad_settings_are_one_line(fake_machine, setup_dir):
    done = labels(fake_machine, setup_dir, "bad", 'mig-strategy = "half"\n')
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "nvcontainer: config error: device-plugin.mig-strategy: expected 'none' or 'single' or 'mixed', got 'half'"]


def test_every_option_is_in_the_man_page():
    from nvcontainer.cli.labels import labels as command
    from tests.test_docs import assert_documented, section

    options = [(next((o for o in p.opts if not o.startswith("--")), None), next(o for o in p.opts if o.startswith("--")))
               for p in command.params if not getattr(p, "hidden", False)]
    assert len(options) == 4
    page = (Path(__file__).resolve().parent.parent / "man" / "nvcontainer-labels.1").read_text()
    assert_documented(options, section(page, ".SH OPTIONS"), "man/nvcontainer-labels.1 (OPTIONS)")


@pytest.mark.skipif(not os.path.exists("/usr/bin/man"), reason="man is not installed")
def test_the_man_page_renders_without_warnings():
    page = Path(__file__).resolve().parent.parent / "man" / "nvcontainer-labels.1"
    done = subprocess.run(["man", "--warnings", "-l", str(page)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, env=dict(os.environ, MANWIDTH="80"), timeout=60)
    assert done.returncode == 0 and done.stderr == ""


def test_a_driver_change_relabels_before_the_period(private_machine, setup_dir, tmp_path):
    """--period 60, yet a driver that changes under the labeller (the kernel module's version
    text) is seen within seconds: the file is replaced; a driver whose libraries do not match
    (an upgrade half done) is one line and the old file stays whole; once it matches again the
    labeller says so."""
    import threading

    machine = private_machine(FakeSpec())
    version = machine.proc / "driver" / "nvidia" / "version"
    original = version.read_text()
    features = tmp_path / "features.d"
    features.mkdir()
    target = features / "nvcontainer"
    proc = labeller(machine, setup_dir, "driver-change", target, 60)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()

    try:
        assert wait_for(target.exists)
        first = target.stat().st_ino
        version.write_text(original.replace("Thu Feb 22", "Fri Mar 22"))
        assert wait_for(lambda: target.stat().st_ino != first), "not relabelled on a driver change"
        second, text = target.stat().st_ino, target.read_text()
        version.write_text(original.replace("550.54.14", "555.42.02"))
        assert wait_for(lambda: said), "a driver that does not match was not reported"
        assert len(said) == 1 and "version mismatch" in said[0], said
        assert target.stat().st_ino == second and target.read_text() == text
        version.write_text(original)
        assert wait_for(lambda: len(said) == 2)
        assert said[1] == f"nvcontainer: labels published again to {target}\n"
        assert proc.poll() is None
    finally:
        version.write_text(original)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert os.listdir(features) == ["nvcontainer"]


def _inventory(**gpu):
    from nvcontainer.inventory.model import Gpu, Inventory, MigDevice

    mig = MigDevice(parent=0, index=0, uuid="MIG-x", gi=1, ci=0, gi_access="", ci_access="",
                    name="NVIDIA A100-SXM4-80GB MIG 1g.10gb", attributes=(("memory_mb", 9728),))
    fields = dict(index=0, minor=0, model="NVIDIA A100-SXM4-80GB", brand="Nvidia", uuid="GPU-x",
                  bus_id="00000000:07:00.0", arch="8.0", mig_capable=True, memory=81920 << 20)
    if gpu.pop("mig", False):
        fields.update(mig_enabled=True, migs=(mig,))
    return Inventory(root="/", driver_version="550.54.14", cuda_version="12.4", gpus=(Gpu(**(fields | gpu)),))


def test_mps_beside_mig_is_not_capable_and_rename_drops_shared():
    from nvcontainer.deviceplugin.settings import Settings
    from nvcontainer.labels.gfd import node_labels

    shared = Settings(sharing="mps", replicas=2)
    assert node_labels(_inventory(), shared)["nvidia.com/mps.capable"] == "true"
    assert node_labels(_inventory(mig=True), shared)["nvidia.com/mps.capable"] == "false"
    renamed = node_labels(_inventory(), Settings(replicas=2, rename_shared=True))
    assert renamed["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert renamed["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert node_labels(_inventory(memory=0), Settings()).get("nvidia.com/gpu.memory") is None
    assert "nvidia.com/gfd.timestamp" not in node_labels(_inventory(), Settings(), timestamp=None)


def test_no_gpu_no_labels_but_the_timestamp():
    from nvcontainer.deviceplugin.settings import Settings
    from nvcontainer.inventory.model import Inventory
    from nvcontainer.labels.gfd import node_labels

    empty = Inventory(root="/", driver_version="550.54.14", cuda_version="12.4")
    assert node_labels(empty, Settings(), timestamp=NOW) == {"nvidia.com/gfd.timestamp": str(NOW)}


def test_a_stopped_labeller_leaves_no_temporary_file(fake_machine, setup_dir, tmp_path):
    features = tmp_path / "features.d"
    features.mkdir()
    target = features / "nvcontainer"
    proc = labeller(fake_machine, setup_dir, "stop", target, 1)
    try:
        wait_for(target.exists)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert os.listdir(features) == ["nvcontainer"]


# Kubernetes' label value: at most 63, letters and digits at the ends, -_. inside (or empty)
LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


def test_a_long_machine_type_is_cut_to_a_label_value(fake_machine, setup_dir):
    """A DMI product name of 70 characters made a ``gpu.machine`` value the API server refuses
    (and with it the node's whole label update)."""
    (setup_dir / "long_machine").write_text("  ProLiant XL675d Gen10 Plus (with an eight-way HGX A100 board)"
                                            " -- rev. 2 \n")
    done = labels(fake_machine, setup_dir, "longmachine", "", "--now", str(NOW), machine_type="long_machine")
    assert done.returncode == 0, done.stderr
    values = dict(line.split("=", 1) for line in done.stdout.splitlines())
    assert values["nvidia.com/gpu.machine"] == "ProLiant-XL675d-Gen10-Plus-with-an-eight-way-HGX-A100-board"
    assert all(LABEL_VALUE.fullmatch(v) for v in values.values()), values
    (setup_dir / "dashes").write_text("--..__--\n")
    done = labels(fake_machine, setup_dir, "dashes", "", machine_type="dashes")
    assert "nvidia.com/gpu.machine=unknown\n" in done.stdout


@pytest.mark.parametrize("model", ["NVIDIA " + "X" * 70, "NVIDIA H100 80GB HBM3 " + "-" * 50 + " x", "-A100-"])
@pytest.mark.parametrize("mig", [False, True])
def test_every_label_value_is_one_kubernetes_takes(model, mig):
    from nvcontainer.deviceplugin.settings import Settings
    from nvcontainer.labels.gfd import node_labels

    for settings in (Settings(), Settings(replicas=4), Settings(mig_strategy="single", replicas=2),
                     Settings(mig_strategy="mixed")):
        got = node_labels(_inventory(model=model, mig=mig), settings, machine="m" * 100, timestamp=NOW)
        bad = {k: v for k, v in got.items() if not LABEL_VALUE.fullmatch(v)}
        assert not bad, bad
        if settings.replicas > 1 and not mig:
            assert got["nvidia.com/gpu.product"].endswith("-SHARED")     # the suffix survives the cut
