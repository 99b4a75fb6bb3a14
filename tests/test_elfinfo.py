"""ELF facts of driver files, read from real gcc-built libraries and from damaged copies of them."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvcontainer.errors import NvcError
from nvcontainer.inventory import elfinfo
from nvcontainer.inventory.elfinfo import ElfFacts
from tests.fixtures.binary import patched

pytestmark = pytest.mark.skipif(
    os.uname().machine != "x86_64" or not shutil.which("gcc"),
    reason="needs an x86_64 host with gcc (multilib)",
)

BODY = "int f(void) { return 1; }\n"


def abi_note(os_id: int, major: int, minor: int, patch: int) -> str:
    return BODY + f"""
__attribute__((section(".note.ABI-tag"), aligned(4), used))
static const struct {{ unsigned namesz, descsz, type; char name[4]; unsigned desc[4]; }}
abi_tag = {{4, 16, 1, "GNU", {{{os_id}, {major}, {minor}, {patch}}}}};
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("elf")

    def build(name: str, source: str, *flags: str) -> Path:
        src = tmp / f"{name}.c"
        src.write_text(source)
        out = tmp / name
        subprocess.run(["gcc", "-fPIC", *flags, "-o", str(out), str(src)], check=True)
        return out

    made = {
        "tls_new": build("libnvidia-tls.so.550.54.14", abi_note(0, 2, 3, 99), "-shared",
                         "-Wl,-soname,libnvidia-tls.so.550.54.14"),
        "tls_old": build("libnvidia-tls.so.1.0", abi_note(0, 2, 2, 5), "-shared",
                         "-Wl,-soname,libnvidia-tls.so.550.54.14"),
        "glcore": build("libnvidia-glcore.so.550.54.14", BODY, "-shared",
                        "-Wl,-soname,libnvidia-glcore.so.550.54.14"),
        "lib32": build("libfoo32.so.1.0", BODY, "-shared", "-m32", "-Wl,-soname,libfoo32.so.1"),
        "exe": build("prog", "int main(void) { return 0; }\n"),
    }
    made["libgl"] = build("libGL.so.550.54.14", BODY, "-shared", "-Wl,-soname,libGL.so.1",
                          "-Wl,--no-as-needed", str(made["glcore"]))
    return made


