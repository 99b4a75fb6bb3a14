"""Driver binaries, IPC endpoints and GSP firmware under the driver root (REFERENCE §2.2–§2.4).

Each lookup resolves inside the root, so a driver root that is a whole distribution (the GPU
Operator's ``/run/nvidia/driver``) is read as that distribution sees itself. Missing pieces are
normal (no fabric manager on a workstation) and only logged.
"""

from __future__ import annotations

import os
import stat

from .. import log
from ..fs.inroot import resolve_in_root
from .catalog import BINARIES, FABRICMANAGER_SOCKET, MPS_PIPE_DIRECTORY, PERSISTENCED_SOCKET
from .model import DriverFile

MAX_FIRMWARE = 256


def _host(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root != "/" else path


def _lstat_in_root(root: str, path: str) -> tuple[str, os.stat_result] | None:
    try:
        real = resolve_in_root(root, path)
        return real, os.lstat(_host(root, real))
    except OSError:
        return None


def binaries(root: str, search_path: str, driver_bin: str = "") -> list[DriverFile]:
    """First executable ELF file of each driver binary along ``search_path``, then in
    ``driver_bin`` (all in-root).

    Better than upstream (REFERENCE §2.2), from a real node: where the driver lives in its own
    tree (``/usr/local/nvidia/{lib64,bin}``, as on GKE-style images) ``/usr/bin/nvidia-smi`` can be
    a wrapper script that executes the tree's binary. Bound into a container it runs a host path
    the container lacks ("nvidia-smi: not found"): upstream mounts it all the same. A candidate
    that is not an ELF program is skipped, and ``driver_bin``, the ``bin`` beside the directory
    of the driver's NVML library, is searched after the PATH, where the real one is found."""
    dirs = [d for d in search_path.split(":") if d.startswith("/")]  # relative entries mean nothing in another root
    if driver_bin and driver_bin not in dirs:
        dirs.append(driver_bin)
    out = []
    for group, names in BINARIES.items():
        for name in names:
            for d in dirs:
                found = _lstat_in_root(root, os.path.join(d, name))
                if not (found and stat.S_ISREG(found[1].st_mode) and found[1].st_mode & 0o111):
                    continue
                if not _is_elf(_host(root, found[0])):
                    log.info(f"skipping {found[0]}: not an ELF program (a wrapper script would run host paths "
                             "the container lacks)")
                    continue
                out.append(DriverFile(path=found[0], group=group, name=name))
                break
            else:
                log.warning(f"missing binary {name}")
    return out


def driver_bin(nvml: str) -> str:
    """The ``bin`` beside the directory of the driver's NVML library (in-root path):
    ``/usr/local/nvidia/bin`` for ``/usr/local/nvidia/lib64/libnvidia-ml.so.1``."""
    return os.path.join(os.path.dirname(os.path.dirname(nvml)), "bin")


def _is_elf(path: str) -> bool:
    """Whether ``path`` (already lstat'ed as a regular file) starts with the ELF magic: four
    bytes read without following a symlink or waiting on anything."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.read(fd, 4) == b"\x7fELF"
    except OSError:
        return False
    finally:
        os.close(fd)


def ipcs(root: str, mps_dir: str = MPS_PIPE_DIRECTORY) -> list[DriverFile]:
    """Persistenced and fabric-manager sockets, and the MPS pipe directory, when present."""
    wanted = (
        (PERSISTENCED_SOCKET, "utility", "persistenced", stat.S_ISSOCK, "socket"),
        (FABRICMANAGER_SOCKET, "utility", "fabricmanager", stat.S_ISSOCK, "socket"),
        (mps_dir, "compute", "mps", stat.S_ISDIR, "dir"),
    )
    out = []
    for path, group, name, is_type, kind in wanted:
        found = _lstat_in_root(root, path)
        if found and is_type(found[1].st_mode):
            out.append(DriverFile(path=found[0], group=group, name=name, kind=kind))
        else:
            log.warning(f"missing ipc {path}")
    return out


def firmwares(root: str, version: str) -> list[DriverFile]:
    """``/lib/firmware/nvidia/<version>/gsp*.bin``: regular files only, no recursion."""
    found = _lstat_in_root(root, f"/lib/firmware/nvidia/{version}")
    if not found or not stat.S_ISDIR(found[1].st_mode):
        log.warning(f"missing firmware directory /lib/firmware/nvidia/{version}")
        return []
    directory = found[0]
    names = []
    try:
        with os.scandir(_host(root, directory)) as it:
            for entry in it:
                if len(names) >= MAX_FIRMWARE:
                    break
                if entry.name.startswith("gsp") and entry.name.endswith(".bin") and entry.is_file(follow_symlinks=False):
                    names.append(entry.name)
    except OSError as exc:
        log.warning(f"cannot list {directory}: {exc.strerror}")
    return [DriverFile(path=os.path.join(directory, n), name="gsp") for n in sorted(names)]
