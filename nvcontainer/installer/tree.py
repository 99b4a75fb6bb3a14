"""The programs an engine executes, put on the host: a versioned copy of a tree and one symlink.

Why versioned: an engine starts containers while a rolling update replaces the installer's pod.
Engines are given paths through ``DIR/current`` (``DIR/current/bin/nvidia-container-runtime``),
and ``current`` is a symlink to ``DIR/versions/<id>``: a new version is copied in full under a
hidden name, renamed into ``versions/`` when complete, and ``current`` is then replaced by one
rename of a new link over it. A program started during the update resolves ``current`` once,
when the kernel executes it, and from then on finds its interpreter and modules beside its own
file (``/proc/self/exe``), so it runs wholly from the old version or wholly from the new one.
The previous version is kept until the next update, for a start that was already running it.

A copy cut short (the pod killed, the node out of disk) is only ever a hidden directory under
``versions/``; the next run removes it. ``<id>`` is the version and a digest of the tree's
bytes, so an image rebuilt under the same version is a new directory, never an overwrite.

The file system holding ``DIR`` may be read-only (``/usr`` on image-based hosts): the default
then falls back to ``/opt`` or ``/var/lib``, said in one line; a directory the operator chose
is never second-guessed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat

from ..errors import NvcError, escape

VERSIONS = "versions"
CURRENT = "current"
STAGING = ".staging-"
# what an engine executes, which the tree must hold in bin/
REQUIRED = ("nvidia-container-runtime", "nvidia-container-runtime-hook", "nvcontainer-hook-client",
            "nvcontainer-hook", "nvidia-container-cli")
ELF_CAP = 256 << 20
GLIBC_RE = re.compile(rb"GLIBC_2\.(\d+)(?![\d.])")
LIBC_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64",
             "lib/aarch64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib", "usr/lib")


def writable_dir(host_root: str, wanted: str, fallbacks: tuple[str, ...], explicit: bool) -> tuple[str, str]:
    """The directory to install into (a host path) and a note ('' if it is ``wanted``): the first
    of ``wanted`` and, unless the operator chose it, ``fallbacks`` that can be created/written."""
    tried = []
    for path in (wanted, *(() if explicit else fallbacks)):
        where = os.path.join(host_root, path.lstrip("/"))
        try:
            os.makedirs(where, mode=0o755, exist_ok=True)
            probe = os.path.join(where, f".probe-{os.getpid()}")
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise NvcError("install", f"{escape(path)}: {exc.strerror}") from None
            tried.append(f"{path} ({exc.strerror})")
            continue
        note = "" if path == wanted else f"{wanted} is not writable ({tried[0].split(' (', 1)[1][:-1]}): " \
                                         f"installing into {path}"
        return path, note
    raise NvcError("install", "no writable directory to install into: " + ", ".join(tried))


def _files(tree: str):
    for top, dirs, files in os.walk(tree):
        dirs.sort()
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            yield os.path.join(top, name)


def identity(tree: str, version: str) -> str:
    """``<version>-<12 hex>``: the digest of every path, mode, link target and byte of ``tree``."""
    h = hashlib.sha256()
    for path in _files(tree):
        st = os.lstat(path)
        h.update(os.path.relpath(path, tree).encode() + b"\0" + oct(stat.S_IMODE(st.st_mode)).encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(b"L" + os.readlink(path).encode())
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    safe = re.sub(r"[^A-Za-z0-9.+_-]", "_", version)[:40] or "0"
    return f"{safe}-{h.hexdigest()[:12]}"


def check_tree(tree: str) -> None:
    """The tree holds what engines will be told to execute."""
    missing = [n for n in REQUIRED if not os.access(os.path.join(tree, "bin", n), os.X_OK)]
    if missing:
        raise NvcError("install", f"{escape(tree)}: no bin/{', bin/'.join(missing)}: not an nvcontainer tree "
                                  "(scripts/bundle makes one)")


def links_outside(tree: str) -> list[str]:
    """``path -> target`` for each link of the tree that leaves it (the host must then have that
    target: the tree is not self-contained)."""
    out = []
    real = os.path.abspath(tree)
    for path in _files(tree):
        if os.path.islink(path):
            target = os.readlink(path)
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
            if os.path.isabs(target) or not (resolved + "/").startswith(real + "/"):
                out.append(f"{os.path.relpath(path, tree)} -> {target}")
    return out


def glibc_of(data: bytes) -> tuple[int, int] | None:
    """The newest ``GLIBC_2.N`` a file names (a libc defines them all up to its own version; a
    program's newest is the glibc it needs)."""
    found = [int(m) for m in GLIBC_RE.findall(data)]
    return (2, max(found)) if found else None


def tree_needs(tree: str) -> tuple[int, int] | None:
    """The oldest host glibc the tree's programs can run on; None when they need none of the
    host's (static programs, or a tree with its own C library and loader)."""
    if any(name.startswith("libc.so.6") for _, _, files in os.walk(tree) for name in files):
        return None
    need = None
    for path in _files(tree):
        try:
            if os.path.islink(path) or os.path.getsize(path) > ELF_CAP:
                continue
            with open(path, "rb") as f:
                if f.read(4) != b"\x7fELF":
                    continue
                got = glibc_of(f.read())
        except OSError:
            continue
        if got and (need is None or got > need):
            need = got
    return need


def host_glibc(host_root: str) -> tuple[int, int] | None:
    """The host's glibc version, from its ``libc.so.6`` (read in the host's root); None if none."""
    from ..fs.bounded import read_at_most
    from ..fs.inroot import open_in_root

    root = os.open(host_root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for d in LIBC_DIRS:
            try:
                fd = open_in_root(root, f"{d}/libc.so.6", os.O_RDONLY | os.O_CLOEXEC)
            except (OSError, NvcError):
                continue
            try:
                data, _ = read_at_most(fd, 16 << 20)
            finally:
                os.close(fd)
            version = glibc_of(data)
            if version:
                return version
    finally:
        os.close(root)
    return None


def glibc_problem(need: tuple[int, int] | None, host: tuple[int, int] | None) -> str | None:
    if need is None or host is None or host >= need:
        return None
    return (f"the host's glibc is {host[0]}.{host[1]}; the programs to install need {need[0]}.{need[1]} or later "
            "(install the self-contained tree of scripts/bundle, which brings its own)")


def _clear_staging(versions: str) -> None:
    for name in os.listdir(versions):
        if name.startswith(STAGING):
            shutil.rmtree(os.path.join(versions, name), ignore_errors=True)


def _copy(src: str, dst: str) -> None:
    """``src`` to ``dst`` (new), links as links, every file flushed before the caller's rename."""
    shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copy2)
    for path in _files(dst):
        if os.path.isfile(path) and not os.path.islink(path):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def current_version(where: str) -> str | None:
    """The version ``DIR/current`` names (``where`` is DIR as the installer sees it)."""
    try:
        target = os.readlink(os.path.join(where, CURRENT))
    except OSError:
        return None
    return os.path.basename(target)


def install(src: str, where: str, ident: str) -> tuple[str, str | None]:
    """``src`` as ``where/versions/<ident>``, then ``current`` pointed at it by one rename;
    (what was done, the version current named before)."""
    versions = os.path.join(where, VERSIONS)
    os.makedirs(versions, mode=0o755, exist_ok=True)
    _clear_staging(versions)
    final = os.path.join(versions, ident)
    copied = not os.path.isdir(final)
    if copied:
        staging = os.path.join(versions, f"{STAGING}{ident}-{os.getpid()}")
        try:
            _copy(src, staging)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    before = current_version(where)
    link = os.path.join(where, f".{CURRENT}-{os.getpid()}")
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(os.path.join(VERSIONS, ident), link)
    os.rename(link, os.path.join(where, CURRENT))
    _fsync_dir(where)
    what = ("installed" if copied else "kept") + f" {ident}"
    return what, before


def prune(where: str, keep: tuple[str | None, ...]) -> list[str]:
    """Versions other than ``keep`` removed; their names."""
    versions = os.path.join(where, VERSIONS)
    gone = []
    for name in sorted(os.listdir(versions)) if os.path.isdir(versions) else []:
        if name not in keep and not name.startswith(STAGING):
            shutil.rmtree(os.path.join(versions, name), ignore_errors=True)
            gone.append(name)
    return gone


def remove(where: str) -> None:
    """Everything installed: ``current`` first (engines find nothing from then on), then the
    versions, then the directory if nothing else is left in it."""
    link = os.path.join(where, CURRENT)
    if os.path.islink(link):
        os.unlink(link)
    shutil.rmtree(os.path.join(where, VERSIONS), ignore_errors=True)
    try:
        os.rmdir(where)
    except OSError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
