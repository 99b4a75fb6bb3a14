"""What the inventory needs to know about an ELF file, read without trusting the file.

Only a handful of fields matter (class, machine, SONAME, DT_NEEDED, the GNU ABI note), so they
are read with ``struct`` by one small walker that checks every count and offset against the
file size before using it and never reads more than a few KiB beyond the tables it follows.
pyelftools was the first choice, but it builds every section object eagerly, parsing whole
symbol hash tables (a quarter of a second on a large library, and a loop as long as the file
on a crafted count), which is work the inventory does not need and a bound it cannot give.

The same walker serves the host's driver files (:func:`read_elf`, through ``pread`` on an fd)
and files from a container image (:func:`read_untrusted_elf_header`,
:func:`read_untrusted_soname`, on a byte buffer the caller has already capped).

Contract of every reader: ``None`` means "not an ELF file" (and, for the SONAME reader, also
"no SONAME"); a file that starts like ELF but is damaged raises ``NvcError("elf", ...)``;
nothing else is ever raised.
"""

from __future__ import annotations

import os
import stat
import struct
from typing import Callable, NamedTuple

from nvcontainer.errors import NvcError, escape

from ..records import record

_MACHINES = {
    3: "EM_386",
    20: "EM_PPC",
    21: "EM_PPC64",
    40: "EM_ARM",
    62: "EM_X86_64",
    183: "EM_AARCH64",
}

_ELF_MAGIC = b"\x7fELF"
_PN_XNUM = 0xFFFF
_PT_LOAD, _PT_DYNAMIC = 1, 2
_SHT_NOTE = 7
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ, _DT_SONAME = 0, 1, 5, 10, 14
_NT_GNU_ABI_TAG = 1
_ABI_SECTION = b".note.ABI-tag"
_TLS_ABI = (0, 2, 3, 99)        # ELF_NOTE_OS_LINUX, ABI 2.3.99: the TLS model of current glibc
_GLCORE_PREFIXES = ("libnvidia-glcore.so", "libnvidia-eglcore.so")

# Real libraries have a few dozen dynamic tags and one short note; these caps are generous.
_MAX_DYN_TAGS = 4096
_MAX_NOTE_BYTES = 4096
_MAX_NAME = 255                 # SONAME and DT_NEEDED values are file names


@record
class ElfFacts:
    elf_class: int                               # 32 or 64
    machine: str                                 # e.g. "EM_X86_64"; "EM_<n>" when not listed
    soname: str                                  # "" when the file has none
    needed: tuple[str, ...]                      # DT_NEEDED, in file order
    abi_tag: tuple[int, int, int, int] | None    # .note.ABI-tag (os, major, minor, patch)


def tls_abi_ok(facts: ElfFacts) -> bool:
    """libnvidia-tls comes in two builds; only the one tagged GNU/Linux 2.3.99 suits current glibc."""
    return facts.abi_tag == _TLS_ABI


def links_to_glcore(facts: ElfFacts) -> bool:
    """A non-GLVND libGL/libEGL belongs to the NVIDIA driver only if it needs the driver's GL core."""
    return any(name.startswith(_GLCORE_PREFIXES) for name in facts.needed)


class _Header(NamedTuple):
    elf_class: int
    endian: str      # struct prefix, "<" or ">"
    machine: int
    phoff: int
    phentsize: int
    phnum: int
    shoff: int
    shentsize: int
    shnum: int
    shstrndx: int


class _Source(NamedTuple):
    """Bytes of one file, however they are held, and the words to use when they run out."""

    name: str
    size: int
    fetch: Callable[[int, int], bytes]   # (offset, length) -> at most length bytes
    beyond: str                          # how to say "past the end" in an error

    def get(self, offset: int, length: int, what: str) -> bytes:
        if offset + length > self.size:
            raise _bad(self.name, f"{what} {self.beyond}")
        data = self.fetch(offset, length)
        if len(data) < length:
            raise _bad(self.name, f"{what} truncated")
        return data

    def string(self, offset: int, end: int, limit: int, what: str) -> bytes:
        """The NUL-terminated string at ``offset``, which must end before ``end`` and ``limit``."""
        end = min(end, self.size, offset + limit + 1)
        data = self.fetch(offset, end - offset) if offset < end else b""
        cut = data.find(b"\0")
        if cut < 0:
            raise _bad(self.name, f"{what} unterminated, too long or {self.beyond}")
        return data[:cut]


def _bad(name: str, why: str) -> NvcError:
    return NvcError("elf", f"{escape(name)}: invalid ELF file: {why}")


def _machine_name(number: int) -> str:
    return _MACHINES.get(number, f"EM_{number}")


