"""Our sockets in the kubelet's device plugin directory, created and removed without trusting
what else is in there.

Why care: the plugin runs as root on every node and the directory is shared with the kubelet
and other plugins. A name in it may be a stale socket of ours, a live socket of another plugin,
or a symlink someone planted to make a root process create or delete something elsewhere. So:

* the directory is opened once (``O_NOFOLLOW``) and must belong to root and be writable by
  nobody else; every later operation is relative to that descriptor, and the socket is bound
  through ``/proc/self/fd/<fd>/<name>``, so a directory renamed or replaced meanwhile does not
  redirect it;
* a name we are about to bind is looked at with ``lstat``: a live socket means another plugin
  instance is serving and is an error; a dead socket, a symlink or a regular file there is
  removed itself (``unlink`` never follows a symlink); anything else is refused;
* the socket is bound under a fresh hidden name and then renamed to its own without replacing
  anything (``RENAME_NOREPLACE``): gRPC unlinks the path it bound when the server stops, and
  that path then no longer names anything;
* after publishing, the socket's identity (inode and change time) is recorded, and on exit only
  that socket is removed: one the kubelet (or a newer instance of this plugin) put there is
  left alone.
"""

from __future__ import annotations

import os
import secrets
import socket
import stat

from ..errors import NvcError, escape
from ..fs.syscalls import RENAME_NOREPLACE, renameat2

PROBE_TIMEOUT = 0.5


def open_dir(path: str) -> int:
    """A descriptor of the socket directory, made (0700) if it does not exist."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise NvcError("input", f"socket directory {escape(path)}: {exc.strerror}") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise NvcError("input", f"socket directory {escape(path)}: must belong to uid {os.geteuid()} and not be "
                                "writable by group or others")
    return fd


def address(dirfd: int, name: str) -> str:
    """The gRPC address of ``name`` in the directory, through the descriptor."""
    return f"unix:/proc/self/fd/{dirfd}/{name}"


def identity(dirfd: int, name: str):
    """(device, inode, ctime) of the socket ``name``, or None when there is no socket by that
    name. The change time tells a new socket from ours when the filesystem reuses the inode
    number of one just deleted (tmpfs and ext4 both do)."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


def clear(dirfd: int, name: str, warn) -> None:
    """Make ``name`` free to bind, or raise: see the module's rules."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode):
        if _answers(dirfd, name):
            raise NvcError("input", f"{escape(name)}: another process is listening on it (a second plugin?)")
    elif stat.S_ISLNK(st.st_mode) or stat.S_ISREG(st.st_mode):
        warn(f"removing {'a symlink' if stat.S_ISLNK(st.st_mode) else 'a file'} at {escape(name)} "
             "in the socket directory")
    else:
        raise NvcError("input", f"{escape(name)} in the socket directory is not a socket")
    try:
        os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        pass


def staging_name(name: str) -> str:
    """A fresh hidden name to bind ``name``'s socket under before :func:`publish`."""
    return f".{name}.{secrets.token_hex(8)}"


def publish(dirfd: int, staged: str, name: str) -> None:
    """Give the socket bound as ``staged`` its name, unless something took the name meanwhile."""
    try:
        renameat2(dirfd, staged, dirfd, name, RENAME_NOREPLACE)
    except OSError as exc:
        try:
            os.unlink(staged, dir_fd=dirfd)
        except OSError:
            pass
        raise NvcError("input", f"{escape(name)}: cannot be created ({exc.strerror})") from None


def clear_staged(dirfd: int, name: str) -> None:
    """Remove hidden sockets an earlier run of ours bound as ``name`` and never renamed (it was
    killed in between), if nothing answers on them."""
    prefix = f".{name}."
    for entry in os.listdir(dirfd):
        if entry.startswith(prefix) and identity(dirfd, entry) is not None and not _answers(dirfd, entry):
            try:
                os.unlink(entry, dir_fd=dirfd)
            except OSError:
                pass


def remove_if_ours(dirfd: int, name: str, ours) -> bool:
    """Remove ``name`` when it is still the socket we bound (``ours``: its identity)."""
    if ours is None or identity(dirfd, name) != ours:
        return False
    try:
        os.unlink(name, dir_fd=dirfd)
    except OSError:
        return False
    return True


def _answers(dirfd: int, name: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(PROBE_TIMEOUT)
        try:
            probe.connect(f"/proc/self/fd/{dirfd}/{name}")
        except OSError:
            return False
    return True
