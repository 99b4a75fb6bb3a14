"""Races: a second process swaps directories and symlinks in the rootfs while we work on it.

The attacker (:class:`_support.Attacker`) exchanges, with ``renameat2(RENAME_EXCHANGE)`` in a
tight loop, the directories the hook creates in or mounts onto (the library directory, /etc,
/run, /usr/bin, /tmp/nvidia-mps, ld.so.conf.d, the CUDA compat directory, and /dev on the
direct path) with symlinks to the host sentinel (absolute and ``../``-climbing) or with decoy
directories, and single files the hook mounts onto or writes (libcuda, its SONAME link, the
compat drop-in) with symlinks to the sentinel's victim file. This is what a second container
sharing a volume with this one can do (SECURITY.md §0, CVE-2021-30465, CVE-2024-0132).

Whatever the interleaving, every run must either succeed completely (exactly the requested
devices, exactly the plan's number of mounts) or fail with one clean line, and in both cases:
nothing outside the rootfs changed (conftest's sentinel and host mount table, checked after
every iteration here), every mount added to the container lies inside its rootfs, and no device
beyond the requested ones was allowed. Each variant runs ``scale(3, 1000)`` iterations: the
long run (``NVC_LONG_TESTS=1``) splits its 1,000 into items of 100 so each stays inside
conftest's per-case time bound.
"""

from __future__ import annotations

import pytest

from tests.security import _support as s
from tests.security.conftest import Outcome, fresh_image

ITERATIONS = s.scale(3, 1000)
PER_ITEM = s.scale(3, 100)


def _summary(variant, stats: dict, attack: dict) -> None:
    print(f"\n{variant}: {stats['ok']} succeeded, {stats['failed']} refused cleanly, "
          f"attacker swaps {attack['swaps']}, repairs {attack['repairs']}")


@pytest.mark.parametrize("chunk", s.chunks(ITERATIONS, PER_ITEM))
@pytest.mark.parametrize("variant", s.DIRECT, ids=str)
def test_race_direct(sec_machine, host_sentinel, workdir, variant, chunk):
    s.allow_seconds(600)
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    s.race_image(rootfs)
    probe = s.Probe(machine, workdir / "probe")
    stats = {"ok": 0, "failed": 0}
    with s.Driver(machine, variant) as driver:
        # an undisturbed run first: it must succeed, and gives the plan's mount count
        with s.Container(rootfs, cgroup_version=2 if variant.cgroup2 else 1) as c:
            res = driver.configure(c.pid, rootfs)
            assert res.returncode == 0, res.stderr
            full = len(c.new_mounts())
            assert s.check_run(_outcome(variant, res, c), rootfs, machine, probe.granted(c.cgroup),
                               "nvcontainer: ", full_mounts=full)
        attacker = s.Attacker(rootfs, s.race_swaps(host_sentinel, dev=True))
        try:
            for _ in range(min(PER_ITEM, ITERATIONS - chunk * PER_ITEM)):
                with s.Container(rootfs, cgroup_version=2 if variant.cgroup2 else 1) as c:
                    res = driver.configure(c.pid, rootfs)
                    out = _outcome(variant, res, c)
                    ok = s.check_run(out, rootfs, machine, probe.granted(c.cgroup), "nvcontainer: ",
                                     full_mounts=full)
                    if variant.cgroup2:
                        assert len(c.cgroup.programs()) == 1, "device programs piled up or vanished"
                    else:
                        assert c.cgroup.rules() <= {f"c {a}:{b} rw" for a, b in s.expected_allowed(machine)}
                stats["ok" if ok else "failed"] += 1
                assert not host_sentinel.damage(), host_sentinel.damage()[:5]
        finally:
            attack = attacker.stop()
    _summary(variant, stats, attack)
    assert attack["swaps"] > 0


def _outcome(variant, res, container) -> Outcome:
    return Outcome(variant.name, res.returncode, stderr=res.stderr, new_mounts=container.new_mounts(),
                   host_mounts_in_rootfs=s.mounts_under(s.mounts_of(), container.rootfs))


@pytest.mark.parametrize("chunk", s.chunks(ITERATIONS, PER_ITEM))
@pytest.mark.parametrize("variant", s.RUNTIMES, ids=str)
def test_race_runtime(sec_machine, host_sentinel, workdir, variant, chunk):
    s.allow_seconds(600)
    s.need_runtime(variant, sec_machine)
    machine = sec_machine
    bundle, record = s.make_runtime_bundle(machine, workdir, variant)
    rootfs = (bundle / "rootfs").resolve()
    s.race_image(rootfs)
    first = s.run_runtime(machine, workdir, variant, bundle=bundle, record=record)
    assert s.check_run(first.outcome, rootfs, machine, first.granted, "nvcontainer-hook: ")
    full = len(first.outcome.new_mounts)

    attacker = s.Attacker(rootfs, s.race_swaps(host_sentinel, dev=False))
    stats = {"ok": 0, "failed": 0}
    try:
        # a control run under the same attack: the runtime alone must come through unharmed,
        # or the runs with our hook could not be judged
        control = s.run_runtime(machine, workdir, variant, our_hook=False, rootfs=rootfs)
        assert not host_sentinel.damage(), f"{variant.runtime} alone: {host_sentinel.damage()[:5]}"
        assert control.outcome.returncode == 0, control.outcome.runtime_stderr[-300:]
        for _ in range(min(PER_ITEM, ITERATIONS - chunk * PER_ITEM)):
            run = s.run_runtime(machine, workdir, variant, bundle=bundle, record=record)
            out = run.outcome
            assert out.hook_ran, f"{variant}: the hook never ran: {out.runtime_stderr[-300:]}"
            ok = s.check_run(out, rootfs, machine, run.granted if "DONE" in out.facts else None,
                             "nvcontainer-hook: ", full_mounts=full)
            if ok:
                assert "DONE" in out.facts, f"{variant}: hook succeeded, container did not run: {out.runtime_stderr}"
            else:
                assert "DONE" not in out.facts, f"{variant}: the container ran although the hook failed"
            stats["ok" if ok else "failed"] += 1
            assert not host_sentinel.damage(), host_sentinel.damage()[:5]
    finally:
        attack = attacker.stop()
    _summary(variant, stats, attack)
    assert attack["swaps"] > 0
