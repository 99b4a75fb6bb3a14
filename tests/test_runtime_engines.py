"""The runtime shim end to end, on the fake GPU machine: runc run through it, podman with
``--runtime``, containerd 1.6 with ``ctr run --runc-binary``, CDI mode, and the daemon-reload case.

Pass signals as in test_e2e_runtimes: with no driver behind the fake nodes, opening a node the
devices cgroup allows gives ENXIO, one it denies EPERM. Byte-identity of a non-GPU container's
spec is seen by two transparent stand-ins: one the engine runs as its runtime, which keeps the
bundle's config.json as the engine wrote it and executes the shim, and one the shim runs as its
low-level runtime, which keeps it as the shim left it and executes runc.

The shim's prestart hook here is a wrapper that first gives the container's procfs a
``/proc/driver/nvidia`` (what a real driver's procfs has; see ``runtime.PROC_DRIVER_HOOK``), then
executes the real ``nvidia-container-runtime-hook`` with the same state and arguments.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from nvcontainer.native import build as native
from tests.fixtures import containerd, runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import fake_proc_command
from tests.test_cdi_podman import spec_dir  # noqa: F401 (a fixture: `cdi generate` for this module's machine)
from tests.fixtures.runtime import ENXIO, EPERM, host_mounts

CHECKS = r"""
for n in 0 1; do
  if [ -e /dev/nvidia$n ]; then echo "OPEN$n:$(cat /dev/nvidia$n 2>&1 | head -1)"; else echo "OPEN$n:absent"; fi
