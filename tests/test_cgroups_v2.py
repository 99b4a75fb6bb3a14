"""cgroup v2 device programs: splicing rules into a runtime's program, pure and for real.

The real tests attach a program shaped like runc's (context loads into r2..r5, one block per
allowed device that clobbers r1, default deny) to a fresh cgroup under the cgroup2 mount, then
check verdicts by opening device nodes from processes inside it, and count attached programs
with bpftool as an independent witness.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import subprocess

import pytest

from nvcontainer.cgroups import bpf, v2
from nvcontainer.cgroups.bpf import AND, JMP, JNE, LD, RSH, X, Insn, alu32_imm, exit_insn, jmp_imm, ldx_w
from nvcontainer.cgroups.bpf import mov32_imm, mov32_reg, mov64_imm
from nvcontainer.cgroups.rules import Rule
from nvcontainer.errors import NvcError

from .test_cgroups import fresh_cgroup, make_nodes, open_errno, remove_cgroup

V2_ROOT = "/sys/fs/cgroup/unified"
C195_0 = Rule("c", 195, 0, "rw")
C195_1 = Rule("c", 195, 1, "rw")


def runc_like(allowed: list[tuple[int, int]]) -> list[Insn]:
    """Deny-by-default program in the shape runc generates (rw access, char devices)."""
    prog = [ldx_w(2, 1, 0), alu32_imm(AND, 2, 0xFFFF), ldx_w(3, 1, 0), alu32_imm(RSH, 3, 16),
            ldx_w(4, 1, 4), ldx_w(5, 1, 8)]
    for major, minor in allowed:
        prog += [
            jmp_imm(JNE, 2, 2, 7),
            mov32_reg(1, 3),
            alu32_imm(AND, 1, 6),
            Insn(JMP | JNE | X, 1, 3, 4),   # requested access not within rw
            jmp_imm(JNE, 4, major, 3),
            jmp_imm(JNE, 5, minor, 2),
            mov32_imm(0, 1),
            exit_insn(),
        ]
    return prog + [mov32_imm(0, 0), exit_insn()]


# --- pure ------------------------------------------------------------------------------------


def test_prefix_round_trips_through_split():
    tail = runc_like([(1, 3)])
    rules = (C195_0, Rule("b", 8, 1, "r"), Rule("c", 10, 200, "rwm"))
    assert v2.split_program(v2.rules_prefix(rules) + tail) == (rules, tail)


def test_foreign_or_tampered_programs_are_not_ours():
    tail = runc_like([(1, 3)])
    assert v2.split_program(tail) == ((), tail)
    ours = v2.rules_prefix((C195_0,)) + tail
    tampered = list(ours)
    tampered[11] = jmp_imm(JNE, 5, 7, 1)          # minor compare with a different jump
    assert v2.split_program(tampered) == ((), tampered)
    wrong_count = [ours[0], mov64_imm(0, 500)] + ours[2:]
    assert v2.split_program(wrong_count) == ((), wrong_count)


def test_merge_unions_rules_and_keeps_original_once():
    tail = runc_like([(1, 3)])
    first = v2.merge_program(tail, [C195_0])
    assert first == v2.rules_prefix((C195_0,)) + tail
    assert v2.merge_program(first, [C195_0]) is None           # nothing new: leave it alone
    assert v2.merge_program(tail, []) is None
    second = v2.merge_program(first, [C195_1, C195_0])
    assert second == v2.rules_prefix((C195_0, C195_1)) + tail  # fresh merge, not stacked


def test_block_semantics_by_interpretation():
    """Run our prefix in a minimal interpreter over the context values: checks what each
    comparison means, independently of the kernel."""
    prog = v2.rules_prefix((Rule("c", 195, 0, "rw"),)) + [mov64_imm(0, 0), exit_insn()]

    def run(dev_type, access, major, minor):
        ctx = {0: (access << 16) | dev_type, 4: major, 8: minor}
        regs, pc = [0] * 11, 0
        while True:
            ins = prog[pc]
            pc += 1
            if ins.code == bpf.LDX | bpf.MEM | bpf.W:
                regs[ins.dst] = ctx[ins.off]
            elif ins.code == bpf.ALU64 | bpf.MOV:
                regs[ins.dst] = ins.imm & 0xFFFFFFFFFFFFFFFF
            elif ins.code == bpf.ALU | bpf.AND:
                regs[ins.dst] &= ins.imm & 0xFFFFFFFF
            elif ins.code == bpf.ALU | bpf.RSH:
                regs[ins.dst] = (regs[ins.dst] & 0xFFFFFFFF) >> ins.imm
            elif ins.code == JMP | JNE:
                pc += ins.off if regs[ins.dst] != ins.imm & 0xFFFFFFFFFFFFFFFF else 0
            elif ins.code == JMP | bpf.JSET:
                pc += ins.off if regs[ins.dst] & (ins.imm & 0xFFFFFFFFFFFFFFFF) else 0
            elif ins.code == JMP | bpf.EXIT:
                return regs[0]
            else:
                raise AssertionError(f"unexpected instruction {ins}")

    assert run(2, 2 | 4, 195, 0) == 1     # char, read+write
    assert run(2, 2, 195, 0) == 1         # read only is within rw
    assert run(2, 1, 195, 0) == 0         # mknod is not
    assert run(2, 2 | 4 | 1, 195, 0) == 0
    assert run(1, 2, 195, 0) == 0         # block device with the same numbers
    assert run(2, 2, 195, 1) == 0
    assert run(2, 2, 194, 0) == 0


@pytest.mark.parametrize(
    ("insns", "reason"),
    [
        ([Insn(LD | bpf.IMM | bpf.DW, 1, 1, 0, 7), Insn(0), exit_insn()], "map"),
        ([Insn(JMP | bpf.CALL, imm=5), exit_insn()], "calls a function"),
        ([alu32_imm(AND, 11, 1), exit_insn()], "internal register"),
        ([jmp_imm(JNE, 2, 0, 5), exit_insn()], "jumps outside"),
        ([jmp_imm(JNE, 2, 0, -2), exit_insn()], "jumps outside"),
        ([Insn(bpf.LDX | bpf.ABS | bpf.W), exit_insn()], "special load"),
    ],
)
def test_reload_problem_refuses_unsafe_programs(insns, reason):
    assert reason in bpf.reload_problem(insns)
    with pytest.raises(ValueError, match=reason):
        v2.merge_program(insns, [C195_0])


def test_reload_problem_accepts_plain_programs():
    assert bpf.reload_problem(runc_like([(1, 3), (1, 5)])) is None
    assert bpf.reload_problem([Insn(LD | bpf.IMM | bpf.DW, 2, 0, 0, 7), Insn(0), exit_insn()]) is None


# --- against the kernel ----------------------------------------------------------------------


@pytest.fixture
def nodes(tmp_path):
    return make_nodes(tmp_path)


@pytest.fixture
def cgroup():
    if shutil.which("bpftool") is None:
        pytest.skip("needs bpftool")
    with fresh_cgroup(V2_ROOT) as path:
        yield path


def attach(cgroup: str, program: list[Insn], flags: int = bpf.F_ALLOW_MULTI, name: str = "runc_like") -> None:
    cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        prog = bpf.prog_load(program, name)
        try:
            bpf.prog_attach(cg, prog, flags)
        finally:
            os.close(prog)
    finally:
        os.close(cg)


def attached(cgroup: str) -> list[dict]:
    out = subprocess.run(["bpftool", "-j", "cgroup", "show", cgroup], capture_output=True, text=True, check=True)
    return json.loads(out.stdout) if out.stdout.strip() else []


def verdicts(cgroup: str, nodes) -> dict:
    return {dev: open_errno(cgroup, path) for dev, path in nodes.items()}


ALLOWED_195_0 = {(195, 0): errno.ENXIO, (195, 1): errno.EPERM, (1, 3): 0}


def test_splice_into_runc_program(cgroup, nodes):
    attach(cgroup, runc_like([(1, 3)]))
    before = attached(cgroup)
    assert len(before) == 1
    assert verdicts(cgroup, nodes) == {(195, 0): errno.EPERM, (195, 1): errno.EPERM, (1, 3): 0}

    message = v2.allow(cgroup, [C195_0])
    assert "1 device program" in message
    after = attached(cgroup)
    assert len(after) == 1 and after[0]["id"] != before[0]["id"]
    assert after[0]["name"] == v2.PROG_NAME and after[0]["attach_flags"] == "multi"
    assert verdicts(cgroup, nodes) == ALLOWED_195_0
    dump = subprocess.run(
        ["bpftool", "prog", "dump", "xlated", "id", str(after[0]["id"])], capture_output=True, text=True, check=True
    ).stdout
    assert "if r4 != 0xc3 goto" in dump and "if r4 != 0x1 goto" in dump   # ours, then runc's

    for _ in range(5):   # repeated runs: same program, nothing stacked
        v2.allow(cgroup, [C195_0])
        assert attached(cgroup) == after
    assert verdicts(cgroup, nodes) == ALLOWED_195_0

    v2.allow(cgroup, [C195_1])   # a later run with another device: merged afresh
    merged = attached(cgroup)
    assert len(merged) == 1
    with_both = {(195, 0): errno.ENXIO, (195, 1): errno.ENXIO, (1, 3): 0}
    assert verdicts(cgroup, nodes) == with_both
    dump = subprocess.run(
        ["bpftool", "prog", "dump", "xlated", "id", str(merged[0]["id"])], capture_output=True, text=True, check=True
    ).stdout
    assert dump.count("if r4 != 0xc3 goto") == 2   # one block per rule, no stacked prefix


def test_no_program_attached_needs_nothing(cgroup, nodes):
    message = v2.allow(cgroup, [C195_0])
    assert "no device program" in message
    assert attached(cgroup) == []
    assert verdicts(cgroup, nodes) == {(195, 0): errno.ENXIO, (195, 1): errno.ENXIO, (1, 3): 0}


def test_every_attached_program_is_extended(cgroup, nodes):
    attach(cgroup, runc_like([(1, 3)]))
    attach(cgroup, runc_like([(1, 3), (195, 1)]))
    assert len(attached(cgroup)) == 2
    v2.allow(cgroup, [C195_0])
    progs = attached(cgroup)
    assert [p["name"] for p in progs] == [v2.PROG_NAME, v2.PROG_NAME]
    # Programs are ANDed: 195:1 stays denied because the first program denies it.
    assert verdicts(cgroup, nodes) == ALLOWED_195_0


def test_single_program_mode(cgroup, nodes):
    attach(cgroup, runc_like([(1, 3)]), flags=0)
    v2.allow(cgroup, [C195_0])
    progs = attached(cgroup)
    assert len(progs) == 1 and progs[0]["name"] == v2.PROG_NAME and progs[0]["attach_flags"] == ""
    assert verdicts(cgroup, nodes) == ALLOWED_195_0


def test_without_replace_flag(cgroup, nodes, monkeypatch):
    monkeypatch.setattr(v2, "FORCE_NO_REPLACE", True)
    attach(cgroup, runc_like([(1, 3)]))
    for _ in range(3):
        v2.allow(cgroup, [C195_0, C195_1])
        assert len(attached(cgroup)) == 1
    assert verdicts(cgroup, nodes) == {(195, 0): errno.ENXIO, (195, 1): errno.ENXIO, (1, 3): 0}


def test_program_with_helper_call_is_refused_and_left_alone(cgroup, nodes):
    # r0 = bpf_ktime_get_ns(); r0 = 0; exit  -- denies everything, through a helper call
    attach(cgroup, [Insn(JMP | bpf.CALL, imm=5), mov64_imm(0, 0), exit_insn()], name="helper")
    before = attached(cgroup)
    with pytest.raises(NvcError, match="calls a function") as err:
        v2.allow(cgroup, [C195_0])
    assert cgroup in err.value.detail
    assert attached(cgroup) == before
    assert verdicts(cgroup, nodes)[(195, 0)] == errno.EPERM


def test_verifier_rejection_is_explained():
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with pytest.raises(OSError) as err:
        bpf.prog_load([mov64_imm(0, 1)], "no_exit")   # falls off the end
    assert err.value.errno == errno.EINVAL
    assert err.value.strerror.endswith("verifier: last insn is not an exit or jmp")
    with pytest.raises(OSError) as err:
        bpf.prog_load([jmp_imm(JNE, 2, 0, 0), mov64_imm(0, 1), exit_insn()], "uninit")
    assert err.value.errno == errno.EACCES
    assert err.value.strerror.endswith("verifier: R2 !read_ok")


def test_not_a_cgroup2_directory(tmp_path):
    with pytest.raises(NvcError, match="not a cgroup v2 directory"):
        v2.allow(str(tmp_path), [C195_0])


def test_cgroup_gone_reports_exited():
    with fresh_cgroup(V2_ROOT) as path:
        pass
    with pytest.raises(NvcError, match="container exited during configuration"):
        v2.allow(path, [C195_0])


def test_real_runc_program(tmp_path, nodes):
    """runc's own device program (runc 1.1.5 on Debian 12) is spliced and keeps its verdicts.

    runc picks its cgroup driver from what is mounted at /sys/fs/cgroup, so the container is
    created in a private mount namespace where the cgroup2 hierarchy is bound there.
    """
    if os.geteuid() != 0 or not all(map(shutil.which, ("runc", "busybox", "unshare", "bpftool"))):
        pytest.skip("needs root, runc, busybox, unshare and bpftool")
    name = f"nvc-test-runc-{secrets.token_hex(4)}"
    bundle, state = tmp_path / "bundle", tmp_path / "runc-state"
    (bundle / "rootfs" / "bin").mkdir(parents=True)
    shutil.copy(shutil.which("busybox"), bundle / "rootfs" / "bin" / "busybox")
    os.symlink("busybox", bundle / "rootfs" / "bin" / "sleep")
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    config = json.loads((bundle / "config.json").read_text())
    config["process"].update(args=["sleep", "60"], terminal=False)
    config["linux"]["cgroupsPath"] = "/" + name
    (bundle / "config.json").write_text(json.dumps(config))

    def in_v2_view(command: str, check: bool = True) -> None:
        script = f"mount --make-rprivate / && mount --bind {V2_ROOT} /sys/fs/cgroup && {command}"
        subprocess.run(["unshare", "-m", "sh", "-c", script], check=check, timeout=30,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    cgroup = os.path.join(V2_ROOT, name)
    try:
        in_v2_view(f"runc --root {state} create --bundle {bundle} {name}")
        before = attached(cgroup)
        assert len(before) == 1 and before[0]["name"] != v2.PROG_NAME
        assert verdicts(cgroup, nodes) == {(195, 0): errno.EPERM, (195, 1): errno.EPERM, (1, 3): 0}
        v2.allow(cgroup, [C195_0])
        v2.allow(cgroup, [C195_0])
        after = attached(cgroup)
        assert len(after) == 1 and after[0]["name"] == v2.PROG_NAME
        assert verdicts(cgroup, nodes) == ALLOWED_195_0
    finally:
        in_v2_view(f"runc --root {state} delete --force {name}", check=False)
        if os.path.isdir(cgroup):
            remove_cgroup(cgroup)
