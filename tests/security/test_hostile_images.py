"""Hostile images: symlinks and odd file types where the injection puts things.

Each case changes the standard busybox image in one way and runs through ``configure --pid``
and through runc (control run first). The autouse fixtures of ``conftest.py`` check the host
after every case; each case adds what the result must be. Links point at the sentinel tree
(outside every rootfs) by absolute path, by ``../..`` climbing, and through procfs magic links,
so a single resolution outside the rootfs would show up as sentinel damage or as a mount
outside the rootfs.

Expected behaviour, in short: a link is followed only *inside* the rootfs (the injection then
lands where the link points, in-root, as in a chroot); a link through procfs is refused; a loop
or a too-long name is refused; an existing symlink, FIFO, socket or device node at a target is
replaced (never followed, never opened); a directory where a file belongs, or the reverse, is
refused.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from .conftest import (ENXIO, EPERM, check_contained, check_failure, check_success, expected_rules, fresh_image,
                       mounts_under, remove_tree, run_both, run_configure)

LIB = "usr/lib/x86_64-linux-gnu"
LIBCUDA = f"{LIB}/libcuda.so.550.54.14"
COMPAT = "usr/local/cuda/compat"
DROP_IN = "etc/ld.so.conf.d/00-nvcontainer-cuda-compat.conf"
PROCFS = "refusing to follow a symlink on procfs"
LOOP = "too many levels of symbolic links"
DEEP = "path resolves deeper than 256 directories"


def put(rootfs: Path, rel: str, make) -> None:
    """Replace whatever the image has at ``rel`` with what ``make(path)`` creates."""
    path = rootfs / rel
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        remove_tree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    make(path)


def link(target: str):
    return lambda p: os.symlink(target, p)


def fifo(p: Path) -> None:
    os.mkfifo(p)


def chardev(major: int, minor: int):
    return lambda p: os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(major, minor))


def directory(p: Path) -> None:
    p.mkdir()
    (p / "keep").write_text("image data\n")


def regular(p: Path) -> None:
    p.write_text("image data\n")


def unix_socket(p: Path) -> None:
    """A bound socket inode (made in a short directory: sun_path is 108 bytes), moved in."""
    with tempfile.TemporaryDirectory(dir=p.parent) as tmp:
        with socket.socket(socket.AF_UNIX) as sock:
            old = os.getcwd()
            os.chdir(tmp)
            try:
                sock.bind("s")
            finally:
                os.chdir(old)
        os.rename(Path(tmp) / "s", p)


def chain(n: int):
    """``n`` links in a row ending at a real directory: ``n > 40`` is over the kernel's limit."""
    def make(p: Path) -> None:
        p.parent.joinpath("chain-end").mkdir()
        os.symlink("chain-end", p.parent / "chain-0")
        for i in range(1, n):
            os.symlink(f"chain-{i - 1}", p.parent / f"chain-{i}")
        os.symlink(f"chain-{n - 1}", p)
    return make


def loop(p: Path) -> None:
    os.symlink(p.name + "-b", p)
    os.symlink(p.name, p.parent / (p.name + "-b"))


# --- links that point a target or a parent out of the rootfs ----------------------------------

# (case id, image change(rootfs, sentinel), expected failure or None for success)
OUT_OF_ROOT = [
    ("libdir-dotdot", lambda r, s: put(r, LIB, link(s.upward(s.lib_dir))), None),
    ("libdir-dangling", lambda r, s: put(r, LIB, link("/nonexistent/lib")), None),
    ("libdir-overlong", lambda r, s: put(r, LIB, link("d/" * 2000 + "lib")), DEEP),
    ("libdir-component-too-long", lambda r, s: put(r, LIB, link("/" + "x" * 300)), "file name too long"),
    ("libdir-proc-self-root", lambda r, s: put(r, LIB, link(f"/proc/self/root{s.lib_dir}")), PROCFS),
    ("libdir-proc-self-cwd", lambda r, s: put(r, LIB, link("/proc/self/cwd")), PROCFS),
    ("libdir-proc-dotdot", lambda r, s: put(r, LIB, link("../../../proc/thread-self/root" + str(s.lib_dir))), PROCFS),
    ("libdir-loop", lambda r, s: put(r, LIB, loop), LOOP),
    ("libdir-40-links", lambda r, s: put(r, LIB, chain(39)), None),
    ("libdir-41-links", lambda r, s: put(r, LIB, chain(41)), LOOP),
    ("usr-dotdot", lambda r, s: put(r, "usr", link(s.upward(s.tree))), None),
    ("run-absolute", lambda r, s: put(r, "run", link(str(s.empty_dir))), None),
    # /tmp -> ../../tmp/nvc-sec-…: in-root that names a path through /tmp itself, a real loop
    ("tmp-dotdot-loops", lambda r, s: put(r, "tmp", link(s.upward(s.empty_dir))), LOOP),
    ("proc-absolute", lambda r, s: put(r, "proc", link(str(s.empty_dir))), "not on procfs"),
    # /etc only matters to ldconfig, which runs chrooted: a dangling in-root /etc gives it
    # nowhere to write the cache, and the run is refused rather than left without one.
    ("etc-dotdot", lambda r, s: put(r, "etc", link(s.upward(s.tree / "etc"))), "ldcache error"),
]


