"""A deny-by-default seccomp filter for the sandboxed ldconfig.

Why: ldconfig parses files the image chose (ELF headers of every library-named file, links,
directories). The namespaces, the pivot, the capability drop and the rlimits decide *where* a
compromised ldconfig could act; the filter decides *what* it can ask the kernel at all: only the
calls glibc's ldconfig makes (found with ``strace -f`` on normal runs, a cache of thousands of
libraries, and its failure paths), plus the two the sandbox still makes after installing the
filter (``execveat``/``execve`` of the sealed copy, and ``write``/``exit_group`` should that
fail). No mount, namespace, ptrace, bpf, keyring, socket or module call is on the list.

Two calls are answered without being made: ``fsync`` and ``fdatasync`` return success and
flush nothing. ldconfig flushes the cache it writes before renaming it into place; for a
container's rootfs that buys nothing (the hook writes the cache again at every start, and the
rename alone keeps a reader from ever seeing half a file), while the flush makes the
container's start wait for the filesystem's journal: about 0.5 ms on an idle disk, far longer
on a node whose disk is busy pulling images. Answering them costs ldconfig nothing it could
use: a call that does nothing can reach nothing.

Denied calls fail with ``EPERM`` rather than killing: a newer glibc that probes a call we did
not list (``rseq``, ``clone3`` and the like are probed and fall back) keeps working, and an
unexpected denial shows up as ldconfig's own one-line complaint. A call for another ABI (i386
``int 0x80``, x32 numbers) is never made by a 64-bit ldconfig, only by injected code, so the
filter kills the process for those (the audit architecture word, and on x86-64 the x32 bit).

The program is a small classic-BPF list we generate ourselves (:func:`build`) from the tables
below, checked in the tests against libseccomp's own tables and behaviour: loading a seccomp
binding costs a cold hook 10 to 30 ms (it looks its library up at import), generating these
few dozen instructions about 50 µs. It is built in the host process and only installed in the
sandbox, right before ``execve``; a forked child of ``nvcontainer serve`` inherits it.
"""

from __future__ import annotations

import ctypes
import os
import struct

from ..errors import NvcError

# What ldconfig may call, by architecture (name: number). Built from strace on x86-64; aarch64
# has no legacy path calls (open, stat, rename...): glibc uses the *at forms there.
_COMMON = (
    # files and directories
    "read", "write", "writev", "pread64", "lseek", "openat", "close", "fcntl", "fstat", "newfstatat",
    "statx", "getdents64", "readlinkat", "symlinkat", "unlinkat", "renameat", "renameat2", "mkdirat",
    "fchmod", "fchmodat", "getcwd",
    # memory
    "mmap", "munmap", "mprotect", "mremap", "brk", "madvise",
    # start-up and end of a static glibc program, abort(), and the sandbox's own exec
    "execve", "execveat", "set_tid_address", "set_robust_list", "rseq", "prlimit64", "getrandom",
    "futex", "sysinfo", "uname", "getpid", "gettid", "tgkill", "rt_sigaction", "rt_sigprocmask",
    "rt_sigreturn", "exit", "exit_group", "clock_gettime", "gettimeofday",
    # harmless queries and waits a stand-in or a future ldconfig may make (identity, sleeping,
    # access checks): they change nothing and reach nothing the calls above do not
    "getuid", "geteuid", "getgid", "getegid", "nanosleep", "clock_nanosleep", "faccessat", "faccessat2",
)
# Answered with success and not made (the module docstring says why).
UNFLUSHED = ("fsync", "fdatasync")
_X86_64_ONLY = ("open", "stat", "lstat", "rename", "mkdir", "unlink", "symlink", "readlink", "chmod", "arch_prctl",
                "access")
