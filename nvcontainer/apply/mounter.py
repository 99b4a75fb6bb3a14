"""Performing a plan's filesystem actions: sources prepared on the host, targets in the container.

Two halves, one per side of the namespace boundary:

* :func:`prepare` runs in the host process, in the host's mount namespace. It opens every
  source (``O_PATH|O_NOFOLLOW``), checks its type (and ``st_rdev`` for devices), and turns it
  into a *detached* mount with its final flags already set (``open_tree`` + ``mount_setattr``);
  tmpfs payloads are built detached, filled, and made read-only. Nothing is visible anywhere yet.
* :func:`place` runs in a forked worker that has entered the container's mount namespace. It
  resolves each target inside the rootfs (never following the image's symlinks out of it),
  creates placeholders relative to verified directory fds, and attaches the detached mounts
  onto target fds (``move_mount``). No path string from the rootfs ever reaches a mount call.
  If anything fails, what this run attached is detached again and placeholders it created are
  removed, and the error names the step and the path.
"""

from __future__ import annotations

import errno
import os
import stat

from ..errors import NvcError, escape
from ..fs import inroot, mounts, syscalls
from ..plan.model import Plan

_ATTRS = {
    "ro": syscalls.MOUNT_ATTR_RDONLY,
    "nosuid": syscalls.MOUNT_ATTR_NOSUID,
    "nodev": syscalls.MOUNT_ATTR_NODEV,
    "noexec": syscalls.MOUNT_ATTR_NOEXEC,
}
_KIND_CHECK = {"file": stat.S_ISREG, "dir": stat.S_ISDIR, "socket": stat.S_ISSOCK, "device": stat.S_ISCHR}
# Filesystems a /proc/... target may be on: procfs itself, or a tmpfs standing in for
# /proc/driver where no driver is loaded (the test machines).
_PROC_TARGET_FS = (syscalls.PROC_SUPER_MAGIC, syscalls.TMPFS_MAGIC)


def attrs_of(options) -> int:
    value = 0
    for opt in options:
        value |= _ATTRS[opt]
    return value


def prepare(plan: Plan) -> tuple[list[dict], list[int]]:
    """Detached mounts for every mount, device and tmpfs of the plan, in application order.

    Returns the actions for :func:`place` (JSON-able, holding fd numbers) and the fds the
    worker must inherit. The caller closes the fds.
    """
    actions: list[dict] = []
    fds: list[int] = []
    try:
        for t in plan.tmpfs:
            fd = _tmpfs(t)
            fds.append(fd)
            actions.append({"op": "mount", "fd": fd, "target": t.target, "kind": "dir", "step": "tmpfs"})
        for m in plan.mounts:
            fd = _clone(m.source, m.kind, attrs_of(m.options))
            fds.append(fd)
            actions.append({"op": "mount", "fd": fd, "target": m.target, "kind": m.kind, "step": "mount"})
        if plan.devbind:
            for d in plan.devices:
                fd = _clone(d.source, "device", attrs_of(("ro", "nosuid", "noexec")), rdev=os.makedev(d.major, d.minor))
                fds.append(fd)
                actions.append({"op": "mount", "fd": fd, "target": d.path, "kind": "file", "step": "device"})
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    actions += [{"op": "symlink", "target": s.link, "link": s.target} for s in plan.symlinks]
    actions += [{"op": "file", "target": f.path, "content": f.content, "mode": f.mode} for f in plan.files]
    return actions, fds


