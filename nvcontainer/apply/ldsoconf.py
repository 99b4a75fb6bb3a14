"""The image's ``ld.so.conf``, read by us and handed to ldconfig flattened, and the library
links ldconfig would block on.

Why not let ldconfig read it: glibc's ldconfig opens the configuration and every ``include``
with a plain ``fopen`` and reads lines with ``getline``. A FIFO there (or a link to a pipe
through ``/proc/self/fd``) blocks it until the deadline; a sparse multi-GiB file grows one line
until memory runs out. So the sandbox reads the files itself, before ldconfig starts, with the
rules of glibc's ``parse_conf`` (``#`` comments, ``include`` glob patterns relative to the
including file, ``hwcap`` lines ignored) and every bound glibc lacks: regular files only
(opened ``O_NONBLOCK``, on the ``nodev`` sandbox mount, then ``fstat``), nothing on procfs or
sysfs, in-root resolution without magic links, at most :data:`MAX_FILE` bytes per file,
:data:`MAX_FILES` files, :data:`MAX_DEPTH` nested includes and :data:`MAX_ENTRIES` names per
globbed directory. A bad file is skipped with a warning, as glibc skips a file it cannot
open. ldconfig then gets one file of directory lines and no ``include``, written by us into a
tmpfs of the sandbox: it never opens the image's configuration at all, so nothing swapped in
after our read can reach it either.

ldconfig also opens, without ``O_NONBLOCK``, every file a library-named *symlink* in a scanned
directory leads to (a FIFO named like a library is skipped by its ``d_type``, a link to one is
not). :func:`blocking_link` finds such a link first, so the run is refused in one line instead
of waiting out the deadline. A FIFO swapped in after that check only costs the deadline.

:func:`parse` is pure; the readers take an ``O_PATH`` fd of the rootfs.
"""

from __future__ import annotations

import errno
import os
import stat

from ..fs import syscalls as sc
from ..fs.inroot import open_in_root

CONF = b"/etc/ld.so.conf"
MAX_FILE = 256 << 10        # a real ld.so.conf or drop-in is well under 4 KiB
MAX_FILES = 512
MAX_DEPTH = 16              # glibc recurses until it runs out of fds
MAX_ENTRIES = 4096          # per directory listed for a glob or scanned for links
MAX_DIRS = 4096
MAX_TOTAL = 1 << 20         # the flattened file, which lives in a small tmpfs
SYSFS_MAGIC = 0x62656572
_SPACE = b" \t\n\v\f\r"

# Where ldconfig itself looks besides the configuration (SLIBDIR, LIBDIR and add_system_dir's
# variants): checked for blocking links too; a directory ldconfig skips costs one listing.
SYSTEM_DIRS = (b"/lib", b"/usr/lib", b"/lib64", b"/usr/lib64", b"/lib32", b"/usr/lib32", b"/libx32", b"/usr/libx32")


def parse(data: bytes) -> list[tuple[str, bytes]]:
    """``("dir", line)`` and ``("include", pattern)`` items of one file, in order, as glibc's
    ``parse_conf`` reads it: a line ends at a newline (and, being a C string, at a NUL), ``#``
    starts a comment, leading whitespace is dropped, ``include`` takes blank-separated glob
    patterns, ``hwcap`` lines are ignored, anything else is a directory line kept verbatim
    (ldconfig trims it and reads ``dir=type`` itself)."""
    items = []
    for line in data.split(b"\n"):
        line = line.split(b"\0", 1)[0].split(b"#", 1)[0].lstrip(_SPACE)
        if not line:
            continue
        if line.startswith(b"include") and line[7:8] in (b" ", b"\t"):
            items.extend(("include", word) for word in line[8:].replace(b"\t", b" ").split(b" ") if word)
        elif line[:5].lower() == b"hwcap" and line[5:6] in (b" ", b"\t"):
            continue
        else:
            items.append(("dir", line))
    return items


