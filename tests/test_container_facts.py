"""Reading the container's rootfs without trusting it (in-root resolution, type checks)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from nvcontainer.fs import syscalls
from nvcontainer.plan.container import library_dirs, parse_compat_name, read_container


@pytest.fixture(params=["openat2", "fallback"])
def resolver(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(syscalls, "FORCE_NO_OPENAT2", True)
    return request.param


def facts(rootfs):
    fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
    try:
        return read_container(fd, "x86_64")
    finally:
        os.close(fd)


def elf_so(path, m32=False):
    src = path.parent / "x.c"
    src.write_text("int x(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", *(["-m32"] if m32 else []), "-o", str(path), str(src)], check=True)
    src.unlink()


@pytest.mark.parametrize("debian,lib32,lib_is_64,has_lib,expected", [
    (True, False, False, True, ("/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu")),
    (False, True, False, True, ("/usr/lib64", "/usr/lib32")),
    (False, False, False, True, ("/usr/lib64", "/usr/lib")),
    (False, False, True, True, ("/usr/lib64", "/usr/lib32")),
    (False, False, False, False, ("/usr/lib64", "/usr/lib32")),
])
def test_library_dirs_rules(debian, lib32, lib_is_64, has_lib, expected):
    assert library_dirs("x86_64", debian, lib32, lib_is_64, has_lib) == expected


def test_compat_names():
    assert parse_compat_name("libcuda.so.560.35.03") == ("560.35.03", 560)
    for bad in ("libcuda.so.1", "libcuda.so", "libcudart.so.12.1", "libcuda.so.560.35.03.x", "libcuda.so.560.35.03/"):
        assert parse_compat_name(bad) is None


def test_debian_detection_does_not_follow_symlinks_out(tmp_path, resolver):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "debian_version").write_text("12\n")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    # an absolute symlink is re-rooted: /outside does not exist inside the rootfs
    os.symlink(str(outside / "debian_version"), root / "etc/debian_version")
    assert facts(root).debian is False
    os.symlink("../../../outside/debian_version", root / "etc/x")
    os.replace(root / "etc/x", root / "etc/debian_version")
    assert facts(root).debian is False
    (root / "etc/debian_version").unlink()
    (root / "etc/debian_version").write_text("12\n")
    assert facts(root).libs_dir == "/usr/lib/x86_64-linux-gnu"


def test_compat_libs_hostile_entries(tmp_path, resolver):
    root = tmp_path / "root"
    compat = root / "usr/local/cuda/compat"
    compat.mkdir(parents=True)
    elf_so(compat / "libcuda.so.560.35.03")
    os.symlink("libcuda.so.560.35.03", compat / "libcuda.so.1")
    os.symlink("/etc/shadow", compat / "libcuda.so.570.1.1")         # symlink: ignored
    (compat / "libcuda.so.580.1.1").mkdir()                            # directory: ignored
    os.mkfifo(compat / "libcuda.so.590.1.1")                           # FIFO: ignored, must not block
    os.mknod(compat / "libcuda.so.600.1.1", 0o600 | 0o020000, os.makedev(1, 3))  # device node: never opened
    (compat / "libcuda.so.610.1.1").write_bytes(b"\x7fELF" + b"\xff" * 60)      # malformed ELF
    elf_so(compat / "libcuda.so.620.1.1", m32=True)                    # wrong class
    got = facts(root).compat
    assert [(c.path, c.version, c.major) for c in got] == [
        ("/usr/local/cuda/compat/libcuda.so.560.35.03", "560.35.03", 560)]


def test_compat_dir_symlinked_out_of_the_rootfs(tmp_path, resolver):
    outside = tmp_path / "outside"
    outside.mkdir()
    elf_so(outside / "libcuda.so.999.1.1")
    root = tmp_path / "root"
    (root / "usr/local/cuda").mkdir(parents=True)
    os.symlink(str(outside), root / "usr/local/cuda/compat")
    assert facts(root).compat == ()


def test_compat_dir_inside_rootfs_via_symlink(tmp_path, resolver):
    root = tmp_path / "root"
    real = root / "usr/local/cuda-12.6/compat"
    real.mkdir(parents=True)
    elf_so(real / "libcuda.so.560.35.03")
    os.symlink("cuda-12.6", root / "usr/local/cuda")
    assert [c.major for c in facts(root).compat] == [560]


def test_huge_compat_dir_is_bounded(tmp_path):
    root = tmp_path / "root"
    compat = root / "usr/local/cuda/compat"
    compat.mkdir(parents=True)
    for i in range(1100):
        (compat / f"f{i}").touch()
    assert facts(root).compat == ()
    shutil.rmtree(root)
