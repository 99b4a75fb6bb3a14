"""Reader for glibc's ``ld.so.cache``: where the host's dynamic loader finds each SONAME.

The driver inventory starts here, as libnvidia-container does: the cache already names the
library file for every SONAME and architecture, so nothing has to walk library directories.

The cache is parsed from a bounded copy in memory rather than mapped: a C mapping dies with
SIGBUS when a concurrent writer truncates the file, a copy is merely short. Every count and
offset is checked against the copy before it is used, and every string must end inside it,
so a damaged or hostile cache is reported as one ``ldcache`` error and never as a traceback.

Only the standard library is imported: the OCI hook imports this module on its fast path.
"""

from __future__ import annotations

import os
import struct

from nvcontainer.errors import NvcError, escape
from nvcontainer.fs.bounded import Refused, read_regular
from nvcontainer.records import record

# Architecture codes kept in bits 8..15 of an entry's flags (glibc's FLAG_*_LIB* values).
ARCH_I386 = 0x0000
ARCH_X86_64 = 0x0300
ARCH_PPC64 = 0x0500
ARCH_X32 = 0x0800
ARCH_ARMHF = 0x0900
ARCH_AARCH64 = 0x0A00
_ARCH_MASK = 0xFF00
_FLAG_ELF = 0x0001   # set for ELF (0x01) and ELF_LIBC6 (0x03), clear for LIBC5 (0x02)

# uname machine -> (64-bit code, 32-bit code or None); the pairs upstream compiles in.
_NATIVE = {
    "x86_64": (ARCH_X86_64, ARCH_I386),
    "aarch64": (ARCH_AARCH64, ARCH_ARMHF),
    "arm64": (ARCH_AARCH64, ARCH_ARMHF),
    "ppc64le": (ARCH_PPC64, None),
}

MAX_BYTES = 64 << 20
# A large distribution install has a few thousand entries; far more means a damaged file.
MAX_ENTRIES = 1 << 17
# Keys are file names and values are paths: PATH_MAX bounds both.
_MAX_STRING = 4096
# Overlapping strings could otherwise make a small file decode into gigabytes.
_MAX_DECODED = 64 << 20

_OLD_MAGIC = b"ld.so-1.7.0"
_OLD_HEADER = struct.Struct("=11sxI")             # magic, padding, nlibs
_OLD_ENTRY_SIZE = 12                              # i32 flags, u32 key, u32 value
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_NEW_HEADER = struct.Struct("=20sIIB3xI12x")      # magic+version, nlibs, len_strings, flags, ext
_NEW_ENTRY = struct.Struct("=iIIIQ")              # flags, key, value, osversion, hwcap

# Byte-order marker in the new header's flags (glibc >= 2.33); 0 means "not recorded".
_ENDIAN_MASK = 0x03
_ENDIAN_NATIVE = 0x02 if struct.pack("=H", 1) == b"\x01\x00" else 0x03


@record
class CacheEntry:
    flags: int
    key: str     # the SONAME, e.g. libcuda.so.1
    value: str   # the path the loader uses, e.g. /usr/lib/x86_64-linux-gnu/libcuda.so.1


def native_arches(machine: str | None = None) -> tuple[int, int | None]:
    """The (64-bit, 32-bit) cache codes for this host; the 32-bit side is None where there is none."""
    if machine is None:
        machine = os.uname().machine
    try:
        return _NATIVE[machine]
    except KeyError:
        raise NvcError("ldcache", f"unsupported architecture: {escape(machine)}") from None


def entries_for_arch(entries: list[CacheEntry], arch: int) -> list[CacheEntry]:
    """The entries the loader would use for ``arch``, in file order (hwcap and OS version ignored)."""
    return [e for e in entries if e.flags & _FLAG_ELF and e.flags & _ARCH_MASK == arch]


def parse(data: bytes, path: str = "ld.so.cache") -> list[CacheEntry]:
    """All entries of a cache image, in file order. ``path`` only names the file in errors."""
    data = bytes(data)

    def fail(why: str) -> NvcError:
        return NvcError("ldcache", f"{escape(path)}: {why}")

    if len(data) > MAX_BYTES:
        raise fail("file too large")
    start = 0
    if data.startswith(_OLD_MAGIC):
        if len(data) < _OLD_HEADER.size:
            raise fail("truncated")
        _, old_count = _OLD_HEADER.unpack_from(data)
        if old_count > MAX_ENTRIES:
            raise fail("too many entries")
        start = _OLD_HEADER.size + old_count * _OLD_ENTRY_SIZE
        start = (start + 7) & ~7   # the new header is 8-byte aligned after the old entries
        if start + len(_NEW_MAGIC) > len(data):
            raise fail("truncated")
    if data[start:start + len(_NEW_MAGIC)] != _NEW_MAGIC:
        raise fail("unsupported file format")
    if start + _NEW_HEADER.size > len(data):
        raise fail("truncated")
    _, count, _, flags, _ = _NEW_HEADER.unpack_from(data, start)
    if flags and flags & _ENDIAN_MASK != _ENDIAN_NATIVE:
        raise fail("unsupported file format (byte order)")
    if count > MAX_ENTRIES:
        raise fail("too many entries")
    if start + _NEW_HEADER.size + count * _NEW_ENTRY.size > len(data):
        raise fail("truncated")

    strings: dict[int, str] = {}
    budget = _MAX_DECODED

    def string(offset: int, index: int) -> str:
        nonlocal budget
        if offset in strings:
            return strings[offset]
        at = start + offset
        if at >= len(data):
            raise fail(f"corrupt entry {index}: string offset out of range")
        end = data.find(b"\0", at, at + _MAX_STRING)
        if end < 0:
            raise fail(f"corrupt entry {index}: unterminated string")
        budget -= end - at
        if budget < 0:
            raise fail("strings too large")
        text = strings[offset] = os.fsdecode(data[at:end])
        return text

    entries = []
    for i in range(count):
        flags, key, value, _, _ = _NEW_ENTRY.unpack_from(data, start + _NEW_HEADER.size + i * _NEW_ENTRY.size)
        entries.append(CacheEntry(flags, string(key, i), string(value, i)))
    return entries


def read(path: str, max_bytes: int = MAX_BYTES) -> list[CacheEntry]:
    """Parse the cache file at ``path``, refusing symlinks and anything but a regular file.

    O_NONBLOCK keeps a FIFO planted at the path from blocking the open; the size cap keeps a
    device node or a sparse file from filling memory.
    """
    try:
        data = read_regular(path, max_bytes, follow=False)[0]
    except Refused as exc:
        raise NvcError("ldcache", f"{escape(path)}: {'file too large' if exc.large else exc}") from None
    except OSError as err:
        raise NvcError("ldcache", f"{escape(path)}: {_strerror(err)}") from None
    return parse(data, path)


def _strerror(err: OSError) -> str:
    text = os.strerror(err.errno) if err.errno else str(err)
    return text[:1].lower() + text[1:]