def _clone(source: str, kind: str, attrs: int, rdev: int | None = None) -> int:
    try:
        fd = os.open(source, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise NvcError("mount", f"stat failed: {escape(source)}: {exc.strerror.lower()}") from None
    try:
        st = os.fstat(fd)
        if not _KIND_CHECK[kind](st.st_mode):
            raise NvcError("mount", f"unexpected source file mode: {escape(source)}")
        if rdev is not None and st.st_rdev != rdev:
            raise NvcError("mount", f"invalid device node: {escape(source)}: expected "
                           f"{os.major(rdev)}:{os.minor(rdev)}, found {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
        try:
            return mounts.clone_mount(fd, attrs)
        except OSError as exc:
            raise NvcError("mount", f"cannot clone {escape(source)}: {exc.strerror.lower()}") from None
    finally:
        os.close(fd)


def _tmpfs(t) -> int:
    """Build the tmpfs detached: directories and files first, read-only before anyone sees it."""
    base = attrs_of(o for o in t.options if o != "ro")
    try:
        fd = mounts.tmpfs_detached({"mode": f"{t.mode:04o}", "size": "4m", "nr_inodes": "4096"}, base)
    except OSError as exc:
        raise NvcError("mount", f"cannot create tmpfs for {escape(t.target)}: {exc.strerror.lower()}") from None
    try:
        for d in t.dirs:
            os.mkdir(d, 0o555, dir_fd=fd)
        for f in t.files:
            rel = f.path[len(t.target) + 1:]
            parent, _, name = rel.rpartition("/")
            pfd = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                wfd = inroot.create_file_at(pfd, name, f.mode)
            finally:
                os.close(pfd)
            try:
                _write_all(wfd, f.content.encode())
            finally:
                os.close(wfd)
        if "ro" in t.options:
            mounts.set_attrs(fd, base | syscalls.MOUNT_ATTR_RDONLY)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# --- the worker side, inside the container's mount namespace ---------------------------------


class _Undo:
    def __init__(self):
        self.mounted: list[int] = []                 # target fds, for detach
        self.created: list[tuple[int, str, bool]] = []  # (dir fd, name, is_dir)
        self.fds: list[int] = []

    def created_entry(self, dfd: int, name: str, is_dir: bool) -> None:
        self.created.append((dfd, name, is_dir))

    def rollback(self) -> None:
        for fd in reversed(self.mounted):
            try:
                mounts.detach(fd)
            except OSError:
                pass
        for dfd, name, is_dir in reversed(self.created):
            try:
                if is_dir:
                    os.rmdir(name, dir_fd=dfd)
                elif os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size == 0:
                    os.unlink(name, dir_fd=dfd)
            except OSError:
                pass

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass


class _HostGuard:
    """Where :func:`place` may create or remove directory entries: in the rootfs's own mount,
    or on a filesystem the host does not have mounted (the runtime's fresh tmpfs for /dev, the
    container's procfs). A directory of a host filesystem mounted into the container (a
    volume, a host directory bound over a target's parent) belongs to the host: a placeholder,
    SONAME link or drop-in made there is made on the host (CVE-2024-0133), so that is refused.
    Mounting over an entry that already exists there changes nothing on the host and stays
    allowed.
    """

    def __init__(self, root: int, host_filesystems: frozenset[int]):
        self.root_mount = mounts.mnt_id_of(root)
        self.host_filesystems = host_filesystems

    def check(self, dfd: int) -> None:
        if mounts.mnt_id_of(dfd) == self.root_mount:
            return
        if os.fstat(dfd).st_dev in self.host_filesystems:
            raise OSError(errno.EXDEV, "the directory is a host filesystem mounted into the container: "
                                       "refusing to create or remove entries in it")


class _Parents:
    """The directories that this run's targets go into, resolved (and created) once per path
    and reused by the actions that follow: most of a plan lands in two or three directories,
    and walking the same path from the root for every library cost the worker a third of its
    time.

    Reusing a directory fd is right while the path still leads to it. During a prestart hook
    the container runs no code yet, so what changes the rootfs's entries and mounts is our own
    worker. Our changes that can make a path lead elsewhere are attaching a directory mount
    (it covers what the path used to reach) and removing or replacing an existing entry (it
    may have been a symlink the path went through); each of those calls :meth:`forget`.
    Creating an entry where none was, and attaching a file mount onto a file placeholder,
    change no path that already resolved: a resolved path only goes through entries that
    exist, as directories or symlinks. Another start from the same rootfs makes the same
    entries as we do; should it move or remove a directory we hold, the fd still names a
    directory inside the rootfs (nothing resolves a path through it again) and still passes
    the guard below, so the worst outcome is a failed run, never an entry outside the rootfs.

    The guard's verdict is kept per held fd: whether a directory may receive new entries
    depends on the mount the fd is on and its filesystem, and both are fixed for the life of
    the fd (an fd keeps the mount it was opened on even if something is mounted over it).
    Every held fd stays open until the run ends, so its number cannot be reused meanwhile.
    The walker's own intermediate fds are closed after each walk; they are checked every time.
    """

    def __init__(self, root: int, undo: _Undo, guard: _HostGuard):
        self.root = root
        self.undo = undo
        self.guard = guard
        self._by_path: dict[str, int] = {}
        self._allowed: set[int] = set()   # held fds the guard let us create entries in

    def of(self, target: str) -> tuple[int, str]:
        """The verified parent directory fd of ``target`` and the target's own name."""
        parent, _, name = target.rpartition("/")
        if not name or name in (".", ".."):
            raise OSError(22, "invalid target name")
        parent = parent or "/"
        dfd = self._by_path.get(parent)
        if dfd is None:
            dfd = inroot.mkdirs_in_root(self.root, parent, before_mkdir=self.guard.check)
            self.undo.fds.append(dfd)
            self._by_path[parent] = dfd
        return dfd, name

    def check(self, dfd: int) -> None:
        """The guard's check before creating or removing an entry in ``dfd``, one of ours."""
        if dfd not in self._allowed:
            self.guard.check(dfd)
            self._allowed.add(dfd)

    def forget(self) -> None:
        """Something that a path may go through changed: resolve every parent afresh."""
        self._by_path.clear()


def place(mntns_fd: int, rootfs: str, actions: list[dict], owner: tuple[int, int] = (0, 0)) -> dict:
    """Worker body: enter the container's mount namespace and perform ``actions`` in order.

    Entries we create (placeholders, links, files) belong to the container's ``owner``: the
    worker creates them with its filesystem identity switched to it, as upstream does, so a
    user-namespaced container sees them as its own.
    """
    from .ns import set_fs_identity, setns_mount

    # Which filesystems the host has mounted, read while still in its mount namespace.
    host_filesystems = mounts.mounted_filesystems()
    setns_mount(mntns_fd)
    # Re-open the rootfs after entering: an fd opened before would walk the host's mounts.
    try:
        root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise NvcError("mount", f"cannot open rootfs {escape(rootfs)}: {exc.strerror.lower()}") from None
    undo = _Undo()
    undo.fds.append(root)
    if tuple(owner) != (0, 0):
        try:
            set_fs_identity(*owner)
        except OSError as exc:
            os.close(root)
            raise NvcError("mount", f"cannot create entries as the container's owner: {exc.strerror}") from None
    warnings: list[str] = []
    done = 0
    table = None
    try:
        parents = _Parents(root, undo, _HostGuard(root, host_filesystems))
        table = mounts.MountTable()   # this run's only: its docstring says why that is enough
        for action in actions:
            op = action["op"]
            try:
                if op == "mount":
                    _mount(parents, action, undo, table)
                elif op == "symlink":
                    _symlink(parents, action, warnings)
                elif op == "file":
                    _file(parents, action)
            except OSError as exc:
                raise NvcError("mount", f"{action.get('step', op)} {escape(action['target'])}: "
                               f"{(exc.strerror or str(exc)).lower()}") from None
            done += 1
    except BaseException:
        undo.rollback()
        raise
    finally:
        undo.close()
        if table is not None:
            table.close()
    return {"done": done, "warnings": warnings}


def _mount(parents: _Parents, action: dict, undo: _Undo, table: mounts.MountTable) -> None:
    target, kind = action["target"], action["kind"]
    dfd, name = parents.of(target)
    tfd = _placeholder(dfd, name, kind, undo, parents)
    undo.fds.append(tfd)
    if target.startswith("/proc/") and syscalls.fstatfs_type(tfd) not in _PROC_TARGET_FS:
        raise NvcError("mount", f"{action['step']} {escape(target)}: not on procfs: refusing")
    entry = table.entry_of(tfd)
    if entry.shared:
        # A mount under a shared mount would propagate to its peers, possibly the host's.
        raise NvcError("mount", f"{action['step']} {escape(target)}: {escape(entry.mount_point)} has shared "
                       "propagation: refusing to mount where it would leak to the host")
    mounts.attach(action["fd"], tfd)
    table.changed_by_us()
    undo.mounted.append(tfd)
    if kind == "dir":
        parents.forget()   # the new mount covers what paths through the target reached


def _placeholder(dfd: int, name: str, kind: str, undo: _Undo, parents: _Parents) -> int:
    """An O_PATH fd of the mount point, created if missing, of the type the mount needs.

    An existing entry of the wrong type is replaced only when it is not a directory (the image
    may ship its own copy of a driver file, or a symlink in its place: toolkit#371); we unlink
    the entry itself, never what it points to.
    """
    want_dir = kind == "dir"
    st = inroot.inspect_at(dfd, name)
    if st is not None and stat.S_ISDIR(st.st_mode) != want_dir:
        if stat.S_ISDIR(st.st_mode):
            raise OSError(21, "a directory is in the way")
        if want_dir:
            raise OSError(20, "a non-directory is in the way")
    if st is not None and not want_dir and not stat.S_ISREG(st.st_mode):
        parents.check(dfd)
        parents.forget()   # a symlink that some parent path went through may be going away
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass   # another run on the same rootfs got there first
        st = None
    if st is None:
        parents.check(dfd)
        try:
            if want_dir:
                os.mkdir(name, 0o755, dir_fd=dfd)
            else:
                os.close(inroot.create_file_at(dfd, name, 0o644))
            undo.created_entry(dfd, name, want_dir)
        except FileExistsError:
            # Another container starting from the same rootfs created it since we looked: the
            # type check below decides whether it will do, and it is not ours to remove.
            pass
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if want_dir else 0), dir_fd=dfd)
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode) != want_dir or (not want_dir and not stat.S_ISREG(st.st_mode)):
        os.close(fd)
        raise OSError(17, "changed while being prepared")
    return fd