class Flattener:
    """One run over the image's configuration: :meth:`flatten` returns the directory lines;
    ``warnings`` says what was skipped and why."""

    def __init__(self, root_fd: int):
        self.root_fd = root_fd
        self.warnings: list[str] = []
        self.files = 0
        self.lines: list[bytes] = []
        self.size = 0
        self._stack: list[tuple[int, int]] = []

    def flatten(self, path: bytes = CONF) -> bytes:
        self._read(path, missing_ok=True)
        return b"".join(line + b"\n" for line in self.lines)

    def _warn(self, path: bytes, why: str) -> None:
        self.warnings.append(f"{os.fsdecode(path)}: {why}, ignored")

    def _read(self, path: bytes, missing_ok: bool = False) -> None:
        if self.files >= MAX_FILES:
            return self._warn(path, f"more than {MAX_FILES} configuration files")
        if len(self._stack) >= MAX_DEPTH:
            return self._warn(path, f"includes nested deeper than {MAX_DEPTH}")
        self.files += 1
        data = self._load(path, missing_ok)
        if data is None:
            return
        try:
            for kind, value in parse(data):
                if kind == "dir":
                    self.size += len(value) + 1
                    if len(self.lines) >= MAX_DIRS or self.size > MAX_TOTAL:
                        return self._warn(path, f"more than {MAX_DIRS} library directories or {MAX_TOTAL} bytes")
                    self.lines.append(value)
                    continue
                if not value.startswith(b"/"):
                    value = os.path.dirname(path) + b"/" + value
                for match in self._glob(value):
                    self._read(match, missing_ok=True)   # glob(3) names only what exists
        finally:
            self._stack.pop()

    def _load(self, path: bytes, missing_ok: bool) -> bytes | None:
        """The file's bytes, or None (warned) when it is not a small regular file of the image.
        Pushes the file's identity on the include stack when it returns bytes."""
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = open_in_root(self.root_fd, os.fsdecode(path), flags)
        except OSError as exc:
            if not (missing_ok and exc.errno == errno.ENOENT):
                self._warn(path, f"cannot be opened ({os.strerror(exc.errno or errno.EIO)})")
            return None
        try:
            st = os.fstat(fd)
            why = _not_plain(fd, st)
            if why:
                return self._warn(path, why)
            if (st.st_dev, st.st_ino) in self._stack:
                return self._warn(path, "includes itself")
            if st.st_size > MAX_FILE:
                return self._warn(path, f"larger than {MAX_FILE} bytes")
            data = os.pread(fd, MAX_FILE + 1, 0)
            if len(data) > MAX_FILE:
                return self._warn(path, f"larger than {MAX_FILE} bytes")
        except OSError as exc:
            return self._warn(path, f"cannot be read ({exc.strerror})")
        finally:
            os.close(fd)
        self._stack.append((st.st_dev, st.st_ino))
        return data

    def _glob(self, pattern: bytes) -> list[bytes]:
        """glob(3) without flags, in-root: sorted bytewise, a wildcard never matches a leading
        dot, components without wildcards are taken as they are."""
        found = [b""]
        parts = [p for p in pattern.split(b"/") if p]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if not any(c in part for c in b"*?["):
                found = [f + b"/" + part for f in found]
                continue
            matches = []
            for base in found:
                for name in self._list(base or b"/"):
                    if name.startswith(b".") and not part.startswith(b"."):
                        continue
                    if _matches(name, part):
                        matches.append(base + b"/" + name)
            found = sorted(matches)
            if not last and not found:
                break
        return found if pattern.strip(b"/") else []

    def _list(self, path: bytes) -> list[bytes]:
        try:
            fd = open_in_root(self.root_fd, os.fsdecode(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            if sc.fstatfs_type(fd) in (sc.PROC_SUPER_MAGIC, SYSFS_MAGIC):
                self._warn(path, "include pattern reaches into procfs or sysfs")
                return []
            names = []
            with os.scandir(fd) as it:
                for entry in it:
                    if len(names) >= MAX_ENTRIES:
                        self._warn(path, f"more than {MAX_ENTRIES} entries for an include pattern")
                        break
                    names.append(os.fsencode(entry.name))
            return names
        except OSError:
            return []
        finally:
            os.close(fd)


def directories(lines: list[bytes]) -> list[bytes]:
    """The paths ldconfig makes of directory lines (``add_dir_1``: ``=type`` cut, trailing
    blanks and slashes trimmed)."""
    out = []
    for line in lines:
        path = line.split(b"=", 1)[0].rstrip(_SPACE).rstrip(b"/")
        if path:
            out.append(path)
    return out


def _not_plain(fd: int, st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if sc.fstatfs_type(fd) in (sc.PROC_SUPER_MAGIC, SYSFS_MAGIC):
        return "on procfs or sysfs"
    return None


def _looks_like_library(name: str) -> bool:
    """The names glibc's ldconfig opens in a scanned directory."""
    return (name.startswith("lib") or name.startswith("ld-")) and ".so" in name


def blocking_link(directories: list[bytes], limit: int = MAX_ENTRIES) -> str | None:
    """In the pivoted sandbox (``/`` is the rootfs): the first library-named symlink in
    ``directories`` (and their ``glibc-hwcaps`` subdirectories) whose target is not a regular
    file, directory or nothing at all, i.e. one ldconfig's blocking ``open`` would hang on or
    act on; as a message, or None."""
    todo = list(dict.fromkeys(d.rstrip(b"/") or b"/" for d in directories))
    seen: set[tuple[int, int]] = set()
    while todo:
        directory = todo.pop(0)
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(fd) as it:
                for count, entry in enumerate(it):
                    if count >= limit:
                        break
                    name = entry.name
                    if name == "glibc-hwcaps" and not directory.endswith(b"/glibc-hwcaps"):
                        todo.append(directory + b"/glibc-hwcaps")
                    elif directory.endswith(b"/glibc-hwcaps") and entry.is_dir():
                        todo.append(directory + b"/" + os.fsencode(name))
                    if not entry.is_symlink() or not _looks_like_library(name):
                        continue
                    try:
                        target = os.stat(name, dir_fd=fd)
                    except OSError:
                        continue   # dangling or unreadable: ldconfig skips it too
                    if not (stat.S_ISREG(target.st_mode) or stat.S_ISDIR(target.st_mode)):
                        what = ("a FIFO" if stat.S_ISFIFO(target.st_mode) else "a socket" if stat.S_ISSOCK(target.st_mode)
                                else "a device node")
                        return (f"{os.fsdecode(directory)}/{name}: a library link to {what}, "
                                "which ldconfig would open and wait on; refusing the image")
        except OSError:
            continue
        finally:
            os.close(fd)
    return None


def _matches(name: bytes, pattern: bytes) -> bool:
    """``fnmatch.fnmatchcase(name, pattern)``. A pattern whose only wildcard is ``*`` (the usual
    ``include /etc/ld.so.conf.d/*.conf``) is matched here: fnmatch translates every pattern
    into a regular expression, and importing it and re costs the sandbox milliseconds."""
    if b"?" in pattern or b"[" in pattern:
        import fnmatch

        return fnmatch.fnmatchcase(name, pattern)
    if b"*" not in pattern:
        return name == pattern
    first, *middle, last = pattern.split(b"*")
    if len(name) < len(first) + len(last) or not name.startswith(first) or not name.endswith(last):
        return False
    at, end = len(first), len(name) - len(last)
    for part in middle:   # each as early as it can come: what is left to match is then the most
        at = name.find(part, at, end)
        if at < 0:
            return False
        at += len(part)
    return True
