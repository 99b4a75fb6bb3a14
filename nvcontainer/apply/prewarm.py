"""Make a freshly forked process's memory its own before it has work to do.

Why: after ``fork()`` every page is shared copy-on-write with the parent, and CPython writes to
almost every object it touches (reference counts, type caches), so a child of ``nvcontainer
serve`` takes well over a thousand copy-on-write faults while it runs one hook, several
microseconds each on a virtual machine (docs/performance.md). Those faults can be taken ahead:
a spare child, forked while the server is idle, breaks the sharing of its writable private
mappings with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) before any client arrives, so the
request it then takes runs on private pages.

Only private writable mappings are touched (the heap, the interpreter's arenas, libraries'
data), never the stack, and the work stops as soon as ``stop()`` says a client is waiting: a
request must never wait for a warm-up that only exists to make it faster. A kernel without
the advice makes this a no-op.
"""

from __future__ import annotations

import ctypes
import os

from ..fs.bounded import read_at_most

MADV_POPULATE_WRITE = 23
CHUNK = 256 << 10            # bytes between two looks at ``stop``
_SKIP = ("[stack]", "[vvar]", "[vvar_vclock]", "[vsyscall]", "[vdso]")
MAX_MAPS = 1 << 20           # bytes of /proc/self/maps read at most

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


def own_pages(stop) -> int:
    """Populate this process's private writable mappings for writing, in chunks, until done or
    ``stop()`` is true. Returns the bytes populated."""
    fd = os.open("/proc/self/maps", os.O_RDONLY | os.O_CLOEXEC)
    try:
        text = read_at_most(fd, MAX_MAPS)[0].decode("ascii", "replace")
    finally:
        os.close(fd)
    done = 0
    for start, end in writable_private(text):
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
