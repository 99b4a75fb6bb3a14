"""ld.so.cache parsing, checked against caches written and printed by the real glibc ldconfig."""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvcontainer.errors import NvcError
from nvcontainer.inventory import ldcache
from nvcontainer.inventory.ldcache import ARCH_I386, ARCH_X86_64, CacheEntry
from tests.fixtures.binary import patched

pytestmark = pytest.mark.skipif(
    os.uname().machine != "x86_64" or not shutil.which("gcc") or not shutil.which("ldconfig"),
    reason="needs an x86_64 host with gcc (multilib) and ldconfig",
)

NEW_MAGIC = b"glibc-ld.so.cache1.1"
NEW_HEADER = 48
NEW_ENTRY = 24


def _so(tmp: Path, out: Path, soname: str, *flags: str):
    src = tmp / "lib.c"
    src.write_text("int f(void) { return 1; }\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-fPIC", *flags, f"-Wl,-soname,{soname}", "-o", str(out), str(src)],
                   check=True)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """A tiny root with 64- and 32-bit libraries and its cache in the new, compat and old formats."""
    tmp = tmp_path_factory.mktemp("ldcache")
    root = tmp / "root"
    lib64, lib32 = root / "lib64x", root / "lib32x"
    for lib, flags in ((lib64, ()), (lib32, ("-m32",))):
        _so(tmp, lib / "libfoo.so.1.2", "libfoo.so.1", *flags)
        _so(tmp, lib / "libcuda.so.550.54.14", "libcuda.so.1", *flags)
    _so(tmp, lib64 / "libbar.so.7.0", "libbar.so.7")
    (root / "etc").mkdir()
    (root / "etc/ld.so.conf").write_text("/lib64x\n/lib32x\n")
    made = {}
    for fmt in ("new", "compat", "old"):
        rel = f"etc/ld.so.cache.{fmt}"
        subprocess.run(["ldconfig", "-r", str(root), "-c", fmt, "-C", rel], check=True)
        made[fmt] = root / rel
    return made


def ldconfig_print(cache: Path) -> list[tuple[str, str, bool]]:
    """(key, value, is 64-bit) per entry, in order, as ``ldconfig -p`` prints them."""
    out = subprocess.run(["ldconfig", "-p", "-C", str(cache)], check=True, capture_output=True,
                         text=True, errors="surrogateescape").stdout
    lines = re.findall(r"^\t(\S+) \((.*)\) => (.*)$", out, re.MULTILINE)
    count = int(re.match(r"(\d+) libs found", out).group(1))
    assert len(lines) == count
    return [(key, value, "x86-64" in desc) for key, desc, value in lines]


def as_triples(entries: list[CacheEntry]) -> list[tuple[str, str, bool]]:
    return [(e.key, e.value, e.flags & 0xFF00 == ARCH_X86_64) for e in entries]


def new_header_at(data: bytes) -> int:
    at = data.find(NEW_MAGIC)
    assert at >= 0
    return at


def strings_end(data: bytes) -> int:
    """End of the string table, from the header: every byte before it is needed by some entry."""
    at = new_header_at(data)
    nlibs, len_strings = struct.unpack_from("<II", data, at + 20)
    return at + NEW_HEADER + nlibs * NEW_ENTRY + len_strings


def expect_error(data: bytes, *words: str) -> NvcError:
    with pytest.raises(NvcError) as info:
        ldcache.parse(data, "/etc/ld.so.cache")
    assert info.value.category == "ldcache"
    assert info.value.detail.startswith("/etc/ld.so.cache: ")
    for word in words:
        assert word in info.value.detail
    return info.value


# --- agreement with glibc -------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["new", "compat"])
def test_parse_matches_ldconfig_print(caches, fmt):
    data = caches[fmt].read_bytes()
    entries = ldcache.parse(data, str(caches[fmt]))
    assert as_triples(entries) == ldconfig_print(caches[fmt])
    assert {e.key for e in entries} == {"libfoo.so.1", "libcuda.so.1", "libbar.so.7"}


def test_compat_format_has_old_part_and_same_entries(caches):
    compat = caches["compat"].read_bytes()
    assert compat.startswith(b"ld.so-1.7.0") and new_header_at(compat) > 0
    assert ldcache.parse(compat) == ldcache.parse(caches["new"].read_bytes())


def test_host_cache_matches_ldconfig_print():
    if not os.path.isfile("/etc/ld.so.cache"):
        pytest.skip("host has no /etc/ld.so.cache")
    assert as_triples(ldcache.read("/etc/ld.so.cache")) == ldconfig_print(Path("/etc/ld.so.cache"))


