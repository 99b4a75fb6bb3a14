"""Mounting through file descriptors.

A mount is the most dangerous thing the hook does to a hostile rootfs: a mount that lands one
directory off can put host files under the container's control (CVE-2021-30465, CVE-2024-0132).
So targets are always O_PATH fds from :mod:`inroot`, never strings, and sources are opened on
the host side.

The preferred path is the new mount API (Linux ≥ 5.12 for mount_setattr): clone the source
into a detached mount, make it read-only/nosuid/nodev and private *before* it is visible
anywhere, then move it onto the target fd. :func:`bind_classic` is the fallback for older
kernels; its bind is briefly writable, so it re-opens and verifies the result before
remounting (SECURITY.md §3.2 items 3-5, 12).
"""

from __future__ import annotations

import errno
import os
import select
import stat

from . import syscalls
from .bounded import read_at_most

_MAX_MOUNTINFO = 16 << 20  # thousands of mounts fit; a runaway table must not eat memory
_MAX_FDINFO = 64 << 10
_ST_FLAGS = syscalls.MS_RDONLY | syscalls.MS_NOSUID | syscalls.MS_NODEV | syscalls.MS_NOEXEC


def _proc_fd(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def clone_mount(src: str | int, attrs: int, *, recursive: bool = False) -> int:
    """Detached copy of the host mount at ``src`` with MOUNT_ATTR_* ``attrs`` already applied
    and private propagation; returns the mount fd for :func:`attach`.

    ``src`` is a trusted host path or, better, an O_PATH fd that the caller opened and fstat-
    checked. Because the flags are set while the copy is still detached, there is no instant in
    which the container could see it writable or with suid binaries active. The fd also works
    after the caller setns()es into the container (SECURITY.md §3.2 item 5).
    """
    flags = syscalls.OPEN_TREE_CLONE | (syscalls.AT_RECURSIVE if recursive else 0)
    if isinstance(src, int):
        mount_fd = syscalls.open_tree(src, "", flags | syscalls.AT_EMPTY_PATH)
    else:
        mount_fd = syscalls.open_tree(syscalls.AT_FDCWD, src, flags)
    try:
        set_attrs(mount_fd, attrs, recursive=recursive, propagation=syscalls.MS_PRIVATE)
    except BaseException:
        os.close(mount_fd)
        raise
    return mount_fd


def set_attrs(mount_fd: int, attrs: int, *, recursive: bool = False, propagation: int = 0) -> None:
    """mount_setattr on the mount that ``mount_fd`` is the root of (detached or not)."""
    flags = syscalls.AT_EMPTY_PATH | (syscalls.AT_RECURSIVE if recursive else 0)
    syscalls.mount_setattr(mount_fd, "", flags, attrs, 0, propagation)


def attach(mount_fd: int, target_fd: int) -> None:
    """Put a detached mount onto the object behind ``target_fd`` (an O_PATH fd from in-root
    resolution). No path is looked up, so nothing can be swapped between check and mount."""
    syscalls.move_mount(
        mount_fd, "", target_fd, "", syscalls.MOVE_MOUNT_F_EMPTY_PATH | syscalls.MOVE_MOUNT_T_EMPTY_PATH
    )


def tmpfs_detached(options: dict[str, str | None], attrs: int) -> int:
    """A fresh tmpfs that is not mounted anywhere yet; returns its mount fd.

    Callers fill it with :func:`inroot.create_file_at` on the mount fd, then
    ``set_attrs(fd, MOUNT_ATTR_RDONLY)`` and :func:`attach`. The container never sees it
    half-written or writable. ``options`` are tmpfs options (``{"mode": "0755", "size": "1m"}``;
    None marks a flag option).
    """
    fs_fd = syscalls.fsopen("tmpfs")
    try:
        for key, value in options.items():
            if value is None:
                syscalls.fsconfig(fs_fd, syscalls.FSCONFIG_SET_FLAG, key)
            else:
                syscalls.fsconfig(fs_fd, syscalls.FSCONFIG_SET_STRING, key, value)
        syscalls.fsconfig(fs_fd, syscalls.FSCONFIG_CMD_CREATE)
        return syscalls.fsmount(fs_fd, attrs)
    finally:
        os.close(fs_fd)


def bind_classic(src_path: str, target_dir_fd: int, target_name: str, flags: int) -> int:
    """Bind ``src_path`` onto ``target_name`` in the verified directory ``target_dir_fd`` with
    the classic mount(2) API; returns an O_PATH fd of the mounted object.

    For kernels without open_tree/mount_setattr. A first MS_BIND ignores MS_RDONLY & co., and a
    remount through the pre-mount fd hits the covered inode (EINVAL), so: mount onto the target
    fd, re-open the name through the same directory fd, require that the re-opened object is the
    source (st_dev/st_ino), then remount through the new fd, make the mount private, and check
    the flags took. Any mismatch unmounts again. ``flags`` are MS_RDONLY/NOSUID/NODEV/NOEXEC.
    """
    if target_name in ("", ".", "..") or "/" in target_name:
        raise ValueError(f"not a single path component: {target_name!r}")
    want = os.stat(src_path)
    target_fd = os.open(target_name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=target_dir_fd)
    try:
        if stat.S_ISLNK(os.fstat(target_fd).st_mode):
            raise OSError(errno.ELOOP, "mount target is a symlink", target_name)
        syscalls.mount(src_path, _proc_fd(target_fd), None, syscalls.MS_BIND)
        mounted = -1
        try:
            mounted = os.open(target_name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=target_dir_fd)
            got = os.fstat(mounted)
            if (got.st_dev, got.st_ino) != (want.st_dev, want.st_ino):
                raise OSError(errno.EAGAIN, "mount target changed while mounting", target_name)
            syscalls.mount(None, _proc_fd(mounted), None, syscalls.MS_REMOUNT | syscalls.MS_BIND | flags)
            syscalls.mount(None, _proc_fd(mounted), None, syscalls.MS_PRIVATE)
            if os.fstatvfs(mounted).f_flag & _ST_FLAGS & flags != flags & _ST_FLAGS:
                raise OSError(errno.EPERM, "mount flags did not take effect", target_name)
        except BaseException:
            # Undo through the fd we mounted on, not the name: if the name was swapped, the
            # bind still sits on the object that target_fd holds, wherever that moved to.
            try:
                detach(target_fd)
            except OSError:
                pass
            if mounted >= 0:
                os.close(mounted)
            raise
    finally:
        os.close(target_fd)
    return mounted


def detach(fd: int) -> None:
    """Lazily unmount the mount whose root ``fd`` is (umount2 MNT_DETACH), for rollback.

    Pass the mount fd given to :func:`attach`, an fd opened on the target after mounting, or
    the target fd the mount was made on (umount2 steps onto the topmost mount of that spot).
    The kernel resolves ``/proc/self/fd/N`` to that object without any lookup in the rootfs.
    """
    syscalls.umount2(_proc_fd(fd), syscalls.MNT_DETACH)


class MountEntry:
    """One /proc/self/mountinfo line, reduced to what mount decisions need."""

    __slots__ = ("mnt_id", "parent_id", "mount_point", "options", "propagation", "fstype")

    def __init__(self, mnt_id, parent_id, mount_point, options, propagation, fstype):
        self.mnt_id: int = mnt_id
        self.parent_id: int = parent_id
        self.mount_point: str = mount_point
        self.options: frozenset[str] = options
        self.propagation: dict[str, int] = propagation  # "shared"/"master"/"propagate_from" → group
        self.fstype: str = fstype

    @property
    def shared(self) -> bool:
        """Mounts made below a shared mount propagate to its peers, possibly the host."""
        return "shared" in self.propagation

    def __repr__(self) -> str:
        return f"MountEntry({self.mnt_id}, {self.mount_point!r}, {sorted(self.options)}, {self.propagation})"


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as 3-digit octal escapes."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isascii() and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> dict[int, MountEntry]:
    """Parse mountinfo(5) text; malformed lines are skipped (the kernel writes it, but the
    caller may be handed a truncated read)."""
    entries = {}
    # Lines end at "\n" only: splitlines() would also break at \r, \x1c-\x1e, \x85, \u2028...,
    # which the kernel leaves raw in mount points an image can name.
    for line in text.split("\n"):
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            mnt_id, parent_id = int(fields[0]), int(fields[1])
            fstype = fields[sep + 1]
        except (ValueError, IndexError):
            continue
        propagation = {}
        for tag in fields[6:sep]:
            key, _, group = tag.partition(":")
            propagation[key] = int(group) if group.isascii() and group.isdigit() else 0
        entries[mnt_id] = MountEntry(
            mnt_id, parent_id, _unescape(fields[4]), frozenset(fields[5].split(",")), propagation, fstype
        )
    return entries


def _read_bounded(path: str, limit: int) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data, more = read_at_most(fd, limit)
    finally:
        os.close(fd)
    if more:
        raise OSError(errno.EFBIG, "unexpectedly large", path)
    return data.decode("utf-8", "surrogateescape")


def filesystems_in(text: str) -> frozenset[int]:
    """The device numbers (``st_dev``) of every filesystem mounted somewhere in mountinfo(5)
    ``text`` (field 3, ``major:minor``); malformed lines are skipped."""
    devs = set()
    for line in text.split("\n"):
        fields = line.split(" ", 3)
        major, sep, minor = fields[2].partition(":") if len(fields) > 3 else ("", "", "")
        if sep and major.isascii() and major.isdigit() and minor.isascii() and minor.isdigit():
            devs.add(os.makedev(int(major), int(minor)))
    return frozenset(devs)


def mounted_filesystems() -> frozenset[int]:
    """:func:`filesystems_in` of this process's mount namespace."""
    return filesystems_in(_read_bounded("/proc/self/mountinfo", _MAX_MOUNTINFO))


def mnt_id_of(fd: int) -> int:
    """Mount id of the mount ``fd`` lives on (kernel ≥ 3.15 fdinfo ``mnt_id``).

    The answer holds for as long as ``fd`` stays open: a file keeps the mount it was opened on,
    whatever is later mounted over it or detached from under it. The fd *number* is another
    matter once closed, so callers must not remember answers by number past the close. Read
    with bare os calls (one bounded read; the line comes third): the mount worker asks this
    for every target, and a buffered file object doubled the cost."""
    info = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(info, _MAX_FDINFO)
    finally:
        os.close(info)
    for line in data.split(b"\n"):
        key, _, value = line.partition(b":")
        if key == b"mnt_id" and value.strip().isdigit():
            return int(value)
    raise OSError(errno.ENOTSUP, "no mnt_id in fdinfo", fd)


def mount_info_of(fd: int) -> MountEntry:
    """The mountinfo entry of the mount holding ``fd`` in the caller's mount namespace, so a
    caller can refuse (or first make private) a target whose mount is ``shared``. Raises
    FileNotFoundError for a detached mount, which has no entry."""
    mnt_id = mnt_id_of(fd)
    entry = parse_mountinfo(_read_bounded("/proc/self/mountinfo", _MAX_MOUNTINFO)).get(mnt_id)
    if entry is None:
        raise FileNotFoundError(errno.ENOENT, f"mount {mnt_id} is not in this namespace's mountinfo")
    return entry


class MountTable:
    """This namespace's mountinfo for one run of mounts: parsed once, then looked up by mount
    id, and read again only when asked about a mount it has not seen or when the namespace
    reports that its mounts changed.

    Reading and parsing all of /proc/self/mountinfo for every target cost the mount worker
    about half of its time. One table per run is enough because of who can change what while
    a prestart hook's worker is placing mounts:

    * The propagation of a mount (the ``shared`` that decides whether a mount below it leaks
      to the host) changes only when a privileged process asks for it on that mount, and
      changing it sends no notice anyone could watch for. Inside this namespace nobody but
      our worker runs: the container's init is the runtime's own code, parked on its exec
      fifo until the hooks are done, and no user process exists yet. From outside only the
      host's root could reach the mount (through /proc/PID/root, where the kernel lets it), and
      the host is not what this check guards against. So an entry read at the start of the
      run still describes its mount at the end.
    * Our own attaches add entries and change none: the new mounts are private, their ids are
      in no table yet (a lookup of a target on one misses and reads again), and they never
      go below a shared mount (the caller refuses that first), so nothing propagates back
      into entries we hold. :meth:`changed_by_us` swallows the change notice each causes.
    * Mounts can still come and go from outside through propagation (the host mounting in a
      directory the container holds as a slave, or unmounting there), and mount ids are
      reused: an unmounted mount's id can be given to the next new mount. Such changes raise
      the namespace's event counter, which poll() on the open mountinfo reports (POLLPRI), so
      every lookup checks for it and re-reads. The one gap is the few microseconds between our
      own attach and :meth:`changed_by_us`; a stale entry would need a mount to leave and
      another to take its id both inside that gap.

    Never keep a table beyond one run: outside a prestart hook the first point does not hold.
    Open it after entering the namespace it is to describe; /proc/self/mountinfo is bound to
    the opener's namespace at open time.
    """

    def __init__(self):
        self._fd = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._events = select.poll()
            self._events.register(self._fd, select.POLLPRI)
            self._entries = self._read()
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        os.close(self._fd)

    def entry_of(self, fd: int) -> MountEntry:
        """The entry of the mount holding ``fd``; FileNotFoundError for a detached mount."""
        mnt_id = mnt_id_of(fd)
        if self._changed() or mnt_id not in self._entries:
            self._entries = self._read()
        entry = self._entries.get(mnt_id)
        if entry is None:
            raise FileNotFoundError(errno.ENOENT, f"mount {mnt_id} is not in this namespace's mountinfo")
        return entry

    def changed_by_us(self) -> None:
        """Call right after our own attach: consume the change notice it raised, so that only a
        change made by someone else makes the next lookup read the table again."""
        self._changed()

    def _changed(self) -> bool:
        return bool(self._events.poll(0))   # reading the notice also clears it

    def _read(self) -> dict[int, MountEntry]:
        os.lseek(self._fd, 0, os.SEEK_SET)
        chunks, size = [], 0
        while chunk := os.read(self._fd, 1 << 16):
            size += len(chunk)
            if size > _MAX_MOUNTINFO:
                raise OSError(errno.EFBIG, "unexpectedly large", "/proc/self/mountinfo")
            chunks.append(chunk)
        return parse_mountinfo(b"".join(chunks).decode("utf-8", "surrogateescape"))
