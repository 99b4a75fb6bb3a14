"""The slice of bpf(2) that device cgroups need, and a tiny eBPF instruction encoder.

Why hand-written ctypes: no standard-library module speaks bpf(2), and the packages that do are
heavy or do not cover cgroup device programs. Only six commands are needed. libc is loaded on
first use, so importing this module costs nothing on paths that never touch cgroup v2.

Every wrapper raises ``OSError`` with the kernel's errno; callers turn that into a message that
names the step. Program fds from the kernel are always close-on-exec.

Instruction layout (``struct bpf_insn``, 8 bytes): opcode, dst register in the low nibble and
src register in the high nibble of byte 1 (little-endian hosts, the only ones supported), a
signed 16-bit offset and a signed 32-bit immediate.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import NamedTuple

# --- instruction encoding --------------------------------------------------------------------

# classes
LD, LDX, ST, STX, ALU, JMP, JMP32, ALU64 = range(8)
# sizes (load/store)
W, H, B, DW = 0x00, 0x08, 0x10, 0x18
# modes (load/store)
IMM, ABS, IND, MEM, MEMSX, ATOMIC = 0x00, 0x20, 0x40, 0x60, 0x80, 0xC0
# operand source (ALU/JMP)
K, X = 0x00, 0x08
# ALU operations
ADD, SUB, MUL, DIV, OR, AND, LSH, RSH, NEG, MOD, XOR, MOV, ARSH, END = range(0x00, 0xE0, 0x10)
# JMP operations
JA, JEQ, JGT, JGE, JSET, JNE, JSGT, JSGE, CALL, EXIT, JLT, JLE, JSLT, JSLE = range(0x00, 0xE0, 0x10)

MAX_REG = 10          # r0..r9 plus the read-only frame pointer r10
INSN_SIZE = 8
_INSN = struct.Struct("<BBhi")


def _s32(value: int) -> int:
    """An immediate as the signed 32-bit field stores it (accepts u32 spellings)."""
    if not -(1 << 31) <= value < (1 << 32):
        raise ValueError(f"immediate out of range: {value}")
    return value - (1 << 32) if value >= (1 << 31) else value


class Insn(NamedTuple):
    code: int
    dst: int = 0
    src: int = 0
    off: int = 0
    imm: int = 0

    def encode(self) -> bytes:
        return _INSN.pack(self.code, (self.src << 4) | self.dst, self.off, self.imm)


def encode(insns: list[Insn]) -> bytes:
    return b"".join(i.encode() for i in insns)


def decode(data: bytes) -> list[Insn]:
    if len(data) % INSN_SIZE:
        raise ValueError("instruction stream is not a multiple of 8 bytes")
    out = []
    for code, regs, off, imm in _INSN.iter_unpack(data):
        out.append(Insn(code, regs & 0x0F, regs >> 4, off, imm))
    return out


def mov64_imm(dst: int, imm: int) -> Insn:
    return Insn(ALU64 | MOV | K, dst, 0, 0, _s32(imm))


def mov32_imm(dst: int, imm: int) -> Insn:
    return Insn(ALU | MOV | K, dst, 0, 0, _s32(imm))


def mov32_reg(dst: int, src: int) -> Insn:
    return Insn(ALU | MOV | X, dst, src)


def alu32_imm(op: int, dst: int, imm: int) -> Insn:
    return Insn(ALU | op | K, dst, 0, 0, _s32(imm))


def ldx_w(dst: int, src: int, off: int) -> Insn:
    """dst = *(u32 *)(src + off)"""
    return Insn(LDX | MEM | W, dst, src, off)


def jmp_imm(op: int, dst: int, imm: int, off: int) -> Insn:
    """if (dst <op> imm) goto pc + 1 + off, comparing all 64 bits."""
    return Insn(JMP | op | K, dst, 0, off, _s32(imm))


def exit_insn() -> Insn:
    return Insn(JMP | EXIT)


def reload_problem(insns: list[Insn]) -> str | None:
    """Why a program read back from the kernel cannot be loaded again as it is, or None.

    The kernel's "xlated" dump is the program after the verifier rewrote it. Plain ALU, jump,
    load and store instructions come back exactly as loaded, so a program made only of those
    means the same thing when loaded again. Helper calls carry kernel-internal offsets, map
    references carry ids instead of fds, and constant blinding adds a hidden register: such a
    program would fail to load or, worse, load with a different meaning, so it is refused.
    """
    n = len(insns)
    i = 0
    while i < n:
        ins = insns[i]
        cls, op = ins.code & 0x07, ins.code & 0xF0
        if ins.dst > MAX_REG or ins.src > MAX_REG:
            return f"instruction {i} uses an internal register (constant blinding?)"
        if cls == LD:
            if ins.code != LD | IMM | DW or ins.src != 0:
                return f"instruction {i} references a map or packet data"
            if i + 1 >= n or insns[i + 1].code != 0:
                return f"instruction {i} is a truncated 64-bit load"
            i += 2
            continue
        if cls == LDX and ins.code & 0xE0 not in (MEM, MEMSX):
            return f"instruction {i} is a special load"
        if cls == ST and ins.code & 0xE0 != MEM:
            return f"instruction {i} is a special store"
        if cls == STX and ins.code & 0xE0 not in (MEM, ATOMIC):
            return f"instruction {i} is a special store"
        if cls in (ALU, ALU64) and op > END:
            return f"instruction {i} has an unknown ALU operation"
        if cls in (JMP, JMP32):
            if op == CALL:
                return f"instruction {i} calls a function"
            if op > JSLE or (op == EXIT and cls == JMP32):
                return f"instruction {i} has an unknown jump operation"
            if op != EXIT:
                delta = ins.imm if (cls == JMP32 and op == JA) else ins.off
                if not 0 <= i + 1 + delta < n:
                    return f"instruction {i} jumps outside the program"
        i += 1
    return None


# --- bpf(2) ----------------------------------------------------------------------------------

PROG_LOAD = 5
PROG_ATTACH = 8
PROG_DETACH = 9
PROG_GET_FD_BY_ID = 13
OBJ_GET_INFO_BY_FD = 15
PROG_QUERY = 16

PROG_TYPE_CGROUP_DEVICE = 15
CGROUP_DEVICE = 6                 # attach type

F_ALLOW_OVERRIDE = 1
F_ALLOW_MULTI = 2
F_REPLACE = 4

MAX_PROGS = 64                    # BPF_CGROUP_MAX_PROGS: programs per cgroup and attach type
MAX_INSNS = 1_000_000             # BPF_COMPLEXITY_LIMIT_INSNS: largest loadable program
LOG_SIZE = 256 * 1024

_NR_BPF = {"x86_64": 321, "aarch64": 280}
# The kernel copies at most sizeof(union bpf_attr) and, for some commands, writes results at
# fixed offsets (query's revision) whatever size we pass: give it zeroed room to spare.
_ATTR_ROOM = 256

_u32, _u64 = ctypes.c_uint32, ctypes.c_uint64


class _LoadAttr(ctypes.Structure):
    _fields_ = [
        ("prog_type", _u32), ("insn_cnt", _u32), ("insns", _u64), ("license", _u64),
        ("log_level", _u32), ("log_size", _u32), ("log_buf", _u64), ("kern_version", _u32),
        ("prog_flags", _u32), ("prog_name", ctypes.c_char * 16), ("prog_ifindex", _u32),
        ("expected_attach_type", _u32),
    ]


class _AttachAttr(ctypes.Structure):
    _fields_ = [
        ("target_fd", _u32), ("attach_bpf_fd", _u32), ("attach_type", _u32),
        ("attach_flags", _u32), ("replace_bpf_fd", _u32),
    ]


class _QueryAttr(ctypes.Structure):
    _fields_ = [
        ("target_fd", _u32), ("attach_type", _u32), ("query_flags", _u32), ("attach_flags", _u32),
        ("prog_ids", _u64), ("prog_cnt", _u32), ("_pad", _u32),
    ]


class _GetFdAttr(ctypes.Structure):
    _fields_ = [("prog_id", _u32), ("next_id", _u32), ("open_flags", _u32)]


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", _u32), ("info_len", _u32), ("info", _u64)]


class _ProgInfo(ctypes.Structure):
    _fields_ = [
        ("type", _u32), ("id", _u32), ("tag", ctypes.c_ubyte * 8), ("jited_prog_len", _u32),
        ("xlated_prog_len", _u32), ("jited_prog_insns", _u64), ("xlated_prog_insns", _u64),
        ("load_time", _u64), ("created_by_uid", _u32), ("nr_map_ids", _u32), ("map_ids", _u64),
        ("name", ctypes.c_char * 16),
    ]


class ProgInfo(NamedTuple):
    id: int
    type: int
    nr_map_ids: int
    insns: list[Insn]   # the verifier's rewritten ("xlated") program


_libc = None


def _bpf(cmd: int, attr_type: type[ctypes.Structure], **values) -> tuple[int, ctypes.Structure]:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL("libc.so.6", use_errno=True)
        lib.syscall.restype = ctypes.c_long
        _libc = lib
    nr = _NR_BPF.get(os.uname().machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"bpf: unsupported architecture {os.uname().machine}")
    room = (ctypes.c_ubyte * _ATTR_ROOM)()
    attr = attr_type.from_buffer(room)
    for name, value in values.items():
        setattr(attr, name, value)
    ret = _libc.syscall(
        ctypes.c_long(nr), ctypes.c_long(cmd), ctypes.byref(room), ctypes.c_uint(ctypes.sizeof(attr_type))
    )
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret, attr


def prog_query(cgroup_fd: int, attach_type: int = CGROUP_DEVICE) -> tuple[int, list[int]]:
    """(attach flags, ids) of the programs attached directly to the cgroup."""
    ids = (_u32 * MAX_PROGS)()
    try:
        _, attr = _bpf(
            PROG_QUERY, _QueryAttr, target_fd=cgroup_fd, attach_type=attach_type,
            prog_ids=ctypes.addressof(ids), prog_cnt=MAX_PROGS,
        )
    except OSError as exc:
        if exc.errno == errno.ENOSPC:   # only if a future kernel lifts its own limit
            raise OSError(errno.ENOSPC, f"more than {MAX_PROGS} programs attached") from None
        raise
    return attr.attach_flags, list(ids[: attr.prog_cnt])


def prog_get_fd_by_id(prog_id: int) -> int:
    fd, _ = _bpf(PROG_GET_FD_BY_ID, _GetFdAttr, prog_id=prog_id)
    return fd


def prog_info(prog_fd: int) -> ProgInfo:
    info = _ProgInfo()
    _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr, bpf_fd=prog_fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info))
    size = info.xlated_prog_len
    if size == 0:
        raise OSError(errno.EACCES, "the kernel does not show this program's instructions")
    if size > MAX_INSNS * INSN_SIZE or size % INSN_SIZE:
        raise OSError(errno.E2BIG, f"implausible program size {size}")
    buf = ctypes.create_string_buffer(size)
    again = _ProgInfo(xlated_prog_len=size, xlated_prog_insns=ctypes.addressof(buf))
    _bpf(OBJ_GET_INFO_BY_FD, _InfoAttr, bpf_fd=prog_fd, info_len=ctypes.sizeof(again), info=ctypes.addressof(again))
    if again.xlated_prog_len != size:
        raise OSError(errno.EAGAIN, "program changed while it was read")
    return ProgInfo(info.id, info.type, info.nr_map_ids, decode(buf.raw))


def _raise_memlock() -> bool:
    """Kernels before 5.11 charge programs to RLIMIT_MEMLOCK; lift it (root may) once."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        return False
    return True


