"""Reading what we did not write, with a bound: the one loop every reader of kernel, engine,
cache and image files shares.

Why one loop: each reader must stop at its bound whatever the file claims (procfs files say size
0; a FIFO or a growing file says nothing), must tell "exactly the bound" from "more than it"
(one byte past is read for that), and must never hold more than the bound plus one read. The
callers keep their own policy: which open flags, whether too large is an error or a truncation,
which error category a failure gets.
"""

from __future__ import annotations

import os

CHUNK = 1 << 16


def read_at_most(fd: int, limit: int) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes from ``fd``, read to EOF, and whether the file had more."""
    chunks, size = [], 0
    while size <= limit:
        chunk = os.read(fd, min(CHUNK, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    data = b"".join(chunks)
    return data[:limit], size > limit