def test_entries_for_arch_splits_64_and_32_bit(caches):
    entries = ldcache.read(str(caches["new"]))
    by64 = {e.key: e.value for e in ldcache.entries_for_arch(entries, ARCH_X86_64)}
    by32 = {e.key: e.value for e in ldcache.entries_for_arch(entries, ARCH_I386)}
    assert by64 == {"libfoo.so.1": "/lib64x/libfoo.so.1", "libcuda.so.1": "/lib64x/libcuda.so.1",
                    "libbar.so.7": "/lib64x/libbar.so.7"}
    assert by32 == {"libfoo.so.1": "/lib32x/libfoo.so.1", "libcuda.so.1": "/lib32x/libcuda.so.1"}


def test_osversion_and_hwcap_are_ignored(caches):
    """glibc 2.35+ ldconfig no longer writes these fields; older caches and hwcap subdirs do."""
    data = caches["new"].read_bytes()
    first = new_header_at(data) + NEW_HEADER
    tagged = patched(patched(data, first + 12, "<I", 0x020620), first + 16, "<Q", (1 << 62) | 5)
    assert tagged != data
    assert ldcache.parse(tagged) == ldcache.parse(data)
    arch = struct.unpack_from("<i", data, first)[0] & 0xFF00
    assert ldcache.entries_for_arch(ldcache.parse(tagged), arch)[0] == ldcache.parse(data)[0]


def test_entry_filter_rejects_libc5_and_accepts_plain_elf():
    entries = [CacheEntry(0x0303, "a", "/a"), CacheEntry(0x0301, "b", "/b"), CacheEntry(0x0302, "c", "/c"),
               CacheEntry(0x0003, "d", "/d"), CacheEntry(0x0001, "e", "/e"), CacheEntry(0x0002, "f", "/f"),
               CacheEntry(0x0A03, "g", "/g")]
    assert [e.key for e in ldcache.entries_for_arch(entries, ARCH_X86_64)] == ["a", "b"]
    assert [e.key for e in ldcache.entries_for_arch(entries, ARCH_I386)] == ["d", "e"]
    assert [e.key for e in ldcache.entries_for_arch(entries, ldcache.ARCH_AARCH64)] == ["g"]


def test_libc5_flag_in_a_real_cache_is_filtered(caches):
    data = caches["new"].read_bytes()
    first = new_header_at(data) + NEW_HEADER
    flags = struct.unpack_from("<i", data, first)[0]
    entries = ldcache.parse(patched(data, first, "<i", (flags & 0xFF00) | 0x02))
    kept = ldcache.entries_for_arch(entries, flags & 0xFF00)
    assert entries[0] not in kept
    assert len(kept) == len(ldcache.entries_for_arch(ldcache.parse(data), flags & 0xFF00)) - 1


def test_native_arches():
    assert ldcache.native_arches("x86_64") == (ARCH_X86_64, ARCH_I386)
    assert ldcache.native_arches("aarch64") == (ldcache.ARCH_AARCH64, ldcache.ARCH_ARMHF)
    assert ldcache.native_arches("ppc64le") == (ldcache.ARCH_PPC64, None)
    assert ldcache.native_arches() == (ARCH_X86_64, ARCH_I386)
    with pytest.raises(NvcError, match="unsupported architecture: s390x"):
        ldcache.native_arches("s390x")


# --- damaged caches -------------------------------------------------------------------------

def test_old_only_format_is_unsupported(caches):
    expect_error(caches["old"].read_bytes(), "unsupported file format")


@pytest.mark.parametrize("data", [b"", b"glibc-ld.so.cache1.0" + bytes(100), b"\x7fELF" + bytes(100)])
def test_unknown_formats(data):
    expect_error(data, "unsupported file format")


@pytest.mark.parametrize("fmt", ["new", "compat"])
def test_every_truncation(caches, fmt):
    data = caches[fmt].read_bytes()
    full = ldcache.parse(data)
    end = strings_end(data)
    assert end <= len(data)
    for n in range(len(data)):
        if n < end:
            with pytest.raises(NvcError):
                ldcache.parse(data[:n])
        else:  # only the glibc extension area after the strings is missing; it is not used
            assert ldcache.parse(data[:n]) == full


def test_huge_nlibs(caches):
    data = caches["new"].read_bytes()
    expect_error(patched(data, 20, "<I", 0xFFFFFFFF), "too many entries")
    expect_error(patched(data, 20, "<I", 1000), "truncated")