def prog_load(insns: list[Insn], name: str, prog_type: int = PROG_TYPE_CGROUP_DEVICE) -> int:
    """Load a program; on rejection the verifier's last words are in the error message."""
    code = encode(insns)
    code_buf = ctypes.create_string_buffer(code, len(code))
    license_buf = ctypes.create_string_buffer(b"Apache")
    args = dict(
        prog_type=prog_type, insn_cnt=len(insns), insns=ctypes.addressof(code_buf),
        license=ctypes.addressof(license_buf), prog_name=name.encode()[:15],
    )
    try:
        fd, _ = _bpf(PROG_LOAD, _LoadAttr, **args)
        return fd
    except OSError as exc:
        if exc.errno == errno.EPERM and _raise_memlock():
            return prog_load(insns, name, prog_type)
        if exc.errno not in (errno.EINVAL, errno.EACCES, errno.E2BIG):
            raise
    # Verification failed: load again with a log only now, since logging slows the verifier.
    log = ctypes.create_string_buffer(LOG_SIZE)
    try:
        fd, _ = _bpf(PROG_LOAD, _LoadAttr, log_level=1, log_size=LOG_SIZE, log_buf=ctypes.addressof(log), **args)
    except OSError as exc:
        # The log ends with statistics ("processed N insns ..."); the reason comes just before.
        lines = [ln for ln in log.value.decode("utf-8", "replace").splitlines() if ln.strip()]
        reasons = [ln for ln in lines if not ln.startswith("processed ")]
        tail = reasons[-1] if reasons else "no verifier log"
        raise OSError(exc.errno, f"{os.strerror(exc.errno)}: verifier: {tail}") from None
    return fd


def prog_attach(
    cgroup_fd: int, prog_fd: int, flags: int, replace_fd: int = 0, attach_type: int = CGROUP_DEVICE
) -> None:
    _bpf(
        PROG_ATTACH, _AttachAttr, target_fd=cgroup_fd, attach_bpf_fd=prog_fd, attach_type=attach_type,
        attach_flags=flags, replace_bpf_fd=replace_fd,
    )


def prog_detach(cgroup_fd: int, prog_fd: int, attach_type: int = CGROUP_DEVICE) -> None:
    _bpf(PROG_DETACH, _AttachAttr, target_fd=cgroup_fd, attach_bpf_fd=prog_fd, attach_type=attach_type)
