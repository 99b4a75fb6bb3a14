"""Lifecycle faults: the world changes under a run, or the run itself is cut short.

* The container's process dies mid-configure: the run must stop with one line (or finish, if
  it was already past its last use of the process), allow no device beyond the request, and
  leave no worker behind.
* Its PID is reused by a host process: before the run (a stale ``--pid``) and during it (the
  container dies and a host process gets the number, via ``ns_last_pid``). The host process's
  cgroup must gain nothing and the run must not report success. Under a runtime this cannot
  happen: the runtime reaps its init only after the hooks, so the number stays a zombie's for
  the whole hook; the runtime case asserts exactly that.
* The hook is SIGKILLed at random points (runc and crun kill only the hook's PID on their
  timeout): no worker, sandbox or ldconfig survives, a cgroup v2 container never loses its
  device program, and a restart (a new container on the half-prepared rootfs) succeeds.
* A step hangs (NVML never answers, ldconfig never ends): the configured deadline ends the run with one line, nothing left running.
* 100 containers start at once (24 in the default run), some sharing one rootfs: each gets
  exactly its own GPU.

Faults are injected right after a chosen line of the ``--debug`` trace appears (plus a random
delay), so every step gets hit deterministically, not only the slow ones.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import subprocess
import time

import pytest

from tests.fixtures.fakegpu import FakeSpec
from tests.security import _support as s
from tests.security.conftest import RUN_SECONDS, descendants, fresh_image

ROUNDS = s.scale(1, 40)          # per marker and variant
KILL_ROUNDS = s.scale(1, 10)     # the same for SIGKILL, whose every round also restarts
SIMULTANEOUS = s.scale(24, 100)


def _cg(variant) -> int:
    return 2 if variant.cgroup2 else 1


def _rules_ok(machine, container: s.Container) -> None:
    """No device beyond the request, and on v2 still exactly one program."""
    if container.cgroup.version == 1:
        allowed = {f"c {a}:{b} rw" for a, b in s.expected_allowed(machine)}
        assert container.cgroup.rules() <= allowed, sorted(container.cgroup.rules())
    else:
        assert len(container.cgroup.programs()) == 1


def _no_stray(driver: s.Driver) -> None:
    end = time.monotonic() + 3
    while (left := s.leftovers(driver.proc.pid)) and time.monotonic() < end:
        time.sleep(0.02)
    assert not left, f"left running after the run: {left}"


# --- the container dies ------------------------------------------------------------------------


@pytest.mark.parametrize("variant", s.DIRECT, ids=str)
def test_container_dies_mid_configure(sec_machine, workdir, variant):
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    rng = random.Random(f"dies-{variant}")
    s.allow_seconds(900)
    outcomes = []
    with s.Driver(machine, variant) as driver:
        for round_ in range(ROUNDS):
            for marker in s.MARKERS:
                log = workdir / f"debug-{round_}-{len(outcomes)}.log"
                with s.Container(rootfs, cgroup_version=_cg(variant)) as c:
                    striker = s.Striker(log, marker, rng.uniform(0, 0.01), c.kill)
                    res = driver.configure(c.pid, rootfs, global_args=["--debug", str(log)])
                    hit = striker.finish()
                    if res.returncode:
                        line = s.one_line(res.stderr, "nvcontainer: ")
                        assert hit, f"failed without a fault: {line}"
                    _rules_ok(machine, c)
                    _no_stray(driver)
                outcomes.append((marker, hit, res.returncode))
    # the faults really landed mid-run: early markers must have made runs fail
    assert any(hit and rc for marker, hit, rc in outcomes if marker in ("plan:", "prepared ")), outcomes


@pytest.mark.parametrize("variant", s.variants((s.RUNC_V1, s.CRUN_V1, s.RUNC_V2), s.RUNTIMES), ids=str)
def test_container_dies_under_a_runtime(sec_machine, workdir, variant):
    s.need_runtime(variant, sec_machine)
    machine = sec_machine
    rng = random.Random(f"dies-{variant}")
    for marker in s.MARKERS[:3]:
        log = workdir / f"debug-{marker.strip(': ')}.log"
        fault = {"what": "container", "marker": marker, "delay": rng.uniform(0, 0.01), "log": str(log)}
        run = s.run_runtime(machine, workdir, variant, opts={"fault": fault}, hook_args=["--debug", str(log)])
        out = run.outcome
        assert out.hook_ran, out.runtime_stderr
        assert out.returncode != 0 and "DONE" not in out.facts, "a container whose init died ran"
        # a dead init stays the runtime's unreaped child during the hook: its PID cannot be reused
        assert run.record.get("container_state") in ("Z", "gone"), run.record.get("container_state")
        if out.stderr:
            s.one_line(out.stderr, "nvcontainer-hook: ")
        s.check_run(out, run.rootfs, machine, None, "nvcontainer-hook: ")


# --- the PID is reused -------------------------------------------------------------------------


def _impostor(cgroup: s.Cgroup) -> list[str]:
    return ["sh", "-c", 'echo $$ > "$1"; exec sleep 300', "sh", str(cgroup.procs)]


def _untouched(cgroup: s.Cgroup, programs_before: list[int]) -> None:
    if cgroup.version == 1:
        assert cgroup.rules() == set(), f"the host process's cgroup gained {sorted(cgroup.rules())}"
    else:
        assert cgroup.programs() == programs_before, "the host process's device program was replaced"


def _init_ns_visible() -> bool:
    res = subprocess.run(["unshare", "-m", "--propagation", "private", "readlink", "/proc/1/ns/mnt"],
                         capture_output=True, timeout=RUN_SECONDS)
    return res.returncode == 0


@pytest.mark.parametrize("where", ["init", "own"])
@pytest.mark.parametrize("variant", s.variants((s.DIRECT_V1, s.DIRECT_V2), s.DIRECT), ids=str)
def test_stale_pid_of_a_host_process(sec_machine, workdir, variant, where):
    """``--pid`` names a process that exited; a host process got its number since, in the
    mount namespace configure itself runs in, or in PID 1's while configure runs in a private
    one (a runtime with a private namespace). Either is the host: refused, and its cgroup
    gains nothing. (Where PID 1's namespace cannot be read from a private namespace, as on
    this project's firecracker VMs, only the outcome is checked, not the reason.)"""
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    host_cgroup = s.Cgroup.create(_cg(variant))
    programs = host_cgroup.programs() if host_cgroup.version == 2 else []
    try:
        with s.Driver(machine, variant) as driver:
            c = s.Container(rootfs, cgroup_version=_cg(variant))
            pid = c.pid
            c.stop()
            enter = ["nsenter", "-t", str(driver.proc.pid), "-m", "--"] if where == "own" else []
            impostor = s.spawn_with_pid(pid, enter + _impostor(host_cgroup))
            if impostor is None:
                pytest.skip("another process took the PID first, every time")
            try:
                res = driver.configure(pid, rootfs)
                line = s.one_line(res.stderr, "nvcontainer: ")
                if where == "own" or _init_ns_visible():
                    assert "shares the host's mount namespace" in line, line
                _untouched(host_cgroup, programs)
            finally:
                impostor.kill()
                impostor.wait()
    finally:
        host_cgroup.remove()


@pytest.mark.parametrize("variant", s.variants((s.DIRECT_V1, s.DIRECT_V2), s.DIRECT), ids=str)
def test_pid_reused_mid_configure(sec_machine, workdir, variant):
    """The container dies while its mounts are being placed and a host process takes its PID
    before the cgroup step: the rules must not go to the host process's cgroup."""
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    rng = random.Random(f"reuse-{variant}")
    s.allow_seconds(900)
    landed = 0
    with s.Driver(machine, variant) as driver:
        for i in range(s.scale(4, 100)):
            host_cgroup = s.Cgroup.create(_cg(variant))
            programs = host_cgroup.programs() if host_cgroup.version == 2 else []
            impostors = []
            log = workdir / f"debug-{i}.log"
            c = s.Container(rootfs, cgroup_version=_cg(variant))

            def swap(c=c, cg=host_cgroup, impostors=impostors):
                c.kill()
                c.proc.wait()
                impostors.append(s.spawn_with_pid(c.pid, _impostor(cg), tries=3))

            try:
                striker = s.Striker(log, "prepared ", rng.uniform(0, 0.005), swap)
                res = driver.configure(c.pid, rootfs, global_args=["--debug", str(log)])
                striker.finish()
                impostor = impostors[0] if impostors else None
                if impostor is not None:
                    landed += 1
                    assert res.returncode != 0, "reported success for a container that died"
                    s.one_line(res.stderr, "nvcontainer: ")
                    _untouched(host_cgroup, programs)
            finally:
                for p in impostors:
                    if p is not None:
                        p.kill()
                        p.wait()
                c.stop()
                host_cgroup.remove()
            _no_stray(driver)
    if not landed:
        pytest.skip("the host process never got the PID in time")


# --- the hook is killed ------------------------------------------------------------------------


@pytest.mark.parametrize("variant", s.DIRECT, ids=str)
def test_hook_killed_at_random_points(sec_machine, workdir, variant):
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    probe = s.Probe(machine, workdir / "probe")
    rng = random.Random(f"kill-{variant}")
    s.allow_seconds(900)
    for round_ in range(KILL_ROUNDS):
        for marker in s.MARKERS:
            log = workdir / f"debug-{round_}-{marker.strip(': ')}.log"
            with s.Container(rootfs, cgroup_version=_cg(variant)) as c:
                sampler = s.Sampler(c.cgroup.path) if variant.cgroup2 else None
                mine = set(descendants())
                argv = s.configure_command(machine, variant, c.pid, rootfs, global_args=["--debug", str(log)])
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                striker = s.Striker(log, marker, rng.uniform(0, 0.01), proc.kill)
                _, err = proc.communicate(timeout=RUN_SECONDS)
                striker.finish()
                if proc.returncode > 0:
                    s.one_line(err, "nvcontainer: ")
                # workers die with the hook: nothing new may be left below us but the container
                left = s.stray(mine | {proc.pid})
                assert not left, f"left running after SIGKILL at {marker!r}: {left}"
                _rules_ok(machine, c)
                s.check_run(s.Outcome("killed", 1, new_mounts=c.new_mounts()), rootfs, machine,
                            probe.granted(c.cgroup), "nvcontainer: ")
                if sampler:
                    low, high, n = sampler.stop()
                    assert low >= 1 and high == 1, f"device programs went from {low} to {high} ({n} samples)"
            # a restart (a new container on the rootfs the killed run left half done) succeeds
            with s.Container(rootfs, cgroup_version=_cg(variant)) as c:
                res = subprocess.run(s.configure_command(machine, variant, c.pid, rootfs), capture_output=True,
                                     text=True, timeout=RUN_SECONDS)
                assert res.returncode == 0, res.stderr
                assert probe.granted(c.cgroup) == s.expected_allowed(machine)


@pytest.mark.parametrize("variant", s.variants((s.RUNC_V1, s.CRUN_V1, s.RUNC_V2), s.RUNTIMES), ids=str)
def test_hook_killed_under_a_runtime(sec_machine, workdir, variant):
    s.need_runtime(variant, sec_machine)
    machine = sec_machine
    rng = random.Random(f"kill-{variant}")
    for marker in s.MARKERS:
        log = workdir / f"debug-{marker.strip(': ')}.log"
        fault = {"what": "hook", "marker": marker, "delay": rng.uniform(0, 0.01), "log": str(log)}
        run = s.run_runtime(machine, workdir, variant, opts={"fault": fault, "sample": True},
                            hook_args=["--debug", str(log)])
        out = run.outcome
        assert out.hook_ran, out.runtime_stderr
        if run.record.get("struck"):
            assert out.returncode != 0 and "DONE" not in out.facts, "the container ran although its hook was killed"
            s.check_run(s.Outcome("killed", 1, new_mounts=out.new_mounts,
                                  host_mounts_in_rootfs=out.host_mounts_in_rootfs), run.rootfs, machine, None, "")
        else:  # the hook had finished before the kill
            assert s.check_run(out, run.rootfs, machine, run.granted, "nvcontainer-hook: ")
        if "sample" in run.record:
            low, high, n = run.record["sample"]
            assert low >= 1 and high == 1, f"device programs went from {low} to {high} ({n} samples)"


# --- a step hangs ------------------------------------------------------------------------------

DEADLINE = 2


def _config(workdir, step: str = "nvml") -> str:
    """The short deadline; for the ldconfig step also an ldconfig that never ends. (An image's
    FIFO no longer hangs ldconfig: the sandbox reads ld.so.conf itself and refuses library links
    to FIFOs at once, test_hostile_files. A static host program that spins stands in for an
    ldconfig stuck on something our checks could not see, e.g. a FIFO swapped in after them.)"""
    path = workdir / "config.toml"
    text = f"deadline = {DEADLINE}\n"
    if step == "ldconfig":
        src = workdir / "spin.c"
        src.write_text("int main(void) { for (;;) {} }\n")
        subprocess.run(["gcc", "-static", "-O0", "-o", str(workdir / "spin"), str(src)], check=True,
                       timeout=RUN_SECONDS)
        text += f'ldconfig = "@{workdir / "spin"}"\n'
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("variant", s.variants((s.DIRECT_V1,), s.DIRECT), ids=str)
@pytest.mark.parametrize("step", ["nvml", "ldconfig"])
def test_a_step_hangs_direct(fake_machine_factory, sec_machine, workdir, step, variant):
    machine = fake_machine_factory(FakeSpec(gpus=2, init_delay_ms=120_000)) if step == "nvml" else sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    with s.Container(rootfs, cgroup_version=_cg(variant)) as c:
        mine = set(descendants())
        started = time.monotonic()
        res = subprocess.run(s.configure_command(machine, variant, c.pid, rootfs,
                                                 global_args=["--config", _config(workdir, step)]),
                             capture_output=True, text=True, timeout=RUN_SECONDS)
        took = time.monotonic() - started
        line = s.one_line(res.stderr, "nvcontainer: ")
        assert "timed out" in line or "deadline" in line, line
        assert took < DEADLINE + 4, f"{step}: a {DEADLINE}s deadline took {took:.1f}s"
        left = s.stray(mine)
        assert not left, f"left running after the deadline: {left}"


@pytest.mark.parametrize("variant", s.variants((s.RUNC_V1,), s.RUNTIMES), ids=str)
@pytest.mark.parametrize("step", ["nvml", "ldconfig"])
def test_a_step_hangs_under_a_runtime(fake_machine_factory, sec_machine, workdir, step, variant):
    s.need_runtime(variant, sec_machine)
    machine = fake_machine_factory(FakeSpec(gpus=2, init_delay_ms=120_000)) if step == "nvml" else sec_machine
    started = time.monotonic()
    run = s.run_runtime(machine, workdir, variant, hook_args=["--config", _config(workdir, step)])
    took = time.monotonic() - started
    out = run.outcome
    assert out.returncode != 0 and "DONE" not in out.facts
    line = s.one_line(out.stderr, "nvcontainer-hook: ")
    assert "timed out" in line or "deadline" in line, line
    assert took < DEADLINE + 8, f"{step}: a {DEADLINE}s deadline took {took:.1f}s"


# --- many at once ------------------------------------------------------------------------------


def _many(count: int, shared_every: int):
    """Index -> (gpu, shares the common rootfs?)."""
    return [(i % 2, i % shared_every == 0) for i in range(count)]


def test_many_containers_at_once_direct(sec_machine, workdir):
    machine = sec_machine
    s.allow_seconds(400)
    shared = fresh_image(workdir / "shared", machine)
    plan = _many(SIMULTANEOUS, 4)
    containers = []
    try:
        for i, (gpu, common) in enumerate(plan):
            rootfs = shared if common else fresh_image(workdir / f"r{i}", machine)
            containers.append(s.Container(rootfs))

        def one(i):
            gpu, _ = plan[i]
            c = containers[i]
            argv = s.configure_command(machine, s.DIRECT_V1, c.pid, c.rootfs, args=("-d", str(gpu), "-c", "-u"))
            return subprocess.run(argv, capture_output=True, text=True, timeout=300)

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(plan)) as pool:
            results = list(pool.map(one, range(len(plan))))
        for i, res in enumerate(results):
            gpu, common = plan[i]
            assert res.returncode == 0, f"container {i} (shared rootfs: {common}): {res.stderr}"
            want = {f"c {a}:{b} rw" for a, b in s.expected_allowed(machine, (gpu,))}
            assert containers[i].cgroup.rules() == want, f"container {i}: {sorted(containers[i].cgroup.rules())}"
    finally:
        for c in containers:
            c.stop()


@pytest.mark.parametrize("variant", s.variants((s.RUNC_V1,), (s.RUNC_V1, s.RUNC_V2, s.CRUN_V1)), ids=str)
def test_many_containers_at_once_runtime(sec_machine, workdir, variant):
    s.need_runtime(variant, sec_machine)
    machine = sec_machine
    s.allow_seconds(400)
    shared = fresh_image(workdir / "shared", machine)
    plan = _many(SIMULTANEOUS, 4)
    bundles = [s.make_runtime_bundle(machine, workdir, variant, env=[f"NVIDIA_VISIBLE_DEVICES={gpu}"],
                                     rootfs=shared if common else None) for gpu, common in plan]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(plan)) as pool:
        runs = list(pool.map(lambda b: s.run_runtime(machine, workdir, variant, bundle=b[0], record=b[1],
                                                     timeout=300), bundles))
    for i, run in enumerate(runs):
        gpu, common = plan[i]
        out = run.outcome
        assert out.returncode == 0 and "DONE" in out.facts, \
            f"container {i} (shared rootfs: {common}): {out.stderr or out.runtime_stderr[-400:]}"
        assert run.granted == s.expected_allowed(machine, (gpu,)), f"container {i}: {sorted(run.granted)}"