def memfd_with(data: bytes) -> int:
    fd = os.memfd_create("elf", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


def read_bytes(data: bytes) -> ElfFacts | None:
    fd = memfd_with(data)
    try:
        return elfinfo.read_elf(fd)
    finally:
        os.close(fd)


def elf_error(data: bytes, *words: str) -> NvcError:
    with pytest.raises(NvcError) as info:
        read_bytes(data)
    assert info.value.category == "elf"
    for word in words:
        assert word in info.value.detail
    return info.value


# ELF64 header field offsets
E_PHOFF, E_SHOFF, E_PHENTSIZE, E_PHNUM, E_SHENTSIZE, E_SHNUM, E_SHSTRNDX = 32, 40, 54, 56, 58, 60, 62


# --- facts from real libraries --------------------------------------------------------------

def test_tls_library_with_new_abi(libs):
    facts = elfinfo.read_elf(str(libs["tls_new"]))
    assert facts == ElfFacts(64, "EM_X86_64", "libnvidia-tls.so.550.54.14", (), (0, 2, 3, 99))
    assert elfinfo.tls_abi_ok(facts)


def test_tls_library_with_old_abi(libs):
    facts = elfinfo.read_elf(str(libs["tls_old"]))
    assert facts.abi_tag == (0, 2, 2, 5)
    assert not elfinfo.tls_abi_ok(facts)


def test_library_without_abi_note(libs):
    facts = elfinfo.read_elf(str(libs["glcore"]))
    assert facts.abi_tag is None and not elfinfo.tls_abi_ok(facts)
    assert facts.soname == "libnvidia-glcore.so.550.54.14"


def test_needed_and_glcore_rule(libs):
    gl = elfinfo.read_elf(str(libs["libgl"]))
    assert gl.soname == "libGL.so.1"
    assert gl.needed == ("libnvidia-glcore.so.550.54.14", "libc.so.6")
    assert elfinfo.links_to_glcore(gl)
    assert not elfinfo.links_to_glcore(elfinfo.read_elf(str(libs["glcore"])))
    egl = ElfFacts(64, "EM_X86_64", "libEGL.so.1", ("libnvidia-eglcore.so.550.54.14",), None)
    assert elfinfo.links_to_glcore(egl)


def test_32_bit_library(libs):
    facts = elfinfo.read_elf(str(libs["lib32"]))
    assert (facts.elf_class, facts.machine, facts.soname) == (32, "EM_386", "libfoo32.so.1")


def test_executable_has_no_soname(libs):
    facts = elfinfo.read_elf(str(libs["exe"]))
    assert facts.soname == "" and "libc.so.6" in facts.needed


def test_read_from_fd_keeps_offset_and_fd(libs):
    fd = os.open(libs["libgl"], os.O_RDONLY)
    try:
        os.lseek(fd, 7, os.SEEK_SET)
        assert elfinfo.read_elf(fd).soname == "libGL.so.1"
        assert os.lseek(fd, 0, os.SEEK_CUR) == 7
    finally:
        os.close(fd)


def test_stripped_section_headers_still_give_soname(libs):
    data = libs["libgl"].read_bytes()
    for field, fmt in ((E_SHOFF, "<Q"), (E_SHNUM, "<H"), (E_SHSTRNDX, "<H")):
        data = patched(data, field, fmt, 0)
    facts = read_bytes(data)
    assert facts.soname == "libGL.so.1" and facts.needed[0] == "libnvidia-glcore.so.550.54.14"
    assert facts.abi_tag is None   # found through the section table only, as upstream does
    assert elfinfo.read_untrusted_soname(data) == "libGL.so.1"


# --- not ELF, damaged ELF, hostile file types -----------------------------------------------

@pytest.mark.parametrize("data", [b"", b"\x7fEL", b"#!/bin/sh\necho hi\n", b"\0" * 4096])
def test_not_elf(data):
    assert read_bytes(data) is None
    assert elfinfo.read_untrusted_elf_header(data) is None
    assert elfinfo.read_untrusted_soname(data) is None


def test_every_truncation_is_an_error(libs):
    """The section headers sit at the end, so any cut that keeps the magic is detected."""
    data = libs["tls_new"].read_bytes()
    fd = memfd_with(data)
    try:
        for n in range(len(data) - 1, 3, -1):
            os.ftruncate(fd, n)
            with pytest.raises(NvcError):
                elfinfo.read_elf(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("field, fmt, value, why", [
    (E_SHNUM, "<H", 0xFEFF, "section headers outside the file"),
    (E_SHOFF, "<Q", 1 << 62, "section headers outside the file"),
    (E_PHNUM, "<H", 0xFEFF, "program headers outside the file"),
    (E_PHNUM, "<H", 0xFFFF, "extended program header numbering"),
    (E_PHOFF, "<Q", (1 << 64) - 8, "program headers outside the file"),
    (E_PHENTSIZE, "<H", 1, "program header size"),
    (E_SHENTSIZE, "<H", 0xFFFF, "section header size"),
    (E_SHSTRNDX, "<H", 0xFFF0, "section name table index"),
    (4, "<B", 7, "unknown class"),
    (5, "<B", 0, "unknown byte order"),
])
def test_absurd_header_fields(libs, field, fmt, value, why):
    elf_error(patched(libs["libgl"].read_bytes(), field, fmt, value), why)


def test_extended_section_numbering_refused(libs):
    elf_error(patched(libs["libgl"].read_bytes(), E_SHNUM, "<H", 0), "extended section numbering")


def test_huge_section_sizes_are_harmless(libs):
    """Section sizes past the file end are neither trusted nor allocated: the note read is capped."""
    data = libs["tls_new"].read_bytes()
    before = read_bytes(data)
    shoff, = struct.unpack_from("<Q", data, E_SHOFF)
    shnum, = struct.unpack_from("<H", data, E_SHNUM)
    for i in range(1, shnum):
        data = patched(data, shoff + i * 64 + 32, "<Q", 1 << 60)    # sh_size
    assert read_bytes(data) == before


def _open_error(path) -> str:
    with pytest.raises(NvcError) as info:
        elfinfo.read_elf(str(path))
    return info.value.detail


def test_hostile_file_types(tmp_path, libs):
    (tmp_path / "link").symlink_to(libs["libgl"])
    assert _open_error(tmp_path / "link").endswith(": too many levels of symbolic links")
    assert _open_error(tmp_path / "missing").endswith(": no such file or directory")
    assert _open_error(tmp_path).endswith(": not a regular file")
    assert _open_error("/dev/zero") == "/dev/zero: not a regular file"
    os.mkfifo(tmp_path / "fifo")

    def hung(*_):
        raise AssertionError("read_elf() blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    try:
        assert _open_error(tmp_path / "fifo").endswith(": not a regular file")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_error_escapes_the_path(tmp_path):
    evil = tmp_path / "a\nnvcontainer: fake"
    evil.mkdir()
    detail = _open_error(evil)
    assert "\n" not in detail and "a\\nnvcontainer" in detail


def pyelftools_view(path: Path) -> tuple:
    """The same facts as pyelftools reads them: an independent parser as the oracle."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        soname, needed, abi = "", [], None
        dynamic = next(elf.iter_segments("PT_DYNAMIC"), None)
        for tag in dynamic.iter_tags() if dynamic else ():
            if tag.entry.d_tag == "DT_SONAME":
                soname = tag.soname
            elif tag.entry.d_tag == "DT_NEEDED":
                needed.append(tag.needed)
        note = elf.get_section_by_name(".note.ABI-tag")
        for entry in note.iter_notes() if note else ():
            if entry["n_type"] == "NT_GNU_ABI_TAG":
                d = entry["n_desc"]
                os_id = {"ELF_NOTE_OS_LINUX": 0, "ELF_NOTE_OS_GNU": 1}[d["abi_os"]]
                abi = (os_id, d["abi_major"], d["abi_minor"], d["abi_tiny"])
        return elf.elfclass, elf["e_machine"], soname, tuple(needed), abi


def system_libraries() -> list[Path]:
    found = []
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib32"):
        files = sorted(p for p in Path(d).glob("lib*.so.*") if p.is_file() and not p.is_symlink())
        found += [p for p in files if p.stat().st_size < 4 << 20][:25]
    return found


def test_agrees_with_pyelftools(libs):
    paths = list(libs.values()) + system_libraries()
    assert len(paths) > 20
    for path in paths:
        facts = elfinfo.read_elf(str(path))
        assert (facts.elf_class, facts.machine, facts.soname, facts.needed, facts.abi_tag) == \
            pyelftools_view(path), path
        assert elfinfo.read_untrusted_soname(path.read_bytes()) == (facts.soname or None)


# --- the readers for image-provided files ---------------------------------------------------

def test_untrusted_header(libs):
    assert elfinfo.read_untrusted_elf_header(libs["libgl"].read_bytes()[:64]) == (64, "EM_X86_64")
    assert elfinfo.read_untrusted_elf_header(libs["lib32"].read_bytes()[:64]) == (32, "EM_386")
    with pytest.raises(NvcError, match="truncated header"):
        elfinfo.read_untrusted_elf_header(libs["libgl"].read_bytes()[:40])


@pytest.mark.parametrize("name, soname", [("libgl", "libGL.so.1"), ("lib32", "libfoo32.so.1"),
                                          ("tls_new", "libnvidia-tls.so.550.54.14"), ("exe", None)])
def test_untrusted_soname(libs, name, soname):
    data = libs[name].read_bytes()
    assert elfinfo.read_untrusted_soname(data) == soname
    assert elfinfo.read_elf(str(libs[name])).soname == (soname or "")


def test_untrusted_soname_on_capped_prefixes(libs):
    data = libs["libgl"].read_bytes()
    phnum, = struct.unpack_from("<H", data, E_PHNUM)
    with pytest.raises(NvcError, match="outside the data read"):
        elfinfo.read_untrusted_soname(data[:64 + phnum * 56])
    for n in range(4, len(data)):
        try:
            assert elfinfo.read_untrusted_soname(data[:n]) == "libGL.so.1"
        except NvcError as err:
            assert err.category == "elf"


def dt_soname_at(data: bytes) -> int:
    """File offset of the DT_SONAME entry of a 64-bit library, found through PT_DYNAMIC."""
    phoff, = struct.unpack_from("<Q", data, E_PHOFF)
    phnum, = struct.unpack_from("<H", data, E_PHNUM)
    for i in range(phnum):
        p_type, _, p_offset = struct.unpack_from("<IIQ", data, phoff + i * 56)
        if p_type == 2:
            at = p_offset
            while struct.unpack_from("<q", data, at)[0] != 14:
                at += 16
            return at
    raise AssertionError("no PT_DYNAMIC")


def test_untrusted_soname_pointing_outside_string_table(libs):
    data = libs["libgl"].read_bytes()
    with pytest.raises(NvcError, match="SONAME outside the string table"):
        elfinfo.read_untrusted_soname(patched(data, dt_soname_at(data) + 8, "<Q", 1 << 40))


# --- arbitrary input ------------------------------------------------------------------------

def _clean(call, data):
    try:
        call(data)
    except NvcError as err:
        assert err.category == "elf"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=400),
                 st.tuples(st.sampled_from([b"\x7fELF\x01\x01\x01", b"\x7fELF\x02\x01\x01",
                                            b"\x7fELF\x02\x02\x01"]),
                           st.binary(max_size=600)).map(b"".join)))
def test_untrusted_readers_on_arbitrary_bytes(data):
    _clean(elfinfo.read_untrusted_elf_header, data)
    _clean(elfinfo.read_untrusted_soname, data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_real_libraries(libs, data):
    """Damage in the headers and the dynamic table: every reader fails cleanly or answers."""
    raw = bytearray(libs[data.draw(st.sampled_from(["libgl", "lib32", "tls_new"]))].read_bytes())
    shoff = struct.unpack_from("<Q" if raw[4] == 2 else "<I", raw, 40 if raw[4] == 2 else 32)[0]
    regions = [(0, 0x400), (shoff, len(raw)), (0, len(raw))]
    for _ in range(data.draw(st.integers(1, 6))):
        lo, hi = data.draw(st.sampled_from(regions))
        raw[data.draw(st.integers(lo, hi - 1))] = data.draw(st.integers(0, 255))
    raw = bytes(raw)
    _clean(read_bytes, raw)
    _clean(elfinfo.read_untrusted_elf_header, raw)
    _clean(elfinfo.read_untrusted_soname, raw)