def test_huge_old_nlibs(caches):
    data = caches["compat"].read_bytes()
    expect_error(patched(data, 12, "<I", 0xFFFFFFFF), "too many entries")
    expect_error(patched(data, 12, "<I", 1000), "truncated")
    # shifts where the new header is expected
    expect_error(patched(data, 12, "<I", 3), "unsupported file format")


@pytest.mark.parametrize("field", [4, 8])   # key, value
def test_string_offset_out_of_range(caches, field):
    data = caches["compat"].read_bytes()
    second = new_header_at(data) + NEW_HEADER + NEW_ENTRY
    expect_error(patched(data, second + field, "<I", 0xFFFFFF00), "corrupt entry 1", "out of range")
    expect_error(patched(data, second + field, "<I", len(data)), "corrupt entry 1")


def test_strings_without_nul(caches):
    data = bytearray(caches["new"].read_bytes())
    table = NEW_HEADER + struct.unpack_from("<I", data, 20)[0] * NEW_ENTRY
    data[table:] = data[table:].replace(b"\0", b"A")
    expect_error(bytes(data), "corrupt entry 0", "unterminated")


def test_string_longer_than_path_max():
    header = struct.pack("<20sIIB3xI12x", NEW_MAGIC, 1, 6000, 2, 0)
    entry = struct.pack("<iIIIQ", 0x0303, NEW_HEADER + NEW_ENTRY, NEW_HEADER + NEW_ENTRY, 0, 0)
    expect_error(header + entry + b"/" * 5000 + b"\0", "unterminated")


def test_foreign_byte_order(caches):
    data = caches["new"].read_bytes()
    assert data[28] == 2   # glibc records "little endian"
    expect_error(patched(data, 28, "<B", 3), "byte order")
    assert ldcache.parse(patched(data, 28, "<B", 0)) == ldcache.parse(data)


def test_error_escapes_the_path():
    with pytest.raises(NvcError) as info:
        ldcache.parse(b"", "evil\nnvcontainer: fake line")
    assert "\n" not in info.value.detail and "evil\\n" in info.value.detail


# --- reading the file -----------------------------------------------------------------------

def test_read_regular(caches):
    assert ldcache.read(str(caches["compat"])) == ldcache.parse(caches["compat"].read_bytes())


def _read_error(path) -> str:
    with pytest.raises(NvcError) as info:
        ldcache.read(str(path))
    assert info.value.category == "ldcache"
    return info.value.detail


def test_read_missing(tmp_path):
    assert _read_error(tmp_path / "nope") == f"{tmp_path}/nope: no such file or directory"


def test_read_refuses_symlink(tmp_path, caches):
    (tmp_path / "link").symlink_to(caches["new"])
    assert _read_error(tmp_path / "link").endswith(": too many levels of symbolic links")


def test_read_refuses_directory_and_device(tmp_path):
    assert _read_error(tmp_path).endswith(": not a regular file")
    assert _read_error("/dev/zero") == "/dev/zero: not a regular file"


def test_read_fifo_does_not_block(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def hung(*_):
        raise AssertionError("read() blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    try:
        assert _read_error(fifo).endswith(": not a regular file")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_read_empty_and_oversized(tmp_path, caches):
    (tmp_path / "empty").write_bytes(b"")
    assert _read_error(tmp_path / "empty").endswith(": unsupported file format")
    with pytest.raises(NvcError, match="file too large"):
        ldcache.read(str(caches["new"]), max_bytes=100)
    size = caches["new"].stat().st_size
    assert ldcache.read(str(caches["new"]), max_bytes=size) == ldcache.parse(caches["new"].read_bytes())


def test_module_imports_only_the_standard_library():
    tree = ast.parse(Path(ldcache.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    outside = {n for n in names if n.split(".")[0] not in sys.stdlib_module_names and n != "__future__"}
    assert outside == {"nvcontainer.errors", "nvcontainer.records", "nvcontainer.fs.bounded"}   # each imports only the standard library


# --- arbitrary input ------------------------------------------------------------------------

def _parse_or_clean_error(data: bytes) -> None:
    try:
        result = ldcache.parse(data)
    except NvcError as err:
        assert err.category == "ldcache"
        return
    assert all(isinstance(e, CacheEntry) for e in result)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes(data):
    _parse_or_clean_error(data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([b"", b"ld.so-1.7.0\0"]), st.binary(max_size=64), st.binary(max_size=400))
def test_arbitrary_bytes_behind_magic(prefix, middle, tail):
    _parse_or_clean_error(prefix + middle + NEW_MAGIC + tail)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_real_caches(caches, data):
    raw = bytearray(caches[data.draw(st.sampled_from(["new", "compat"]))].read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    _parse_or_clean_error(bytes(raw))
