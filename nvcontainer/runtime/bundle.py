"""Reading a bundle's spec and writing the edited one back, whole or not at all.

Read through :mod:`..request.oci` (bounded, never through a symlink or blocking on a FIFO, the
same strict JSON as the hook). Written atomically: a new file beside it in the same directory
(``O_EXCL|O_NOFOLLOW``, a name no engine reads), with the old file's mode and owner, then
renamed over it; the directory is held by an fd throughout, so both ends name the same place.
A failure at any step removes the new file and leaves the engine's as it was.

Not flushed to the disk: the rename alone gives the runtime that reads the spec next all it
needs (never half a file), and no engine reads a bundle's spec after its host crashed
(containerd and dockerd keep bundles on ``/run``, a tmpfs; podman writes the spec again at
every start). An ``fsync`` would only make the container's start wait for the filesystem's
journal, which on a node busy pulling images can take far longer than the edit itself.
NVIDIA's runtime does not flush its edit either.
"""

from __future__ import annotations

import os
import stat

from ..errors import NvcError, escape
from ..fs.replace import replace_at
from ..request import oci


def read(path: str) -> tuple[bytes, os.stat_result]:
    return oci.read_spec_file(path)


def write_back(path: str, data: bytes, old: os.stat_result) -> None:
    directory, name = os.path.split(path)
    try:
        dfd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise NvcError("input", f"cannot open {escape(directory)}: {exc.strerror}") from None
    owner = (old.st_uid, old.st_gid) if os.geteuid() == 0 else None
    try:
        replace_at(dfd, name, data, stat.S_IMODE(old.st_mode), owner, sync=False)
    except OSError as exc:
        raise NvcError("input", f"cannot write {escape(path)}: {exc.strerror}") from None
    finally:
        os.close(dfd)
