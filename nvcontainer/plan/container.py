"""Facts about the container's rootfs that the plan depends on, read without trusting it.

The rootfs is the image's: every lookup goes through in-root resolution (the image's symlinks
are followed only inside the rootfs), nothing is opened without O_NOFOLLOW and a type check,
and reads are capped. The deciding half (:func:`library_dirs`, :func:`parse_compat_name`) is
pure; :func:`read_container` is the thin reader around it.
"""

from __future__ import annotations

import os
import stat

from .. import log
from ..errors import NvcError, escape
from ..fs.inroot import open_in_root
from ..records import record

COMPAT_DIR = "/usr/local/cuda/compat"
MAX_COMPAT_ENTRIES = 1024
ELF_HEADER_BYTES = 64

_COMPAT_NAME = r"libcuda\.so\.(\d{1,6})((?:\.\d{1,6}){1,3})"   # compiled by re on first use
# what nvcontainer serve compiles before it forks (serve/server.py preload), so no request does
PATTERNS = (_COMPAT_NAME,)

# Debian multiarch directory pairs by machine (REFERENCE §3.4).
_MULTIARCH = {
    "x86_64": ("/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu"),
    "aarch64": ("/usr/lib/aarch64-linux-gnu", "/var/empty"),
    "ppc64le": ("/usr/lib/powerpc64le-linux-gnu", "/var/empty"),
}
_ELF_MACHINE = {"x86_64": "EM_X86_64", "aarch64": "EM_AARCH64", "ppc64le": "EM_PPC64"}


@record
class CompatLib:
    path: str        # container path, e.g. /usr/local/cuda/compat/libcuda.so.560.35.03
    version: str
    major: int


@record
class ContainerFacts:
    libs_dir: str
    libs32_dir: str
    debian: bool = False
    compat: tuple[CompatLib, ...] = ()


def library_dirs(machine: str, debian: bool, has_lib32: bool, lib_is_lib64: bool, has_lib: bool) -> tuple[str, str]:
    """Where driver libraries go, by upstream's rules: Debian multiarch, else lib64/lib32."""
    if debian and machine in _MULTIARCH:
        return _MULTIARCH[machine]
    if has_lib32:
        return "/usr/lib64", "/usr/lib32"
    if has_lib and not lib_is_lib64:
        return "/usr/lib64", "/usr/lib"
    return "/usr/lib64", "/usr/lib32"


def parse_compat_name(name: str) -> tuple[str, int] | None:
    """``libcuda.so.560.35.03`` → (``560.35.03``, 560); other names → None."""
    if name.isascii():   # as the pattern reads it, without importing re (a start's milliseconds)
        version = name[len("libcuda.so."):] if name.startswith("libcuda.so.") else ""
        parts = version.split(".")
        if 2 <= len(parts) <= 4 and all(0 < len(part) <= 6 and part.isdigit() for part in parts):
            return version, int(parts[0])
        return None
    import re

    m = re.fullmatch(_COMPAT_NAME, name)
    if not m:
        return None
    return m.group(1) + m.group(2), int(m.group(1))


def forward_compat(compat: tuple[CompatLib, ...] | list[CompatLib], host_version: str) -> bool:
    """Whether the image's compat libcuda is worth using on this host: only one whose major is
    newer than the host driver's (an older or equal one gives CUDA errors 803/804)."""
    host_major = int(host_version.split(".")[0])
    return any(c.major > host_major for c in compat)


def read_container(rootfs_fd: int, machine: str | None = None) -> ContainerFacts:
    """Read the facts from an O_PATH directory fd of the rootfs."""
    machine = machine or os.uname().machine
    debian = _exists(rootfs_fd, "/etc/debian_version")
    lib64 = _identity(rootfs_fd, "/usr/lib64")
    lib = _identity(rootfs_fd, "/usr/lib")
    libs_dir, libs32_dir = library_dirs(
        machine,
        debian,
        has_lib32=_identity(rootfs_fd, "/usr/lib32") is not None,
        lib_is_lib64=lib is not None and lib == lib64,
        has_lib=lib is not None,
    )
    return ContainerFacts(libs_dir=libs_dir, libs32_dir=libs32_dir, debian=debian,
                          compat=tuple(compat_libs(rootfs_fd, machine)))


def _exists(rootfs_fd: int, path: str) -> bool:
    return _identity(rootfs_fd, path) is not None


def _identity(rootfs_fd: int, path: str) -> tuple[int, int] | None:
    try:
        fd = open_in_root(rootfs_fd, path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def compat_libs(rootfs_fd: int, machine: str | None = None) -> list[CompatLib]:
    """``libcuda.so.X.Y.Z`` regular files in the image's CUDA compat directory.

    Only their names and ELF headers are read: the libraries themselves are never mounted or
    executed by us (CVE-2024-0132, CVE-2025-23359); the plan may only point the container's
    own loader at them with an ld.so.conf.d drop-in.
    """
    machine = machine or os.uname().machine
    try:
        dfd = open_in_root(rootfs_fd, COMPAT_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    found = []
    try:
        with os.scandir(dfd) as it:
            for count, entry in enumerate(it):
                if count >= MAX_COMPAT_ENTRIES:
                    log.warning(f"{COMPAT_DIR}: more than {MAX_COMPAT_ENTRIES} entries, rest ignored")
                    break
                parsed = parse_compat_name(entry.name)
                if parsed is None:
                    continue
                if not _is_native_elf(dfd, entry.name, machine):
                    continue
                found.append(CompatLib(f"{COMPAT_DIR}/{entry.name}", *parsed))
    except OSError as exc:
        log.warning(f"cannot list {COMPAT_DIR}: {exc.strerror}")
    finally:
        os.close(dfd)
    return sorted(found, key=lambda c: c.path)


def _is_native_elf(dfd: int, name: str, machine: str) -> bool:
    from ..inventory.elfinfo import read_untrusted_elf_header

    # Check the type before opening: an image may ship device nodes under any name, and
    # opening one as host root could have side effects. Re-check after opening (a swap race).
    try:
        before = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode):
            raise OSError
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        log.warning(f"{COMPAT_DIR}/{escape(name)}: not a regular file, ignored")
        return False
    try:
        after = os.fstat(fd)
        if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            log.warning(f"{COMPAT_DIR}/{escape(name)}: not a regular file, ignored")
            return False
        header = os.pread(fd, ELF_HEADER_BYTES, 0)
    finally:
        os.close(fd)
    try:
        parsed = read_untrusted_elf_header(header)
    except NvcError:
        parsed = None
    if parsed is None or parsed != (64, _ELF_MACHINE.get(machine)):
        log.warning(f"{COMPAT_DIR}/{escape(name)}: not a 64-bit ELF for {machine}, ignored")
        return False
    return True
