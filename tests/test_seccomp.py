"""The ldconfig sandbox's seccomp filter: our syscall tables against libseccomp's, and the
installed program's verdicts seen by a real process (allowed, EPERM, killed for a foreign ABI).
The filter inside the real sandbox (``Seccomp: 2``) is shown by test_ldconfig_sandbox."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from nvcontainer.apply import seccomp

PROBE_C = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {
    const char *mode = argv[1];
    if (!strcmp(mode, "allowed")) { printf("pid %ld\n", (long)syscall(SYS_getpid)); return 0; }
    if (!strcmp(mode, "mount")) {
        int r = mount("none", "/", "tmpfs", 0, NULL);
        printf("mount %d %s\n", r, strerror(errno));
        return 0;
    }
    if (!strcmp(mode, "socket")) {
        long r = syscall(SYS_socket, 1, 1, 0);
        printf("socket %ld %s\n", r, strerror(errno));
        return 0;
    }
    if (!strcmp(mode, "fsync")) {   /* fd -1: a flush that were made would fail with EBADF */
        errno = 0;
        int a = fsync(-1), b = fdatasync(-1);
        printf("fsync %d fdatasync %d %s\n", a, b, strerror(errno));
        return 0;
    }
    if (!strcmp(mode, "x32")) { syscall(0x40000000 | SYS_getpid); printf("x32 survived\n"); return 0; }
    if (!strcmp(mode, "i386")) {
        long r;
        __asm__ volatile ("int $0x80" : "=a"(r) : "a"(20L));   /* i386 getpid */
        printf("i386 survived %ld\n", r);
        return 0;
    }
    return 2;
}
"""

# Installs the filter (after no_new_privs, as the sandbox does), then execs the probe.
RUNNER = """
import os, sys, prctl
from nvcontainer.apply import seccomp
installer = seccomp.Installer(seccomp.ldconfig_filter())
prctl.set_no_new_privs(True)
installer.install()
os.execv(sys.argv[1], sys.argv[1:])
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    if os.uname().machine != "x86_64":
        pytest.skip("the probe's foreign-ABI calls are x86-64's")
    out = tmp_path_factory.mktemp("seccomp")
    (out / "probe.c").write_text(PROBE_C)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(out / "probe"), str(out / "probe.c")], check=True, timeout=60)
    return out / "probe"


def filtered(probe, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-c", RUNNER, str(probe), mode], capture_output=True, text=True,
                          timeout=30, cwd="/")


@pytest.mark.parametrize("machine, arch", [("x86_64", "X86_64"), ("aarch64", "AARCH64")])
def test_tables_match_libseccomp(machine, arch):
    """Every number we allow is libseccomp's number for that name on that architecture."""
    lib = pytest.importorskip("pyseccomp")
    for name, number in {**seccomp.allowed(machine), **seccomp.unflushed(machine)}.items():
        assert lib.resolve_syscall(getattr(lib.Arch, arch), name) == number, (machine, name)


def test_program_shape():
    """Architecture check first, the x32 guard on x86-64, a comparison and a success for each
    flush, one comparison per allowed call, EPERM by default; jumps stay inside the program."""
    program = seccomp.build("x86_64")
    assert len(program) % 8 == 0
    insns = [program[i:i + 8] for i in range(0, len(program), 8)]
    flushes = seccomp.unflushed("x86_64")
    assert not set(flushes) & set(seccomp.allowed("x86_64"))
    assert len(insns) == 4 + 2 + 2 * len(flushes) + len(set(seccomp.allowed("x86_64").values())) + 2
    answers = [int.from_bytes(insn[4:], "little") for insn in insns[6:6 + 2 * len(flushes)]]
    assert sorted(answers[0::2]) == sorted(flushes.values()) and set(answers[1::2]) == {seccomp.RET_ERRNO}
    assert int.from_bytes(insns[-2][4:], "little") == seccomp.RET_ERRNO | seccomp.EPERM
    assert int.from_bytes(insns[-1][4:], "little") == seccomp.RET_ALLOW
    for i, insn in enumerate(insns):
        assert i + 1 + insn[2] < len(insns) and i + 1 + insn[3] < len(insns) or insn[0] == 0x06


def test_unknown_machine_is_one_line():
    with pytest.raises(Exception) as info:
        seccomp.allowed("riscv64")
    assert "no seccomp filter for the ldconfig sandbox on riscv64" in str(info.value)


def test_allowed_calls_pass(probe):
    res = filtered(probe, "allowed")
    assert res.returncode == 0 and res.stdout.startswith("pid "), res


@pytest.mark.parametrize("mode, expect", [("mount", "mount -1 Operation not permitted"),
                                          ("socket", "socket -1 Operation not permitted")])
def test_other_calls_fail_with_eperm(probe, mode, expect):
    """As root, with every capability: the filter, not a permission check, refuses."""
    res = filtered(probe, mode)
    assert res.returncode == 0 and res.stdout.strip() == expect, res


def test_flushes_succeed_without_being_made(probe):
    """ldconfig's fsync of the cache it writes returns 0 and waits for no disk: on fd -1 a
    flush that reached the kernel would fail with EBADF."""
    res = filtered(probe, "fsync")
    assert res.returncode == 0 and res.stdout.strip() == "fsync 0 fdatasync 0 Success", res


@pytest.mark.parametrize("mode", ["x32", "i386"])
def test_foreign_abi_calls_kill(probe, mode):
    res = filtered(probe, mode)
    assert res.returncode == -signal.SIGSYS, res
    assert "survived" not in res.stdout