done
rm -f /tmp/n1; mknod /tmp/n1 c 195 1 && echo "MKNOD1:$(cat /tmp/n1 2>&1 | head -1)"
echo "LDCONFIG:$(ldconfig -p | grep -oE 'lib(cuda|nvidia-ml)\.so\.1 ' | sort | tr -d ' ' | tr '\n' ' ')"
echo "DONE:ok"
"""

BIN = Path(sys.executable).parent



class Shim:
    """The native front built for a configuration of the fake machine, with the two keepers."""

    def __init__(self, base: Path, machine, *, mode: str = "auto", spec_dirs=(), lowlevel: str = "/usr/sbin/runc"):
        base.mkdir(parents=True, exist_ok=True)
        self.base = base
        self.hook = base / "gpu-hook"
        self.hook.write_text(runtime.driver_wrapper(BIN / "nvidia-container-runtime-hook"))
        self.hook.chmod(0o755)
        self.log = base / "runtime.log"
        self.config = base / "config.toml"
        self.program = base / "nvidia-container-runtime"
        self.before, self.after = base / "before.json", base / "after.json"
        self.engine_runtime = self._keeper("engine-runtime", self.before, self.program)
        self.lowlevel = self._keeper("lowlevel-runtime", self.after, lowlevel)
        dirs = "".join(f'"{d}", ' for d in spec_dirs) or '"/etc/cdi", '
        self.config.write_text(
            f'[nvidia-container-cli]\nroot = "{machine.root}"\n'
            f'[nvidia-container-runtime]\nruntimes = ["{self.lowlevel}"]\nmode = "{mode}"\ndebug = "{self.log}"\n'
            f'[nvidia-container-runtime.modes.cdi]\nspec-dirs = [{dirs}]\n'
            f'[nvidia-container-runtime-hook]\npath = "{self.hook}"\n'
            f'[nvcontainer]\ncache-dir = "{base / "cache"}"\n')
        native.build_runtime(str(self.program), sys.executable, str(self.config))

    def _keeper(self, name: str, keep: Path, next_program) -> Path:
        path = self.base / name
        path.write_text(runtime.keeper(keep, next_program))
        path.chmod(0o755)
        return path

    def untouched(self) -> bool:
        return self.before.read_bytes() == self.after.read_bytes()

    def spec(self) -> dict:
        return json.loads(self.after.read_text())


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    if shutil.which("runc") is None:
        pytest.skip("runc is needed")
    return fake_machine_factory(FakeSpec(gpus=2))


@pytest.fixture
def shim(machine, tmp_path):
    return Shim(tmp_path / "shim", machine)


def facts(res) -> dict:
    got = runtime.parse_facts(res.stdout)
    assert got.get("DONE") == ["ok"], (res.stdout, res.stderr)
    return got


def assert_sees_only(got: dict, gpu: int | None) -> None:
    """GPU ``gpu`` is there and allowed (ENXIO), the other absent and denied; None: no GPU."""
    for n in (0, 1):
        want = f"cat: can't open '/dev/nvidia{n}': {ENXIO}" if n == gpu else "absent"
        assert got[f"OPEN{n}"] == [want]
    assert got["MKNOD1"] == [f"cat: can't open '/tmp/n1': {ENXIO if gpu == 1 else EPERM}"]
    assert got["LDCONFIG"] == (["libcuda.so.1 libnvidia-ml.so.1"] if gpu is not None else [""])


def bundle_without_hooks(base: Path, machine, env: list[str], script: str = CHECKS) -> Path:
    return runtime.make_bundle(base, machine, env, script, our_hook=False,
                               extra_spec=lambda spec: spec.pop("hooks"))


def run_runc(machine, shim: Shim, bundle: Path, *, name: str | None = None) -> subprocess.CompletedProcess:
    name = name or bundle.name
    state = bundle.parent / "state-runc"
    argv = [str(shim.engine_runtime), "--root", str(state), "run", "--bundle", str(bundle), name]
    try:
        return subprocess.run(fake_proc_command(machine, argv), capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["runc", "--root", str(state), "delete", "-f", name], capture_output=True, timeout=60)


# --- runc ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gpu", [0, 1])
def test_runc_each_container_sees_exactly_its_gpu(machine, shim, tmp_path, gpu):
    before = host_mounts()
    bundle = bundle_without_hooks(tmp_path, machine, [f"NVIDIA_VISIBLE_DEVICES={gpu}"])
    res = run_runc(machine, shim, bundle)
    assert res.returncode == 0, res.stderr
    assert_sees_only(facts(res), gpu)
    spec = shim.spec()
    assert [h["path"] for h in spec["hooks"]["prestart"]] == [str(shim.hook)]
    assert f"/dev/nvidia{gpu}" in [d["path"] for d in spec["linux"]["devices"]]
    assert {"allow": True, "type": "c", "major": 195, "minor": gpu, "access": "rw"} in \
        spec["linux"]["resources"]["devices"]
    assert host_mounts() == before


@pytest.mark.parametrize("env", [[], ["NVIDIA_VISIBLE_DEVICES=void"], ["NVIDIA_VISIBLE_DEVICES="]])
def test_runc_a_container_that_asks_for_nothing_keeps_its_spec_byte_for_byte(machine, shim, tmp_path, env):
    bundle = bundle_without_hooks(tmp_path, machine, env)
    written = (bundle / "config.json").read_bytes()
    res = run_runc(machine, shim, bundle)
    assert res.returncode == 0, res.stderr
    assert_sees_only(facts(res), None)
    assert shim.before.read_bytes() == written and shim.untouched()
    assert (bundle / "config.json").read_bytes() == written


def test_runc_a_bad_request_stops_the_create_with_one_line(machine, shim, tmp_path):
    bundle = bundle_without_hooks(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=7"], "echo STARTED")
    written = (bundle / "config.json").read_bytes()
    res = run_runc(machine, shim, bundle)
    assert res.returncode == 1 and "STARTED" not in res.stdout
    assert res.stderr == "nvidia-container-runtime: device error: 7: unknown device\n"
    assert (bundle / "config.json").read_bytes() == written and not shim.after.exists()


# --- podman --runtime --------------------------------------------------------------------------------------

def run_podman(machine, shim: Shim, base: Path, env: list[str], script: str = CHECKS):
    if shutil.which("podman") is None:
        pytest.skip("podman is needed")
    work = base / f"podman-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    (work / "containers.conf").write_text(runtime.PODMAN_CONF)
    rootfs = runtime.busybox_rootfs(work / "rootfs")
    runroot = Path(subprocess.check_output(["mktemp", "-d", "/tmp/nvc-pd-XXXXXX"], text=True).strip())
    argv = ["podman", "--root", str(work / "storage"), "--runroot", str(runroot), "--storage-driver", "vfs",
            "--cgroup-manager", "cgroupfs", "--runtime", str(shim.engine_runtime), "run", "--rm", "--network", "none",
            *[f"--env={e}" for e in env], "--rootfs", str(rootfs), "/bin/sh", "-c", script]
    environ = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CONTAINERS_CONF": str(work / "containers.conf")}
    try:
        return subprocess.run(fake_proc_command(machine, ["sh", "-c", runtime.V1_ONLY_WORLD, "sh", *argv]),
                              capture_output=True, text=True, env=environ, timeout=180)
    finally:
        shutil.rmtree(runroot, ignore_errors=True)


@pytest.mark.parametrize("lowlevel", ["runc", "crun"])
def test_podman_runtime_gpu(machine, tmp_path, lowlevel):
    if shutil.which(lowlevel) is None:
        pytest.skip(f"{lowlevel} is needed")
    shim = Shim(tmp_path / "shim", machine, lowlevel=shutil.which(lowlevel))
    res = run_podman(machine, shim, tmp_path, ["NVIDIA_VISIBLE_DEVICES=1"])
    assert res.returncode == 0, res.stderr
    assert_sees_only(facts(res), 1)
    assert not shim.untouched()


def test_podman_runtime_no_gpu_spec_untouched(machine, shim, tmp_path):
    res = run_podman(machine, shim, tmp_path, ["HOME=/root"])
    assert res.returncode == 0, res.stderr
    assert_sees_only(facts(res), None)
    assert shim.untouched()
    assert not shim.log.exists()      # the Python half never ran: the front answered alone


# --- containerd 1.6: ctr run --runc-binary ----------------------------------------------------------------

@pytest.fixture(scope="module")
def ctr_base(tmp_path_factory):
    if shutil.which("containerd") is None or shutil.which("ctr") is None:
        pytest.skip("containerd is needed (apt-get install containerd)")
    return containerd.prepare(tmp_path_factory.mktemp("containerd"))


def run_ctr(machine, shim: Shim, base: Path, env: list[str], script: str = CHECKS):
    args = ["--runc-binary", str(shim.engine_runtime), *[a for e in env for a in ("--env", e)], containerd.IMAGE,
            f"c-{uuid.uuid4().hex[:8]}", "sh", "-c", script]
    return containerd.run(machine, base, args)


@pytest.mark.parametrize("gpu", [0, 1])
def test_containerd_each_container_sees_exactly_its_gpu(machine, shim, ctr_base, gpu):
    res = run_ctr(machine, shim, ctr_base, [f"NVIDIA_VISIBLE_DEVICES={gpu}"])
    assert res.returncode == 0, res.stderr + (ctr_base / "containerd.log").read_text()[-2000:]
    assert_sees_only(facts(res), gpu)
    assert f"/dev/nvidia{gpu}" in [d["path"] for d in shim.spec()["linux"]["devices"]]


def test_containerd_no_gpu_spec_untouched(machine, shim, ctr_base):
    res = run_ctr(machine, shim, ctr_base, ["HOME=/root"])
    assert res.returncode == 0, res.stderr
    assert_sees_only(facts(res), None)
    assert shim.untouched() and not shim.log.exists()


def test_containerd_shows_the_shims_error(machine, shim, ctr_base):
    res = run_ctr(machine, shim, ctr_base, ["NVIDIA_VISIBLE_DEVICES=7"], "echo STARTED")
    assert res.returncode != 0 and "STARTED" not in res.stdout
    assert "nvidia-container-runtime: device error: 7: unknown device" in res.stderr


# --- CDI mode -------------------------------------------------------------------------------------------------

def test_cdi_names_through_runc(machine, spec_dir, tmp_path):
    cdi_dir = spec_dir
    shim = Shim(tmp_path / "shim", machine, spec_dirs=[cdi_dir])
    bundle = bundle_without_hooks(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=1"])
    bundle_spec = json.loads((bundle / "config.json").read_text())
    bundle_spec["hooks"] = {"prestart": runtime.hook_entries(machine, our_hook=False)}   # the test's /proc/driver
    (bundle / "config.json").write_text(json.dumps(bundle_spec))
    res = run_runc(machine, shim, bundle)
    assert res.returncode == 0, res.stderr
    got = facts(res)
    assert got["OPEN1"] == [f"cat: can't open '/dev/nvidia1': {ENXIO}"] and got["OPEN0"] == ["absent"]
    assert set(got["LDCONFIG"][0].split()) == {"libcuda.so.1", "libnvidia-ml.so.1"}   # CDI: 32-bit ones too
    spec = shim.spec()
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["process"]["env"]
    assert {h["args"][1] for h in spec["hooks"]["createRuntime"]} >= {"create-symlinks", "update-ldcache"}


def test_cdi_a_stale_spec_stops_the_create(machine, spec_dir, tmp_path):
    cdi_dir = spec_dir
    stale = tmp_path / "cdi"
    stale.mkdir()
    (stale / "nvidia.yaml").write_text((cdi_dir / "nvidia.yaml").read_text().replace("550.54.14", "535.1.1"))
    shim = Shim(tmp_path / "shim", machine, spec_dirs=[stale])
    bundle = bundle_without_hooks(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"], "echo STARTED")
    written = (bundle / "config.json").read_bytes()
    res = run_runc(machine, shim, bundle)
    assert res.returncode == 1 and "STARTED" not in res.stdout
    assert res.stderr.startswith(f"nvidia-container-runtime: cdi error: {stale}/nvidia.yaml is stale: ")
    assert "fix: nvcontainer cdi generate" in res.stderr and res.stderr.count("\n") == 1
    assert (bundle / "config.json").read_bytes() == written


# --- systemctl daemon-reload -------------------------------------------------------------------------------

def _v1_rule(rule: dict) -> tuple[str, str]:
    kind = rule.get("type") or "a"
    major = "*" if rule.get("major") is None else str(rule["major"])
    minor = "*" if rule.get("minor") is None else str(rule["minor"])
    text = "a" if kind == "a" else f"{kind} {major}:{minor} {rule.get('access') or 'rwm'}"
    return text, "devices.allow" if rule.get("allow") else "devices.deny"


def reapply_v1(cgroup: Path, spec: dict) -> None:
    """What systemd does to a container's devices cgroup on daemon-reload (systemd cgroup
    driver): deny everything, then apply the spec's ``linux.resources.devices`` in order."""
    (cgroup / "devices.deny").write_text("a")
    for rule in spec["linux"]["resources"]["devices"]:
        text, where = _v1_rule(rule)
        (cgroup / where).write_text(text)