def _parse_header(data: bytes, name: str) -> _Header | None:
    """The ELF header at the start of ``data``; None when ``data`` does not start like ELF."""
    if len(data) < 4 or data[:4] != _ELF_MAGIC:
        return None
    if len(data) < 16:
        raise _bad(name, "truncated header")
    elf_class = {1: 32, 2: 64}.get(data[4])
    endian = {1: "<", 2: ">"}.get(data[5])
    if elf_class is None:
        raise _bad(name, f"unknown class {data[4]}")
    if endian is None:
        raise _bad(name, f"unknown byte order {data[5]}")
    if data[6] != 1:
        raise _bad(name, f"unknown version {data[6]}")
    layout = struct.Struct(endian + ("HHIIIIIHHHHHH" if elf_class == 32 else "HHIQQQIHHHHHH"))
    if len(data) < 16 + layout.size:
        raise _bad(name, "truncated header")
    (_, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
     shstrndx) = layout.unpack_from(data, 16)
    return _Header(elf_class, endian, machine, phoff, phentsize, phnum, shoff, shentsize, shnum,
                   shstrndx)


def _check_tables(h: _Header, src: _Source, sections: bool) -> None:
    """Refuse header tables that do not fit in the file, before anything walks them."""
    if h.phnum:
        if h.phnum == _PN_XNUM:
            raise _bad(src.name, "extended program header numbering")
        if h.phentsize != (32 if h.elf_class == 32 else 56):
            raise _bad(src.name, f"program header size {h.phentsize}")
        if h.phoff + h.phnum * h.phentsize > src.size:
            raise _bad(src.name, f"program headers {src.beyond}")
    if not sections:
        return
    if h.shnum == 0:
        if h.shoff:
            raise _bad(src.name, "extended section numbering")
        return
    if h.shentsize != (40 if h.elf_class == 32 else 64):
        raise _bad(src.name, f"section header size {h.shentsize}")
    if h.shoff + h.shnum * h.shentsize > src.size:
        raise _bad(src.name, f"section headers {src.beyond}")
    if h.shstrndx >= h.shnum:
        raise _bad(src.name, "section name table index out of range")


