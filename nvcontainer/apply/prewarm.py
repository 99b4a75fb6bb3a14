"""Make a freshly forked process's memory its own before it has work to do, and learn which of
it a request really writes.

Why: after ``fork()`` every page is shared copy-on-write with the parent, and CPython writes to
almost every object it touches (reference counts, type caches), so a child of ``nvcontainer
serve`` takes over a thousand copy-on-write faults while it runs one hook, several
microseconds each on a virtual machine (docs/performance.md). Those faults can be taken ahead:
a spare child, forked while the server is idle, breaks the sharing with
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) before any client arrives, so the request it then
takes runs on private pages.

Why learned: a request writes about a third of the server's private writable pages, and copying
the other two thirds costs CPU on every start for nothing (issue 17 counts it). So a request
child, after its client has the answer, reads which pages it made its own (``/proc/self/pagemap``:
present and mapped by it alone, :func:`written_ranges`) and sends their ranges to the server; the next
spares copy those ranges only (:data:`LEARNED`, inherited at the fork). Until a request has
reported, a spare copies nothing: learning needs one child that did not warm up, since a warm
child's pages all read as its own. A learned range that is no longer a private writable mapping
of the process is skipped, never populated.

Only private writable mappings are touched (the heap, the interpreter's arenas, libraries'
data), never the stack, and the work stops as soon as ``stop()`` says a client is waiting: a
request must never wait for a warm-up that only exists to make it faster. A kernel without
the advice makes this a no-op.
"""

from __future__ import annotations

import array
import ctypes
import os

from ..fs.bounded import read_at_most

MADV_POPULATE_WRITE = 23
CHUNK = 256 << 10            # bytes between two looks at ``stop``
PAGE = os.sysconf("SC_PAGESIZE")
_SKIP = ("[stack]", "[vvar]", "[vvar_vclock]", "[vsyscall]", "[vdso]")
MAX_MAPS = 1 << 20           # bytes of /proc/self/maps read at most
MAX_REPORT = 64 << 10        # bytes of learned ranges (4,096 ranges) sent or taken at most
MAX_PAGES = 1 << 18          # pages of private writable mappings looked at in a report (1 GiB)
_PRESENT, _EXCLUSIVE = 1 << 63, 1 << 56   # pagemap bits

# Set in the server from the requests' reports (bytes of native (start, end) pairs), inherited
# by every child forked after: what a spare warms. None until one request reported.
LEARNED: bytes | None = None
# Set in the server before a fork: whether that child reports what it wrote (1 in REPORT_EVERY).
REPORT = False
REPORT_EVERY = 16

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def writable_private(maps_text: str) -> list[tuple[int, int]]:
    """(start, end) of every private writable mapping in ``/proc/self/maps`` text, but those
    that grow or belong to the kernel."""
    out = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or parts[1] != "rw-p":
            continue
        if len(parts) == 6 and parts[5].strip() in _SKIP:
            continue
        start, _, end = parts[0].partition("-")
        out.append((int(start, 16), int(end, 16)))
    return out


def own_pages(stop, only: bytes | None = None) -> int:
    """Populate this process's private writable mappings for writing, in chunks, until done or
    ``stop()`` is true; with ``only`` (ranges as :func:`written_ranges` packs them), just the
    parts of them within those ranges. Returns the bytes populated."""
    ranges = _mappings()
    if only is not None:
        ranges = intersect(ranges, unpack(only))
    done = 0
    for start, end in ranges:
        for at in range(start, end, CHUNK):
            if stop():
                return done
            size = min(CHUNK, end - at)
            if _libc.madvise(at, size, MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == 22:   # EINVAL: a kernel without the advice
                    return done
                continue                        # e.g. EFAULT on a guard page: skip the chunk
            done += size
    return done


def written_ranges() -> bytes:
    """The pages of this process's private writable mappings that it alone maps (written since
    the fork that shared them, or populated), as packed native (start, end) pairs, adjacent
    pages merged; at most :data:`MAX_REPORT` bytes (the lowest ranges)."""
    out = array.array("Q")
    fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        budget = MAX_PAGES
        for start, end in _mappings():
            if not budget:
                break
            pages = min((end - start) // PAGE, budget)
            budget -= pages
            entries = array.array("Q", os.pread(fd, pages * 8, start // PAGE * 8))
            run = None
            for i, entry in enumerate(entries):
                mine = entry & _PRESENT and entry & _EXCLUSIVE
                if mine and run is None:
                    run = i
                elif not mine and run is not None:
                    out.extend((start + run * PAGE, start + i * PAGE))
                    run = None
            if run is not None:
                out.extend((start + run * PAGE, start + len(entries) * PAGE))
    finally:
        os.close(fd)
    return out.tobytes()[:MAX_REPORT]


def unpack(data: bytes) -> list[tuple[int, int]]:
    """Ranges from a report: page-aligned, non-empty, ascending and not overlapping; ValueError
    otherwise (the server keeps what it had)."""
    if len(data) > MAX_REPORT or len(data) % 16:
        raise ValueError("not a whole number of ranges")
    values = array.array("Q", data)
    ranges = list(zip(values[0::2], values[1::2]))
    last = 0
    for start, end in ranges:
        if start % PAGE or end % PAGE or not last <= start < end:
            raise ValueError("ranges not page-aligned and ascending")
        last = end
    return ranges


def intersect(mappings: list[tuple[int, int]], learned: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``mappings`` that lie within ``learned`` (both ascending)."""
    out, i = [], 0
    for start, end in mappings:
        while i < len(learned) and learned[i][1] <= start:
            i += 1
        j = i
        while j < len(learned) and learned[j][0] < end:
            lo, hi = max(start, learned[j][0]), min(end, learned[j][1])
            if lo < hi:
                out.append((lo, hi))
            j += 1
    return out


def _mappings() -> list[tuple[int, int]]:
    fd = os.open("/proc/self/maps", os.O_RDONLY | os.O_CLOEXEC)
    try:
        text = read_at_most(fd, MAX_MAPS)[0].decode("ascii", "replace")
    finally:
        os.close(fd)
    return writable_private(text)
