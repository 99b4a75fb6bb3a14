"""Reading what we did not write, with a bound: the one loop every reader of kernel, engine,
cache and image files shares.

Why one loop: each reader must stop at its bound whatever the file claims (procfs files say size
0; a FIFO or a growing file says nothing), must tell "exactly the bound" from "more than it"
(one byte past is read for that), and must never hold more than the bound plus one read. The
callers keep their own policy: which open flags, whether too large is an error or a truncation,
which error category a failure gets. :func:`read_regular` is the whole of a regular file read
that way (the configuration, a bundle's spec, CDI specs, the ld.so.cache, the inventory cache's
entries, the leases): one open with the same flags and one check of the type and the size.
"""

from __future__ import annotations

import os
import stat

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


class Refused(Exception):
    """A file :func:`read_regular` will not read: not a regular file, or larger than its bound
    (``large``); the message says which, as the callers' errors repeat it."""

    def __init__(self, why: str, large: bool = False):
        super().__init__(why)
        self.large = large


class ReadFailed(OSError):
    """The file was opened, and then reading it failed (the callers say "cannot read", not
    "cannot open")."""


def read_regular(path: str, limit: int, *, follow: bool = True, dir_fd: int | None = None,
                 check=None) -> tuple[bytes, os.stat_result]:
    """The whole of the regular file at ``path`` and its ``fstat``: never blocking on a FIFO or
    taking a terminal (``O_NONBLOCK | O_NOCTTY``), without following a final symlink unless
    ``follow``, and at most ``limit`` bytes (by its size, then by what is read). ``check(stat)``:
    why else not to read it (another owner, say), or None.

    Raises what ``open`` raises (``FileNotFoundError`` for a missing file; ``ValueError`` for a
    NUL in the path), :class:`Refused`, or :class:`ReadFailed`. The one reader of a whole file
    we did not write; each caller keeps its own error category and words.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not a regular file")
        why = check(st) if check is not None else None
        if why:
            raise Refused(why)
        if st.st_size > limit:
            raise Refused(f"larger than {limit} bytes", large=True)
        data, more = read_at_most(fd, limit)
    except OSError as exc:
        raise ReadFailed(exc.errno, exc.strerror) from None
    finally:
        os.close(fd)
    if more:
        raise Refused(f"larger than {limit} bytes", large=True)
    return data, st