def reapply_v2(cgroup: Path, spec: dict) -> None:
    """cgroup v2: systemd attaches a device program generated from the spec's rules in place of
    the one it had: here, allow each exact allow rule, deny the rest, swapped in atomically."""
    import os

    from nvcontainer.cgroups import bpf, v2
    from nvcontainer.cgroups.rules import Rule

    rules = [Rule(r["type"], r["major"], r["minor"], r["access"]) for r in spec["linux"]["resources"]["devices"]
             if r.get("allow") and r.get("type") in ("c", "b") and r.get("major") is not None
             and r.get("minor") is not None]
    program = v2.rules_prefix(rules) + [bpf.mov64_imm(0, 0), bpf.exit_insn()]
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    new = bpf.prog_load(program, "reload_test")
    try:
        flags, ids = bpf.prog_query(fd)
        assert ids, "runc attached no device program"
        for prog_id in ids:
            old = bpf.prog_get_fd_by_id(prog_id)
            try:
                bpf.prog_attach(fd, new, bpf.F_ALLOW_MULTI | bpf.F_REPLACE, replace_fd=old)
            finally:
                os.close(old)
            break
        for prog_id in ids[1:]:
            old = bpf.prog_get_fd_by_id(prog_id)
            bpf.prog_detach(fd, old)
            os.close(old)
    finally:
        os.close(new)
        os.close(fd)


