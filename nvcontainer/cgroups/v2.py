"""cgroup v2: allow devices by splicing allow rules into the cgroup's eBPF device programs.

On cgroup v2 the runtime attaches a program that decides every device access; there is no
rule file to append to. For each program attached to the container's cgroup we load a new
one made of our allow blocks followed by the original instructions, read back from the
kernel. A block returns 1 ("allow") when type, access, major and minor all match; otherwise
control falls through to the original code, so every verdict it gave is kept. Prepending keeps
the original's relative jumps valid.

The new program then takes the old one's place with ``BPF_F_REPLACE``, an atomic swap: the
cgroup never passes through a state without a program (which would allow every device), and the
number of programs stays the same. Upstream detaches first and attaches after; a kill between
the two leaves the container with all devices. Where the kernel lacks ``BPF_F_REPLACE`` (before
5.6) the new program is attached before the old one is detached: programs are ANDed, so the
overlap never widens access.

Our prefix starts with a marker and the rule count. A later run (a restarted hook, a second
``configure``) recognises it, takes back the rules it holds and the program it was added to,
and merges afresh, so repeated runs neither stack programs nor grow them.

A cgroup with no device program allows every device; nothing is attached then.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from ..errors import NvcError, escape
from ..fs.syscalls import CGROUP2_SUPER_MAGIC, fstatfs_type
from . import bpf
from .bpf import AND, JNE, JSET, RSH, Insn, alu32_imm, exit_insn, jmp_imm, ldx_w, mov64_imm
from .locate import EXITED
from .rules import ACCESS_ORDER, Rule

MAGIC = 0x4E564344            # "NVCD": first instruction of every program we build
PROG_NAME = "nvc_devices"
MAX_RULES = 16384             # ~100k instructions, a tenth of the kernel's limit

# struct bpf_cgroup_dev_ctx: access_type = (BPF_DEVCG_ACC_* << 16) | BPF_DEVCG_DEV_*,
# then major and minor, all u32.
_TYPE_CODE = {"b": 1, "c": 2}
_ACCESS_BIT = {"m": 1, "r": 2, "w": 4}
_HEADER_LEN = 8
_BLOCK_LEN = 6

# Tests set this to exercise the attach-then-detach path that kernels before 5.6 need.
FORCE_NO_REPLACE = False


# --- pure: building and recognising our programs ---------------------------------------------


def _header(count: int) -> list[Insn]:
    return [
        mov64_imm(0, MAGIC),
        mov64_imm(0, count),
        ldx_w(2, 1, 0),                 # r2 = access_type
        alu32_imm(AND, 2, 0xFFFF),      # r2 = device type
        ldx_w(3, 1, 0),
        alu32_imm(RSH, 3, 16),          # r3 = requested access bits
        ldx_w(4, 1, 4),                 # r4 = major
        ldx_w(5, 1, 8),                 # r5 = minor
    ]


def _block(rule: Rule) -> list[Insn]:
    allowed = sum(_ACCESS_BIT[c] for c in rule.access)
    return [
        jmp_imm(JNE, 2, _TYPE_CODE[rule.type], 5),
        jmp_imm(JSET, 3, ~allowed & 0xFFFFFFFF, 4),   # any requested bit outside the rule
        jmp_imm(JNE, 4, rule.major, 3),
        jmp_imm(JNE, 5, rule.minor, 2),
        mov64_imm(0, 1),
        exit_insn(),
    ]


def rules_prefix(rules: Sequence[Rule]) -> list[Insn]:
    """Our allow blocks; r1 (the context) is left untouched for the code that follows."""
    out = _header(len(rules))
    for rule in rules:
        out += _block(rule)
    return out


def _rule_of(block: list[Insn]) -> Rule:
    kind = {v: k for k, v in _TYPE_CODE.items()}[block[0].imm]
    allowed = ~block[1].imm & 0x7
    access = "".join(c for c in ACCESS_ORDER if allowed & _ACCESS_BIT[c])
    return Rule(kind, block[2].imm, block[3].imm, access)


def split_program(insns: list[Insn]) -> tuple[tuple[Rule, ...], list[Insn]]:
    """(rules a previous run added, the program they were added to).

    A program is ours only if its prefix re-encodes exactly from the rules read out of it;
    anything else is treated as foreign, which is always safe: the blocks would only be
    prepended once more.
    """
    if len(insns) <= _HEADER_LEN or insns[0] != mov64_imm(0, MAGIC) or insns[1].code != mov64_imm(0, 0).code:
        return (), insns
    count = insns[1].imm
    end = _HEADER_LEN + count * _BLOCK_LEN
    if not 0 < count <= MAX_RULES or end >= len(insns):
        return (), insns
    try:
        rules = tuple(_rule_of(insns[at:at + _BLOCK_LEN]) for at in range(_HEADER_LEN, end, _BLOCK_LEN))
    except (KeyError, NvcError):
        return (), insns
    if rules_prefix(rules) != insns[:end]:
        return (), insns
    return rules, insns[end:]


def merge_program(existing: list[Insn], rules: Sequence[Rule]) -> list[Insn] | None:
    """The program that replaces ``existing``, or None when it already allows every rule.

    Raises ``ValueError`` saying why the existing program cannot be extended safely.
    """
    old_rules, original = split_program(existing)
    merged = tuple(dict.fromkeys(old_rules + tuple(rules)))
    if len(merged) == len(old_rules):
        return None
    if len(merged) > MAX_RULES:
        raise ValueError(f"more than {MAX_RULES} device rules")
    problem = bpf.reload_problem(original)
    if problem:
        raise ValueError(problem)
    program = rules_prefix(merged) + original
    if len(program) > bpf.MAX_INSNS:
        raise ValueError("the merged program would be too large")
    return program


# --- imperative shell ------------------------------------------------------------------------


def _failed(step: str, where: str, exc: OSError) -> NvcError:
    detail = f"{step} for {where} failed: {escape(exc.strerror or os.strerror(exc.errno))}"
    if exc.errno == errno.EPERM and step.startswith("bpf_prog_query"):
        detail += " (this needs CAP_SYS_ADMIN over the host, which nested containers lack; see no-cgroups)"
    return NvcError("cgroup", detail)


def _extend(prog_id: int, rules: Sequence[Rule], where: str, fds: list[int]) -> tuple[int, int] | None:
    """Load the replacement of program ``prog_id``: (old fd, new fd), or None if not needed.
    Every fd opened is added to ``fds`` for the caller to close."""
    try:
        old_fd = bpf.prog_get_fd_by_id(prog_id)
        fds.append(old_fd)
        info = bpf.prog_info(old_fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise NvcError("cgroup", f"device program {prog_id} of {where} went away during configuration") from None
        raise _failed(f"reading device program {prog_id}", where, exc) from None
    if info.type != bpf.PROG_TYPE_CGROUP_DEVICE or info.nr_map_ids:
        raise NvcError("cgroup", f"cannot extend device program {prog_id} of {where}: it uses maps or has another type")
    try:
        program = merge_program(info.insns, rules)
    except ValueError as exc:
        raise NvcError("cgroup", f"cannot extend device program {prog_id} of {where} safely: {exc}") from None
    if program is None:
        return None
    try:
        new_fd = bpf.prog_load(program, PROG_NAME)
    except OSError as exc:
        raise _failed(f"loading the extended device program {prog_id}", where, exc) from None
    fds.append(new_fd)
    return old_fd, new_fd


def _swap(cgroup_fd: int, attach_flags: int, old_fd: int, new_fd: int) -> None:
    if not attach_flags & bpf.F_ALLOW_MULTI:
        # Single-program mode: attaching replaces the one program atomically.
        bpf.prog_attach(cgroup_fd, new_fd, attach_flags)
        return
    if not FORCE_NO_REPLACE:
        try:
            bpf.prog_attach(cgroup_fd, new_fd, bpf.F_ALLOW_MULTI | bpf.F_REPLACE, replace_fd=old_fd)
            return
        except OSError as exc:
            if exc.errno != errno.EINVAL:   # EINVAL: a kernel before 5.6
                raise
    bpf.prog_attach(cgroup_fd, new_fd, bpf.F_ALLOW_MULTI)
    bpf.prog_detach(cgroup_fd, old_fd)


def allow(cgroup_dir: str, rules: Sequence[Rule]) -> str:
    """Make every device program attached to ``cgroup_dir`` allow ``rules`` as well."""
    rules = tuple(dict.fromkeys(rules))
    where = escape(cgroup_dir)
    try:
        cgroup_fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENODEV):
            raise NvcError("cgroup", EXITED) from None
        raise NvcError("cgroup", f"cannot open {where}: {exc.strerror.lower()}") from None
    fds: list[int] = []
    try:
        if fstatfs_type(cgroup_fd) != CGROUP2_SUPER_MAGIC:
            raise NvcError("cgroup", f"{where} is not a cgroup v2 directory")
        try:
            attach_flags, ids = bpf.prog_query(cgroup_fd)
        except OSError as exc:
            raise _failed("bpf_prog_query(BPF_CGROUP_DEVICE)", where, exc) from None
        if not ids:
            return f"cgroup v2 {where}: no device program attached, every device is allowed already"
        swaps = [pair for pair in (_extend(prog_id, rules, where, fds) for prog_id in ids) if pair]
        # Everything is loaded before anything is swapped: a failure above changes nothing.
        for old_fd, new_fd in swaps:
            try:
                _swap(cgroup_fd, attach_flags, old_fd, new_fd)
            except OSError as exc:
                raise _failed("replacing the device program (BPF_PROG_ATTACH)", where, exc) from None
    finally:
        for fd in fds:
            os.close(fd)
        os.close(cgroup_fd)
    if not swaps:
        return f"cgroup v2 {where}: {len(ids)} device program(s) allow these devices already"
    return f"cgroup v2 {where}: {len(rules)} rule(s) added to {len(swaps)} device program(s)"