def _dynamic(h: _Header, src: _Source) -> tuple[bytes | None, list[bytes]]:
    """SONAME and DT_NEEDED, found as the loader finds them: PT_DYNAMIC, then PT_LOAD mapping."""
    if h.elf_class == 64:
        phdr = struct.Struct(h.endian + "IIQQQQQQ")   # type flags offset vaddr paddr filesz memsz align
        dyn = struct.Struct(h.endian + "qQ")
    else:
        phdr = struct.Struct(h.endian + "IIIIIIII")   # type offset vaddr paddr filesz memsz flags align
        dyn = struct.Struct(h.endian + "iI")
    if not h.phnum:
        return None, []
    table = src.get(h.phoff, h.phnum * h.phentsize, "program headers")
    loads = []          # (vaddr, filesz, offset)
    dynamic = None      # (offset, filesz)
    for i in range(h.phnum):
        fields = phdr.unpack_from(table, i * phdr.size)
        if h.elf_class == 64:
            p_type, _, offset, vaddr, _, filesz, _, _ = fields
        else:
            p_type, offset, vaddr, _, filesz, _, _, _ = fields
        if p_type == _PT_LOAD:
            loads.append((vaddr, filesz, offset))
        elif p_type == _PT_DYNAMIC and dynamic is None:
            dynamic = (offset, filesz)
    if dynamic is None:
        return None, []
    offset, filesz = dynamic
    count = min(filesz // dyn.size, _MAX_DYN_TAGS)
    entries = src.get(offset, count * dyn.size, "dynamic table")
    strtab = strsz = soname = None
    needed = []
    for i in range(count):
        tag, value = dyn.unpack_from(entries, i * dyn.size)
        if tag == _DT_NULL:
            break
        if tag == _DT_STRTAB:
            strtab = value
        elif tag == _DT_STRSZ:
            strsz = value
        elif tag == _DT_SONAME:
            soname = value
        elif tag == _DT_NEEDED:
            needed.append(value)
    if soname is None and not needed:
        return None, []
    if strtab is None or strsz is None:
        raise _bad(src.name, "names without a string table")
    start = next((off + strtab - va for va, size, off in loads if va <= strtab < va + size), None)
    if start is None:
        raise _bad(src.name, "string table outside the loaded segments")

    def name(index: int, what: str) -> bytes:
        if index >= strsz:
            raise _bad(src.name, f"{what} outside the string table")
        return src.string(start + index, start + strsz, _MAX_NAME, what)

    return (None if soname is None else name(soname, "SONAME"),
            [name(index, "DT_NEEDED") for index in needed])


def _abi_tag(h: _Header, src: _Source) -> tuple[int, int, int, int] | None:
    """The GNU ABI tag in the section named .note.ABI-tag, which is where upstream looks."""
    if not h.shnum:
        return None
    shdr = struct.Struct(h.endian + ("IIQQQQIIQQ" if h.elf_class == 64 else "IIIIIIIIII"))
    table = src.get(h.shoff, h.shnum * h.shentsize, "section headers")
    headers = [shdr.unpack_from(table, i * shdr.size) for i in range(h.shnum)]
    names = headers[h.shstrndx]   # name type flags addr offset size link info align entsize
    for sh_name, sh_type, _, _, offset, size, *_ in headers:
        if sh_type != _SHT_NOTE:
            continue
        wanted = _ABI_SECTION + b"\0"
        if sh_name + len(wanted) > names[5]:
            continue   # too close to the end of the name table to hold this name
        if src.get(names[4] + sh_name, len(wanted), "section name") == wanted:
            return _note_abi_tag(src.get(offset, min(size, _MAX_NOTE_BYTES), "ABI note"), h.endian)
    return None


def _note_abi_tag(data: bytes, endian: str) -> tuple[int, int, int, int] | None:
    """The GNU ABI tag among the notes in ``data`` (4-byte aligned note records)."""
    head = struct.Struct(endian + "III")
    at = 0
    while at + head.size <= len(data):
        namesz, descsz, kind = head.unpack_from(data, at)
        name_at = at + head.size
        desc_at = name_at + (namesz + 3) // 4 * 4
        at = desc_at + (descsz + 3) // 4 * 4
        if at > len(data):
            return None
        if kind == _NT_GNU_ABI_TAG and data[name_at:name_at + namesz] == b"GNU\0" and descsz >= 16:
            return struct.unpack_from(endian + "4I", data, desc_at)
    return None


def read_elf(fd_or_path: int | str) -> ElfFacts | None:
    """Facts about a host driver file, given an open fd or the path of the real file.

    A path is opened without following a final symlink (resolving links inside the driver root
    is the caller's job, done safely); an fd is read with ``pread``, so its offset is left
    alone, and is not closed. Besides the contract above, anything but a regular file and a
    file that cannot be read raise ``NvcError("elf", ...)``.
    """
    if isinstance(fd_or_path, int):
        return _read_fd(fd_or_path, f"fd {fd_or_path}")
    try:
        fd = os.open(fd_or_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as err:
        raise NvcError("elf", f"{escape(fd_or_path)}: {_strerror(err)}") from None
    try:
        return _read_fd(fd, fd_or_path)
    finally:
        os.close(fd)


def _read_fd(fd: int, name: str) -> ElfFacts | None:
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NvcError("elf", f"{escape(name)}: not a regular file")
        header = _parse_header(os.pread(fd, 64, 0), name)
        if header is None:
            return None
        src = _Source(name, st.st_size, lambda offset, length: os.pread(fd, length, offset),
                      "outside the file")
        _check_tables(header, src, sections=True)
        soname, needed = _dynamic(header, src)
        abi_tag = _abi_tag(header, src)
    except OSError as err:
        raise NvcError("elf", f"{escape(name)}: {_strerror(err)}") from None
    return ElfFacts(header.elf_class, _machine_name(header.machine),
                    "" if soname is None else os.fsdecode(soname),
                    tuple(os.fsdecode(n) for n in needed), abi_tag)


def read_untrusted_elf_header(data: bytes) -> tuple[int, str] | None:
    """(class, machine) of an image-provided file from its first bytes; None when not ELF."""
    header = _parse_header(bytes(data[:64]), "image file")
    if header is None:
        return None
    return header.elf_class, _machine_name(header.machine)


def read_untrusted_soname(data: bytes) -> str | None:
    """The SONAME of an image-provided library held in ``data`` (the file, read with a cap).

    Follows only PT_DYNAMIC and PT_LOAD, as the dynamic loader does, so stripped section
    headers do not matter. NvcError also when a table or the name lies beyond ``data``: a
    damaged file, or a cap that was too small for this file.
    """
    data = bytes(data)
    header = _parse_header(data, "image file")
    if header is None:
        return None
    src = _Source("image file", len(data), lambda offset, length: data[offset:offset + length],
                  "outside the data read")
    _check_tables(header, src, sections=False)
    soname, _ = _dynamic(header, src)
    return None if soname is None else os.fsdecode(soname)


def _strerror(err: OSError) -> str:
    text = os.strerror(err.errno) if err.errno else str(err)
    return text[:1].lower() + text[1:]