@pytest.mark.parametrize("change,expect", [c[1:] for c in OUT_OF_ROOT], ids=[c[0] for c in OUT_OF_ROOT])
def test_links_out_of_the_rootfs(sec_machine, host_sentinel, workdir, change, expect):
    run_both(sec_machine, host_sentinel, workdir, lambda r: change(r, host_sentinel), expect=expect)


def test_deep_link_is_refused_whatever_the_fd_limit(sec_machine, host_sentinel, workdir):
    """A link 2000 directories deep: refused with the same line under crun (whose hooks get a
    1024-fd limit) as under runc and configure, having created fewer than 256 directories. Before
    the walk was bounded, crun's run failed with a misleading EMFILE and runc's created 2000
    nested directories in the rootfs."""
    image = lambda r: put(r, LIB, link("d/" * 2000 + "lib"))
    both = run_both(sec_machine, host_sentinel, workdir, image, expect=DEEP, runtime="crun")
    for out in both.judged:
        depth, path = 0, out.rootfs / "usr/lib/d"
        while path.is_dir():
            depth, path = depth + 1, path / "d"
        assert depth < 256, f"{out.path}: {depth} nested directories"


def test_followed_link_lands_inside_the_rootfs(sec_machine, host_sentinel, workdir):
    """The library directory is an absolute link to a host directory: the libraries land at
    that path *inside* the rootfs, as the container itself would resolve the link."""
    image = lambda r: put(r, LIB, link(str(host_sentinel.lib_dir)))
    both = run_both(sec_machine, host_sentinel, workdir, image)
    for out in both.judged:
        landed = f"{out.rootfs}{host_sentinel.lib_dir}/libcuda.so.550.54.14"
        assert landed in out.new_mounts, out.new_mounts
    assert not (host_sentinel.lib_dir / "libcuda.so.550.54.14").exists()


# --- /dev replaced by a link ------------------------------------------------------------------

DEV_LINKS = [
    ("dev-absolute", lambda s: str(s.empty_dir)),
    ("dev-dotdot", lambda s: s.upward(s.empty_dir)),
]


@pytest.mark.parametrize("target", [c[1] for c in DEV_LINKS], ids=[c[0] for c in DEV_LINKS])
def test_dev_is_a_link_out_of_the_rootfs(sec_machine, host_sentinel, workdir, target):
    """Device nodes follow ``/dev`` in-root. The probe of run_configure opens the host path
    ``<rootfs>/dev/nvidia0``, which the link takes to the (untouched) sentinel, so this case
    checks the mount table instead. runc 1.1.5 mishandles this image on its own
    (CVE-2026-41579 class), which the control run detects; only then is the runtime half skipped."""
    image = lambda r: put(r, "dev", link(target(host_sentinel)))
    both = run_both(sec_machine, host_sentinel, workdir, image, check=False)
    direct = both.direct
    assert direct.returncode == 0, direct.stderr
    assert direct.rules == expected_rules(sec_machine)
    assert f"{direct.rootfs}{host_sentinel.empty_dir}/nvidia0" in direct.new_mounts
    check_contained(direct, direct.rootfs)
    for out in both.starts:
        if both.control.returncode == 0:
            assert out.returncode == 0, out.stderr
            assert out.facts["OPEN0"][0].endswith(ENXIO)
            assert out.facts["UNREQ"][0].endswith(EPERM)
        check_contained(out, out.rootfs)


def test_dev_through_procfs_is_refused(sec_machine, host_sentinel, workdir):
    """Direct path only: a runtime resolves the image's /dev link itself, before any hook
    (see test_dev_is_a_link_out_of_the_rootfs)."""
    image = lambda r: put(r, "dev", link(f"/proc/self/root{host_sentinel.empty_dir}"))
    rootfs = workdir / "r" / "rootfs"
    fresh_image(rootfs, sec_machine)
    image(rootfs)
    out = run_configure(sec_machine, rootfs)
    check_failure(out, sec_machine, "nvcontainer: ", PROCFS, rootfs)


# --- what already sits at a target ------------------------------------------------------------