def _in_world(machine, argv: list[str], cgroup2: bool) -> list[str]:
    if cgroup2:
        argv = ["sh", "-c", runtime.CGROUP2_WORLD, "sh", *argv]
    return fake_proc_command(machine, argv)


OPEN0 = "cat /dev/nvidia0 2>&1 | head -1"


@pytest.mark.parametrize("cgroup2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("through", ["shim", "hook"])
def test_daemon_reload_keeps_the_gpu_through_the_shim_only(machine, tmp_path, through, cgroup2):
    shim = Shim(tmp_path / "shim", machine)
    env = ["NVIDIA_VISIBLE_DEVICES=0"]
    if through == "shim":
        bundle = bundle_without_hooks(tmp_path, machine, env, "sleep 600")
        program = shim.engine_runtime
    else:   # the plain hook registered in the bundle, runc alone
        bundle = runtime.make_bundle(tmp_path, machine, env, "sleep 600")
        program = "runc"
    name, state = bundle.name, tmp_path / "state"
    runc = ["runc", "--root", str(state)]
    try:
        errors = tmp_path / "run.err"   # a file: the detached container keeps its stdio open
        with open(errors, "w") as err:
            started = subprocess.run(_in_world(machine, [str(program), "--root", str(state), "run", "-d", "--bundle",
                                                         str(bundle), name], cgroup2),
                                     stdin=subprocess.DEVNULL, stdout=err, stderr=err, timeout=120)
        assert started.returncode == 0, errors.read_text()

        def open0() -> str:
            res = subprocess.run(_in_world(machine, [*runc, "exec", name, "sh", "-c", OPEN0], cgroup2),
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            return res.stdout.strip()

        assert open0() == f"cat: can't open '/dev/nvidia0': {ENXIO}"
        spec = json.loads((bundle / "config.json").read_text())   # the bundle's final spec
        cgroup = Path("/sys/fs/cgroup/unified" if cgroup2 else "/sys/fs/cgroup/devices") / spec["linux"]["cgroupsPath"].lstrip("/")
        (reapply_v2 if cgroup2 else reapply_v1)(cgroup, spec)
        after = open0()
        if through == "shim":
            assert after == f"cat: can't open '/dev/nvidia0': {ENXIO}"     # the rules were the runtime's own
        else:
            assert after == f"cat: can't open '/dev/nvidia0': {EPERM}"     # the hook's rule is gone (toolkit#48)
    finally:
        subprocess.run(_in_world(machine, [*runc, "delete", "-f", name], cgroup2), capture_output=True, timeout=60)
