"""Files that never end, never stop growing, or block, where the ldconfig sandbox reads: the
image's ``ld.so.conf``, its includes and the library links ldconfig follows; and ldconfig's
memory limit against a real cache of thousands of libraries.

Before the sandbox read the configuration itself, glibc's ldconfig waited on a FIFO (or a pipe
reached through ``/proc/self/fd``) until the run's deadline, and grew one line of a sparse
giant until its 2 GiB address-space limit. Each case here must end well under a second, with
the cache built (a bad configuration file is skipped with a warning) or one line naming the
file (a library link ldconfig would wait on). The fixtures are test_ldconfig_sandbox's.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time

import pytest

from nvcontainer.apply import ldsoconf, sandbox
from nvcontainer.errors import NvcError
from tests.test_ldconfig_sandbox import built, cache_entries, container, make_rootfs, nothing_leaks, run  # noqa: F401

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root")

QUICK = 1.0   # seconds a hostile case may take, sandbox start-up included


def fifo(path):
    os.mkfifo(path)


def zero(path):
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 5))


def sock(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


def sparse(path):
    with open(path, "wb") as fh:
        fh.write(b"/usr/lib/a")          # one line that never ends
        fh.truncate(10 << 30)


def self_fd(path):
    os.symlink("/proc/self/fd/1", path)  # ldconfig's own output pipe: it would read itself


MAKERS = {"fifo": fifo, "dev-zero": zero, "socket": sock, "sparse-10g": sparse, "proc-self-fd": self_fd}


def timed(container, rootfs) -> float:
    start = time.monotonic()
    run(container, rootfs)
    return time.monotonic() - start


@pytest.mark.parametrize("kind", MAKERS)
def test_ld_so_conf_itself(container, tmp_path, built, kind):
    rootfs = make_rootfs(tmp_path, built)
    os.unlink(f"{rootfs}/etc/ld.so.conf")
    MAKERS[kind](tmp_path / "rootfs/etc/ld.so.conf")
    assert timed(container, rootfs) < QUICK
    assert {"libbar.so.2", "libbaz.so.3"} <= set(cache_entries(rootfs))


@pytest.mark.parametrize("kind", MAKERS)
def test_an_include(container, tmp_path, built, kind):
    """The bad drop-in is skipped; the good one beside it still counts."""
    rootfs = make_rootfs(tmp_path, built)
    MAKERS[kind](tmp_path / "rootfs/etc/ld.so.conf.d/0-bad.conf")
    assert timed(container, rootfs) < QUICK
    assert {"libfoo.so.1", "libbar.so.2"} <= set(cache_entries(rootfs))


@pytest.mark.parametrize("line", ["include /proc/self/fd/*", "include /proc/1/root/etc/ld.so.conf",
                                  "include /sys/kernel/*", "include /proc/self/fd/1"])
def test_includes_into_proc_and_sys(container, tmp_path, built, line):
    rootfs = make_rootfs(tmp_path, built)
    with open(f"{rootfs}/etc/ld.so.conf", "a") as fh:
        fh.write(line + "\n")
    assert timed(container, rootfs) < QUICK
    assert {"libfoo.so.1", "libbar.so.2"} <= set(cache_entries(rootfs))


@pytest.mark.parametrize("kind", ["fifo", "proc-self-fd"])
def test_library_link_to_a_fifo_is_one_line(container, tmp_path, built, kind):
    """ldconfig opens what a library-named link leads to without O_NONBLOCK (checked: a FIFO
    *named* like a library is skipped by its d_type, a link to one blocks it). Refused at once."""
    rootfs = make_rootfs(tmp_path, built)
    lib = tmp_path / "rootfs/usr/lib/nvc"
    if kind == "fifo":
        fifo(lib / "pipe")
        os.symlink("pipe", lib / "libpipe.so.1")
    else:
        self_fd(lib / "libpipe.so.1")
    start = time.monotonic()
    with pytest.raises(NvcError) as info:
        run(container, rootfs)
    assert time.monotonic() - start < QUICK
    assert info.value.category == "ldcache"
    assert info.value.detail == ("/usr/lib/nvc/libpipe.so.1: a library link to a FIFO, which ldconfig would open "
                                 "and wait on; refusing the image")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "socket"])
def test_library_named_special_files_are_skipped_by_ldconfig(container, tmp_path, built, kind):
    rootfs = make_rootfs(tmp_path, built)
    MAKERS[kind](tmp_path / "rootfs/usr/lib/nvc/libodd.so.1")
    assert timed(container, rootfs) < QUICK
    assert "libbar.so.2" in cache_entries(rootfs)


def test_thousands_of_libraries_and_a_huge_one_under_the_memory_limit(container, tmp_path, built):
    """A CUDA-sized image: 5,000 libraries with their own SONAMEs and one of 3 GiB (sparse;
    ldconfig maps each library whole, so only the data limit, not the address space, may be
    small). All are in the cache."""
    rootfs = make_rootfs(tmp_path, built)
    many = tmp_path / "rootfs/usr/lib/many"
    many.mkdir()
    src = tmp_path / "t.c"
    src.write_text("int t(void) { return 0; }\n")
    template = tmp_path / "libt.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libtXXXXX.so.1", "-o", str(template), str(src)],
                   check=True, timeout=60)
    data = template.read_bytes()
    assert data.count(b"libtXXXXX.so.1") == 1
    for i in range(5000):
        (many / f"libt{i:05d}.so.1").write_bytes(data.replace(b"libtXXXXX", b"libt%05d" % i))
    huge = many / "libhuge.so.1"
    huge.write_bytes(data.replace(b"libtXXXXX", b"libhuge__"))
    os.truncate(huge, 3 << 30)
    with open(f"{rootfs}/etc/ld.so.conf.d/many.conf", "w") as fh:
        fh.write("/usr/lib/many\n")
    run(container, rootfs, deadline=60)
    entries = cache_entries(rootfs)
    assert sum(name.startswith("libt") for name in entries) == 5000
    assert "libhuge__.so.1" in entries
    assert sandbox.DATA_LIMIT <= 64 << 20


# --- the parser, pure ---------------------------------------------------------------------------

def test_parse_follows_glibc():
    text = (b"  /usr/lib/a  # comment\n#whole line\n\ninclude  /etc/x/*.conf\tb.conf\n"
            b"hwcap 1 nosegneg\nHWCAP\t0 x\n/usr/lib/b=libc6\n/usr/lib/c\0junk\n"
            b"includes/odd\ninclude\n")
    assert ldsoconf.parse(text) == [
        ("dir", b"/usr/lib/a  "), ("include", b"/etc/x/*.conf"), ("include", b"b.conf"),
        ("dir", b"/usr/lib/b=libc6"), ("dir", b"/usr/lib/c"), ("dir", b"includes/odd"), ("dir", b"include"),
    ]


def test_directories_as_ldconfig_trims_them():
    assert ldsoconf.directories([b"/usr/lib/a  ", b"/usr/lib/b=libc6", b"/x///", b"/", b"  "]) == [
        b"/usr/lib/a", b"/usr/lib/b", b"/x"]