def _symlink(parents: _Parents, action: dict, warnings: list[str]) -> None:
    dfd, name = parents.of(action["target"])
    for _attempt in range(3):   # runs sharing a rootfs may create or replace it concurrently
        st = inroot.inspect_at(dfd, name)
        if st is not None:
            if not stat.S_ISLNK(st.st_mode):
                warnings.append(f"{action['target']} exists and is not a symlink: left as it is")
                return
            if os.readlink(name, dir_fd=dfd) == action["link"]:
                return
            parents.check(dfd)
            parents.forget()   # some parent path may have gone through the link we replace
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
        parents.check(dfd)
        try:
            inroot.symlink_at(dfd, name, action["link"])
            return
        except FileExistsError:
            continue
    raise OSError(17, "keeps changing while being replaced")


def _file(parents: _Parents, action: dict) -> None:
    """Write a small file atomically: a fresh temporary in the same verified directory, then a
    rename over the name (rename replaces a symlink entry itself, never its target). With
    ``keep``, only where the name is free: whatever the image has there, a dangling link
    included, stays as it is (``RENAME_NOREPLACE``, never a check-then-write)."""
    import secrets   # only plans with files need it; it costs a start without them ~8 ms

    dfd, name = parents.of(action["target"])
    parents.check(dfd)
    parents.forget()   # the rename may replace a symlink that some parent path went through
    tmp = f".nvcontainer-{secrets.token_hex(8)}"
    fd = inroot.create_file_at(dfd, tmp, action["mode"])
    try:
        _write_all(fd, action["content"].encode())
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dfd)
        raise
    os.close(fd)
    try:
        if action.get("keep"):
            syscalls.renameat2(dfd, tmp, dfd, name, syscalls.RENAME_NOREPLACE)
        else:
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as exc:
        os.unlink(tmp, dir_fd=dfd)
        if not (action.get("keep") and exc.errno == errno.EEXIST):
            raise
