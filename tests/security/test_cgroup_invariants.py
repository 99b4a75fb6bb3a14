"""The devices cgroup: exactly the requested devices, on v1 and v2, and never a moment open.

Which devices a container may use is decided black-box: device nodes of every major:minor the
fake machine has are opened for reading and for writing from inside the container's cgroup
(ENXIO: allowed through to a driver that is not there; EPERM: denied), so v1 and v2 are judged
by the same answer. On v1 the cgroup's ``devices.list`` must moreover be exactly the requested
rules. On v2 the runtime's program must be replaced, not joined by ours (the count stays 1
however many runs share the cgroup, and the program does not grow once it holds the rules),
and a sampler counting the attached programs as fast as it can must never see 0 (a cgroup
without a device program allows every device) — with ``BPF_F_REPLACE``, and with the
attach-then-detach fallback of kernels before 5.6, where 2 is allowed but 0 is not.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.security import _support as s
from tests.security.conftest import RUN_SECONDS, fresh_image

RUNS = s.scale(5, 60)


def _rules(machine, gpus) -> set[str]:
    return {f"c {a}:{b} rw" for a, b in s.expected_allowed(machine, gpus)}


def _configure(machine, variant, c, rootfs, args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(s.configure_command(machine, variant, c.pid, rootfs, args, **kw), capture_output=True,
                          text=True, timeout=RUN_SECONDS)


@pytest.mark.parametrize("gpus", [(0,), (1,), (0, 1)], ids=lambda g: "gpu" + "+".join(map(str, g)))
@pytest.mark.parametrize("variant", s.variants((s.DIRECT_V1, s.DIRECT_V2), s.DIRECT), ids=str)
def test_exact_rules_direct(sec_machine, workdir, variant, gpus):
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    probe = s.Probe(machine, workdir / "probe")
    with s.Container(rootfs, cgroup_version=2 if variant.cgroup2 else 1) as c:
        res = _configure(machine, variant, c, rootfs, ("-d", ",".join(map(str, gpus)), "-c", "-u"))
        assert res.returncode == 0, res.stderr
        assert probe.granted(c.cgroup) == s.expected_allowed(machine, gpus)
        if c.cgroup.version == 1:
            assert c.cgroup.rules() == _rules(machine, gpus)
        else:
            assert len(c.cgroup.programs()) == 1


@pytest.mark.parametrize("variant", (s.DIRECT_V1, s.DIRECT_V2), ids=str)
def test_no_cgroups_adds_nothing(sec_machine, workdir, variant):
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    probe = s.Probe(machine, workdir / "probe")
    with s.Container(rootfs, cgroup_version=2 if variant.cgroup2 else 1) as c:
        before = c.cgroup.programs() if c.cgroup.version == 2 else []
        res = _configure(machine, variant, c, rootfs, ("-d", "0", "-c", "-u", "--no-cgroups"))
        assert res.returncode == 0, res.stderr
        assert probe.granted(c.cgroup) == set()
        if c.cgroup.version == 1:
            assert c.cgroup.rules() == set()
        else:
            assert c.cgroup.programs() == before


@pytest.mark.parametrize("variant", s.variants((s.RUNC_V1, s.RUNC_V2, s.CRUN_V1, s.CRUN_V2), s.RUNTIMES), ids=str)
def test_exact_rules_runtime(sec_machine, workdir, variant):
    s.need_runtime(variant, sec_machine)
    machine = sec_machine
    run = s.run_runtime(machine, workdir, variant, env=["NVIDIA_VISIBLE_DEVICES=1"], opts={"sample": True})
    out = run.outcome
    assert out.returncode == 0 and "DONE" in out.facts, out.stderr or out.runtime_stderr
    assert run.granted == s.expected_allowed(machine, (1,))
    if run.record["cgroup_version"] == 1:
        assert out.rules == _rules(machine, (1,))
    else:
        assert len(run.record["devices_before"]) == 1, "the runtime attached no program or several"
        assert len(run.record["devices_after"]) == 1, "our program joined the runtime's instead of replacing it"
        assert run.record["devices_after"] != run.record["devices_before"]
        low, high, n = run.record["sample"]
        assert low == high == 1, f"device programs went from {low} to {high} ({n} samples)"


@pytest.mark.parametrize("no_replace", [False, True], ids=["replace", "attach-then-detach"])
def test_v2_program_count_stable_and_never_zero(sec_machine, workdir, no_replace):
    """Many runs on one cgroup v2 (containers sharing a pod's cgroup, or restarted in place):
    still one program afterwards, the same length after the first run, every other device
    still denied, and never a moment without a program."""
    s.allow_seconds(600)
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    probe = s.Probe(machine, workdir / "probe")
    cgroup = s.Cgroup.create(2)
    sampler = s.Sampler(cgroup.path)
    lengths = []
    try:
        for i in range(RUNS):
            gpus = (i % 2,)
            with s.Container(rootfs, cgroup=cgroup) as c:
                res = _configure(machine, s.DIRECT_V2, c, rootfs, ("-d", str(gpus[0]), "-c", "-u"),
                                 no_replace=no_replace)
                assert res.returncode == 0, res.stderr
            programs = cgroup.programs()
            assert len(programs) == 1, f"run {i}: {len(programs)} programs attached"
            lengths.append(s.program_length(programs[0]))
        # both GPUs were asked for by some run: the shared cgroup allows both, and nothing else
        assert probe.granted(cgroup) == s.expected_allowed(machine, (0, 1))
    finally:
        low, high, n = sampler.stop()
        cgroup.remove()
    assert len(set(lengths[1:])) == 1, f"the program grows run after run: {lengths}"
    assert low >= 1, f"{n} samples saw a cgroup without a device program"
    assert high <= (2 if no_replace else 1), (low, high, n)
