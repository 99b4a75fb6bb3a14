"""Which device nodes a cgroup lets its processes open: the reading side of the device rules.

``nvcontainer ps`` asks, for each running container, which GPU minors its device cgroup allows.
cgroup v1 answers in ``devices.list``; cgroup v2 has no list, only the eBPF programs attached
to the cgroup (the runtime's, with our prefix when the hook added rules). Those programs are
loop-free sequences of context loads, ALU operations and forward jumps, so the question is
answered by running each program here, in a small interpreter, on the access a CUDA process
makes (read and write of ``c MAJOR:MINOR``). Every program attached must allow it (the kernel
ANDs them); a cgroup without a program allows every device.

A grant of the whole major (``c 195:* rwm``, a privileged container) says nothing about which
GPU a container uses, so it is reported as ``everything`` rather than as every minor.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from . import bpf
from .bpf import Insn

MAX_DEVICES_LIST = 1 << 20
MAX_STEPS = 1 << 20          # instructions executed per verdict: programs are loop-free
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1

# struct bpf_cgroup_dev_ctx access bits and device types, as the kernel fills them in
ACC_READ, ACC_WRITE = 2, 4
DEV_CHAR = 2


# --- cgroup v1 ---------------------------------------------------------------------------------


def parse_devices_list(text: str, major: int) -> tuple[frozenset[int], bool]:
    """(char minors of ``major`` allowed for reading and writing, whether the whole major is)."""
    minors: set[int] = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 3:
            continue
        kind, numbers, access = fields
        if kind not in ("a", "c") or not {"r", "w"} <= set(access):
            continue
        if kind == "a":
            return frozenset(), True
        want, _, minor = numbers.partition(":")
        if want not in ("*", str(major)):
            continue
        if minor == "*":
            return frozenset(), True
        if minor.isascii() and minor.isdigit():
            minors.add(int(minor))
    return frozenset(minors), False


# --- cgroup v2: an interpreter for device programs ---------------------------------------------


def _operand(ins: Insn, regs: list[int]) -> int:
    return regs[ins.src] if ins.code & bpf.X else ins.imm & _U64


def _alu(op: int, a: int, b: int, mask: int) -> int:
    a, b = a & mask, b & mask
    if op == bpf.MOV:
        return b
    if op == bpf.ADD:
        return a + b
    if op == bpf.SUB:
        return a - b
    if op == bpf.AND:
        return a & b
    if op == bpf.OR:
        return a | b
    if op == bpf.XOR:
        return a ^ b
    if op == bpf.LSH:
        return a << (b & (63 if mask == _U64 else 31))
    if op == bpf.RSH:
        return a >> (b & (63 if mask == _U64 else 31))
    if op == bpf.NEG:
        return -a
    raise ValueError(f"unsupported ALU operation {op:#x}")


def _jump(op: int, a: int, b: int) -> bool:
    if op == bpf.JEQ:
        return a == b
    if op == bpf.JNE:
        return a != b
    if op == bpf.JSET:
        return bool(a & b)
    if op == bpf.JGT:
        return a > b
    if op == bpf.JGE:
        return a >= b
    if op == bpf.JLT:
        return a < b
    if op == bpf.JLE:
        return a <= b
    raise ValueError(f"unsupported jump operation {op:#x}")


def run_program(insns: list[Insn], dev_type: int, access: int, major: int, minor: int) -> int:
    """The program's verdict (r0) for one access. Raises ``ValueError`` on an instruction a
    device program of a runtime does not use (maps, helper calls, signed compares, loops)."""
    ctx = {0: ((access << 16) | dev_type) & _U32, 4: major & _U32, 8: minor & _U32}
    regs = [0] * (bpf.MAX_REG + 1)
    pc = steps = 0
    while 0 <= pc < len(insns) and steps < MAX_STEPS:
        ins, steps = insns[pc], steps + 1
        pc += 1
        cls, op = ins.code & 0x07, ins.code & 0xF0
        if cls == bpf.LDX and ins.code == bpf.LDX | bpf.MEM | bpf.W and ins.src == 1 and ins.off in ctx:
            regs[ins.dst] = ctx[ins.off]
        elif cls == bpf.LD and ins.code == bpf.LD | bpf.IMM | bpf.DW and pc < len(insns):
            regs[ins.dst] = ((insns[pc].imm & _U32) << 32 | ins.imm & _U32) & _U64
            pc += 1
        elif cls in (bpf.ALU, bpf.ALU64):
            mask = _U64 if cls == bpf.ALU64 else _U32
            regs[ins.dst] = _alu(op, regs[ins.dst], _operand(ins, regs), mask) & mask
        elif cls in (bpf.JMP, bpf.JMP32) and op == bpf.EXIT:
            return regs[0] & _U32
        elif cls in (bpf.JMP, bpf.JMP32) and op == bpf.JA:
            pc += ins.off
        elif cls in (bpf.JMP, bpf.JMP32):
            mask = _U64 if cls == bpf.JMP else _U32
            if _jump(op, regs[ins.dst] & mask, _operand(ins, regs) & mask):
                if ins.off < 0:
                    raise ValueError("backward jump")
                pc += ins.off
        else:
            raise ValueError(f"unsupported instruction {ins.code:#x} at {pc - 1}")
    raise ValueError("the program ran off its end")


def programs_allow(programs: Iterable[list[Insn]], major: int, minors: Iterable[int]) -> tuple[frozenset[int], bool]:
    """(the ``minors`` every program allows, whether a minor outside them all is allowed too).

    The probe for "everything" is a minor no GPU has (253 and below are GPU minors, 254 and 255
    the modeset and control nodes): a program that allows it grants the whole major."""
    programs = list(programs)
    minors = list(minors)

    def allowed(minor: int) -> bool:
        return all(run_program(p, DEV_CHAR, ACC_READ | ACC_WRITE, major, minor) for p in programs)

    probe = next(m for m in range(253, -1, -1) if m not in minors)
    if allowed(probe):
        return frozenset(), True
    return frozenset(m for m in minors if allowed(m)), False


# --- readers ----------------------------------------------------------------------------------


def _open(path: str, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NvcError("cgroup", f"{escape(path)} went away") from None
    except OSError as exc:
        raise NvcError("cgroup", f"cannot open {escape(path)}: {exc.strerror.lower()}") from None


def _devices_list(directory: str, major: int) -> tuple[frozenset[int], bool]:
    path = os.path.join(directory, "devices.list")
    fd = _open(path, os.O_NOCTTY)
    try:
        data, more = read_at_most(fd, MAX_DEVICES_LIST)
    finally:
        os.close(fd)
    if more:
        raise NvcError("cgroup", f"{escape(path)} is larger than {MAX_DEVICES_LIST} bytes")
    return parse_devices_list(os.fsdecode(data), major)


def _programs(directory: str) -> list[list[Insn]]:
    dfd = _open(directory, os.O_DIRECTORY)
    programs = []
    try:
        _, ids = bpf.prog_query(dfd)
        for prog_id in ids:
            pfd = bpf.prog_get_fd_by_id(prog_id)
            try:
                programs.append(bpf.prog_info(pfd).insns)
            finally:
                os.close(pfd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise NvcError("cgroup", f"cgroup {escape(directory)} went away") from None
        raise NvcError("cgroup", f"reading the device programs of {escape(directory)} failed: "
                                 f"{escape(exc.strerror or os.strerror(exc.errno))}") from None
    finally:
        os.close(dfd)
    return programs


def allowed_minors(version: int, directory: str, major: int, minors: Iterable[int]) -> tuple[frozenset[int], bool]:
    """What the device cgroup at ``directory`` allows of ``c major:minor`` (see the pure parts)."""
    if version == 1:
        return _devices_list(directory, major)
    programs = _programs(directory)
    if not programs:
        return frozenset(), True
    try:
        return programs_allow(programs, major, minors)
    except ValueError as exc:
        raise NvcError("cgroup", f"cannot read the device program of {escape(directory)}: {exc}") from None