AT_TARGET = [
    ("lib-link-absolute", LIBCUDA, lambda s: link(str(s.victim)), None),
    ("lib-link-magic", LIBCUDA, lambda s: link(f"/proc/self/root{s.victim}"), None),
    ("lib-fifo", LIBCUDA, lambda s: fifo, None),
    ("lib-socket", LIBCUDA, lambda s: unix_socket, None),
    ("lib-chardev-zero", LIBCUDA, lambda s: chardev(1, 5), None),
    ("lib-directory", LIBCUDA, lambda s: directory, "a directory is in the way"),
    ("soname-link-to-victim", f"{LIB}/libcuda.so.1", lambda s: link(str(s.victim)), None),
    ("soname-link-is-directory", f"{LIB}/libcuda.so.1", lambda s: directory, None),
    ("socket-directory", "run/nvidia-persistenced/socket", lambda s: directory, "a directory is in the way"),
    ("dir-target-is-file", "tmp/nvidia-mps", lambda s: regular, "a non-directory is in the way"),
    ("dir-target-is-link", "tmp/nvidia-mps", lambda s: link(str(s.empty_dir)), "a non-directory is in the way"),
    ("parent-is-file", "usr/lib", lambda s: regular, "not a directory"),
]


@pytest.mark.parametrize("rel,make,expect", [c[1:] for c in AT_TARGET], ids=[c[0] for c in AT_TARGET])
def test_existing_entry_at_a_target(sec_machine, host_sentinel, workdir, rel, make, expect):
    both = run_both(sec_machine, host_sentinel, workdir, lambda r: put(r, rel, make(host_sentinel)), expect=expect)
    if expect is None and rel in (LIBCUDA, "run/nvidia-persistenced/socket"):
        for out in both.judged:
            # mounted at the very name the image had claimed, not where its link pointed
            assert f"{out.rootfs}/{rel}" in out.new_mounts, out.path


DEV_TARGET = [
    ("node-fifo", fifo, None),
    ("node-is-dev-mem", chardev(1, 1), None),
    ("node-is-directory", directory, "a directory is in the way"),
]


@pytest.mark.parametrize("make,expect", [c[1:] for c in DEV_TARGET], ids=[c[0] for c in DEV_TARGET])
def test_existing_entry_at_a_device_target(sec_machine, host_sentinel, workdir, make, expect):
    """Direct path only: a runtime puts its own tmpfs over the image's /dev before hooks run,
    so through runc these images are the standard case. ``configure --pid`` under another
    runtime may see the image's /dev as it is."""
    rootfs = fresh_image(workdir / "r" / "rootfs", sec_machine)
    put(rootfs, "dev/nvidia0", make)
    out = run_configure(sec_machine, rootfs)
    if expect is None:
        check_success(out, sec_machine, rootfs)
    else:
        check_failure(out, sec_machine, "nvcontainer: ", expect, rootfs)


# --- CUDA compat libraries from the image -----------------------------------------------------

COMPAT_LIB = f"{COMPAT}/libcuda.so.560.35.03"


def elf_header(ei_class: int = 2, machine: int = 62, size: int = 64) -> bytes:
    head = b"\x7fELF" + bytes([ei_class, 1, 1]) + bytes(9) + (3).to_bytes(2, "little") + machine.to_bytes(2, "little")
    return (head + bytes(size))[:size]


def compat_file(data: bytes):
    def make(p: Path) -> None:
        p.write_bytes(data)
    return make


def sparse(p: Path) -> None:
    with open(p, "wb") as fh:
        fh.truncate(8 << 30)


def many_entries(p: Path) -> None:
    p.mkdir()
    for i in range(1100):   # over MAX_COMPAT_ENTRIES
        (p / f"libcuda.so.{600 + i}.0.0").write_bytes(b"")


def valid_compat(p: Path) -> None:
    shutil.copyfile("/bin/true", p)


COMPAT_CASES = [
    ("valid", COMPAT_LIB, lambda s: valid_compat, True),
    ("link-to-host-elf", COMPAT_LIB, lambda s: link(str(s.lib_dir / "libcuda.so.999.99.99")), False),
    ("directory", COMPAT_LIB, lambda s: directory, False),
    ("fifo", COMPAT_LIB, lambda s: fifo, False),
    ("chardev", COMPAT_LIB, lambda s: chardev(1, 5), False),
    ("truncated-elf", COMPAT_LIB, lambda s: compat_file(b"\x7fELF\x02"), False),
    ("elf-aarch64", COMPAT_LIB, lambda s: compat_file(elf_header(machine=183)), False),
    ("sparse-8g", COMPAT_LIB, lambda s: sparse, False),
    ("dir-link-absolute", COMPAT, lambda s: link(str(s.lib_dir)), False),
    ("dir-link-magic", COMPAT, lambda s: link(f"/proc/self/root{s.lib_dir}"), False),
    ("dir-1100-entries", COMPAT, lambda s: many_entries, False),
]