SYSCALLS = {
    "x86_64": {
        "read": 0, "write": 1, "open": 2, "close": 3, "stat": 4, "fstat": 5, "lstat": 6, "lseek": 8,
        "mmap": 9, "mprotect": 10, "munmap": 11, "brk": 12, "rt_sigaction": 13, "rt_sigprocmask": 14,
        "rt_sigreturn": 15, "pread64": 17, "writev": 20, "mremap": 25, "madvise": 28, "getpid": 39,
        "execve": 59, "exit": 60, "uname": 63, "fcntl": 72, "fsync": 74, "fdatasync": 75, "getcwd": 79,
        "rename": 82, "mkdir": 83, "unlink": 87, "symlink": 88, "readlink": 89, "chmod": 90, "fchmod": 91,
        "gettimeofday": 96, "sysinfo": 99, "arch_prctl": 158, "gettid": 186, "futex": 202,
        "getdents64": 217, "set_tid_address": 218, "clock_gettime": 228, "exit_group": 231, "tgkill": 234,
        "openat": 257, "mkdirat": 258, "newfstatat": 262, "unlinkat": 263, "renameat": 264,
        "symlinkat": 266, "readlinkat": 267, "fchmodat": 268, "set_robust_list": 273, "prlimit64": 302,
        "renameat2": 316, "getrandom": 318, "execveat": 322, "statx": 332, "rseq": 334,
        "access": 21, "nanosleep": 35, "getuid": 102, "getgid": 104, "geteuid": 107, "getegid": 108,
        "clock_nanosleep": 230, "faccessat": 269, "faccessat2": 439,
    },
    "aarch64": {
        "getcwd": 17, "fcntl": 25, "mkdirat": 34, "unlinkat": 35, "symlinkat": 36, "renameat": 38,
        "fchmod": 52, "fchmodat": 53, "openat": 56, "close": 57, "getdents64": 61, "lseek": 62, "read": 63,
        "write": 64, "writev": 66, "pread64": 67, "readlinkat": 78, "newfstatat": 79, "fstat": 80,
        "fsync": 82, "fdatasync": 83, "exit": 93, "exit_group": 94, "set_tid_address": 96, "futex": 98,
        "set_robust_list": 99, "clock_gettime": 113, "tgkill": 131, "rt_sigaction": 134,
        "rt_sigprocmask": 135, "rt_sigreturn": 139, "uname": 160, "gettimeofday": 169, "getpid": 172,
        "gettid": 178, "sysinfo": 179, "brk": 214, "munmap": 215, "mremap": 216, "execve": 221,
        "mmap": 222, "mprotect": 226, "madvise": 233, "prlimit64": 261, "renameat2": 276,
        "getrandom": 278, "execveat": 281, "statx": 291, "rseq": 293,
        "faccessat": 48, "nanosleep": 101, "clock_nanosleep": 115, "getuid": 174, "geteuid": 175,
        "getgid": 176, "getegid": 177, "faccessat2": 439,
    },
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

# classic BPF and seccomp return values (linux/filter.h, linux/seccomp.h)
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_OFF_NR, _OFF_ARCH = 0, 4
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM = 1

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_FILTER_SIZE = 8          # struct sock_filter: u16 code, u8 jt, u8 jf, u32 k

_program: bytes | None = None


def allowed(machine: str) -> dict[str, int]:
    """The allowed calls of ``machine`` (``os.uname().machine``), by name."""
    table = SYSCALLS.get(machine)
    if table is None:
        raise NvcError("ldcache", f"no seccomp filter for the ldconfig sandbox on {machine}")
    names = _COMMON + (_X86_64_ONLY if machine == "x86_64" else ())
    return {name: table[name] for name in names}


def ldconfig_filter() -> bytes:
    """The program for this machine, built on the first call."""
    global _program
    if _program is None:
        _program = build(os.uname().machine)
    return _program


def unflushed(machine: str) -> dict[str, int]:
    """The calls answered with success without being made, by name."""
    return {name: SYSCALLS[machine][name] for name in UNFLUSHED}


def build(machine: str) -> bytes:
    """``struct sock_filter[]``: another ABI is killed (the arch word, and on x86-64 the x32
    bit), a flush is answered with success unmade, an allowed call passes, anything else fails
    with EPERM."""
    numbers = sorted(set(allowed(machine).values()))
    insns = [(_LD_W_ABS, 0, 0, _OFF_ARCH), (_JEQ_K, 1, 0, AUDIT_ARCH[machine]), (_RET_K, 0, 0, RET_KILL_PROCESS),
             (_LD_W_ABS, 0, 0, _OFF_NR)]
    if machine == "x86_64":
        insns += [(_JGE_K, 0, 1, X32_SYSCALL_BIT), (_RET_K, 0, 0, RET_KILL_PROCESS)]
    for number in sorted(unflushed(machine).values()):
        insns += [(_JEQ_K, 0, 1, number), (_RET_K, 0, 0, RET_ERRNO)]   # errno 0: the call returns 0
    for i, number in enumerate(numbers):
        insns.append((_JEQ_K, len(numbers) - i, 0, number))   # to the RET ALLOW after RET ERRNO
    insns += [(_RET_K, 0, 0, RET_ERRNO | EPERM), (_RET_K, 0, 0, RET_ALLOW)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in insns)


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Installer:
    """Everything the install needs, allocated beforehand: after the sandbox lowers its data
    limit, the install itself must not have to allocate."""

    def __init__(self, program: bytes):
        self._buffer = ctypes.create_string_buffer(program, len(program))
        self._fprog = _Fprog(len(program) // _FILTER_SIZE, ctypes.cast(self._buffer, ctypes.c_void_p))
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._prctl = self._libc.prctl
        self._args = (_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(self._fprog), 0, 0)

    def install(self) -> None:
        """Install the filter on this thread (no_new_privs must already be set)."""
        if self._prctl(*self._args) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