@pytest.mark.parametrize("rel,make,used", [c[1:] for c in COMPAT_CASES], ids=[c[0] for c in COMPAT_CASES])
def test_cuda_compat_libraries(sec_machine, host_sentinel, workdir, rel, make, used):
    """Compat libraries are never mounted or opened unless they are regular, native ELF files
    reached in-root; a usable one only earns an ld.so.conf.d drop-in naming the compat dir."""
    both = run_both(sec_machine, host_sentinel, workdir, lambda r: put(r, rel, make(host_sentinel)))
    for out in both.judged:
        drop_in = out.rootfs / DROP_IN
        assert drop_in.exists() == used, out.path
        if used:
            assert drop_in.read_text().split() == ["/usr/local/cuda/compat"]
        assert not mounts_under([(m,) for m in out.new_mounts], out.rootfs / "usr/local/cuda")


DROP_IN_CASES = [
    ("drop-in-link-to-victim", DROP_IN, lambda s: link(str(s.victim))),
    ("conf-dir-link-absolute", "etc/ld.so.conf.d", lambda s: link(str(s.tree / "etc/ld.so.conf.d"))),
]


@pytest.mark.parametrize("rel,make", [c[1:] for c in DROP_IN_CASES], ids=[c[0] for c in DROP_IN_CASES])
def test_compat_drop_in_cannot_be_redirected(sec_machine, host_sentinel, workdir, rel, make):
    """The drop-in is written as a new file and renamed over whatever the image has there;
    the victim keeps its content (autouse sentinel) and the result is a regular file."""
    def image(r: Path) -> None:
        put(r, COMPAT_LIB, valid_compat)
        put(r, rel, make(host_sentinel))

    both = run_both(sec_machine, host_sentinel, workdir, image)
    for out in both.judged:
        where = out.rootfs / DROP_IN
        if rel == "etc/ld.so.conf.d":   # followed in-root: the drop-in is inside the rootfs
            where = Path(f"{out.rootfs}{host_sentinel.tree}/etc/ld.so.conf.d") / Path(DROP_IN).name
        st = os.lstat(where)
        assert stat.S_ISREG(st.st_mode)
        assert Path(where).read_text().split() == ["/usr/local/cuda/compat"]


# --- the same links through the openat(2) walker ----------------------------------------------

WALKER_CASES = [c for c in OUT_OF_ROOT if c[0] in (
    "libdir-dotdot", "libdir-dangling", "libdir-proc-self-root", "libdir-proc-dotdot", "libdir-loop",
    "libdir-41-links", "usr-dotdot", "proc-absolute", "etc-dotdot")] + [("compat-dir-link-magic", lambda r, s: put(
        r, COMPAT, link(f"/proc/self/root{s.lib_dir}")), None)]


@pytest.mark.parametrize("change,expect", [c[1:] for c in WALKER_CASES], ids=[c[0] for c in WALKER_CASES])
def test_links_through_the_walker(sec_machine, host_sentinel, workdir, change, expect):
    """Kernels without openat2(2) resolve in-root with the component walker: same answers."""
    rootfs = fresh_image(workdir / "r" / "rootfs", sec_machine)
    change(rootfs, host_sentinel)
    out = run_configure(sec_machine, rootfs, walker=True)
    if expect is None:
        check_success(out, sec_machine, rootfs)
    else:
        check_failure(out, sec_machine, "nvcontainer: ", expect, rootfs)


# --- host directories mounted into the container ----------------------------------------------

VOLUME_CASES = [
    ("over-the-library-dir", LIB, "libcuda.so.550.54.14"),
    ("over-tmp", "tmp", "nvidia-mps"),
]


@pytest.mark.parametrize("rel,target", [c[1:] for c in VOLUME_CASES], ids=[c[0] for c in VOLUME_CASES])
def test_host_directory_volume_gets_no_entries(sec_machine, host_sentinel, workdir, rel, target):
    """The sentinel's empty directory bound where the injection has to create placeholders
    (CVE-2024-0133 class): what would be created there would be created on the host, so the
    run is refused and the directory stays empty (autouse sentinel). Before the fix the
    placeholders, SONAME links and parents were made in the host directory."""
    both = run_both(sec_machine, host_sentinel, workdir, volumes=[(host_sentinel.empty_dir, rel)],
                    expect="host filesystem mounted into the container")
    assert not any(target.split("/")[0] in name for name in os.listdir(host_sentinel.empty_dir))
    assert [out.new_mounts for out in both.judged] == [[], [], []]
