"""The program the ldconfig sandbox runs: the host's static ldconfig, copied into a sealed memfd.

Why a copy: nothing from the image is ever executed, and nothing in the container can reach or
modify the host binary through the running process (CVE-2019-5736, CVE-2024-0135). The copy is
made in the host mount namespace, checked (a static ELF executable: no interpreter that would
be loaded from the rootfs after the pivot) and sealed, so what was checked is what runs.

It is made once per process and kept while the host file's identity is unchanged
(:func:`prepare`): sealed, it cannot be changed by anyone, so a resident server's children can
all run the one copy the server checked.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct

from ..errors import NvcError, escape
from . import ns

MAX_BINARY = 64 << 20      # glibc's static ldconfig is about 1 MiB


# path -> (identity of the host file when copied, sealed memfd, (st_dev, st_ino, st_ctime_ns) of
# the memfd once sealed). Per process; a forked child inherits both the entries and the fds.
_programs: dict[str, tuple[tuple, int, tuple[int, int, int]]] = {}
_MAX_PROGRAMS = 8
_cap_last: int | None = None

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_F_SEAL_EXEC = 0x20  # Linux >= 6.3: the exec bits cannot be changed either
_EXE_MODE = 0o555    # any uid may run it (the sandbox may run as the rootfs's owner)


def prepare(program: str = "/sbin/ldconfig") -> None:
    """Copy and check the host's ldconfig now rather than on the first container.

    For a resident process that forks per request (``nvcontainer serve``): the children
    inherit the sealed copy, so each run costs one ``stat`` of the host file instead of
    reading, checking and copying about 1 MiB. Calling it again costs as little and makes a
    new copy only if the host file changed. Raises ``NvcError`` like a run would.
    """
    program_fd(program)
    cap_last_cap()
    ns.load()


def _identity(st: os.stat_result) -> tuple:
    """What changes whenever the file's content can have: replacing it changes the inode,
    writing it in place changes mtime (and ctime, which nobody can set back)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def program_fd(program: str) -> tuple[int, bool]:
    """The sealed memfd to run for ``program``, made now or kept from an earlier run, and
    whether it is kept (else the caller closes it).

    A kept copy is used only while ``program`` still stats the same and the fd still is that
    memfd, fully sealed, its metadata untouched since: a caller may have reused the number, and
    a sandboxed uid-0 ldconfig owns its memfd enough to chmod it (the exec bits only where
    ``F_SEAL_EXEC`` is missing) or give it an ACL. The seals keep its content; any such change
    moves its ctime.
    """
    kept = _programs.pop(program, None)
    if kept is not None:
        identity, fd, memfd_id = kept
        state = _kept_state(fd, memfd_id)
        if state == "intact":
            try:
                unchanged = _identity(os.stat(program)) == identity
            except OSError:
                unchanged = False
            if unchanged:
                _programs[program] = kept
                return fd, True
        if state != "gone":
            os.close(fd)
    fd, identity = _sealed_copy(program)
    if identity is None:
        return fd, False
    if len(_programs) >= _MAX_PROGRAMS:
        for _, old, old_id in _programs.values():
            if _kept_state(old, old_id) != "gone":
                os.close(old)
        _programs.clear()
    st = os.fstat(fd)
    _programs[program] = (identity, fd, (st.st_dev, st.st_ino, st.st_ctime_ns))
    return fd, True


def _kept_state(fd: int, memfd_id: tuple[int, int, int]) -> str:
    """``intact``: still the kept memfd, all seals on, mode and ctime as they were; ``spoiled``:
    the kept memfd, changed since; ``gone``: the number names another file now, which is not
    ours to close."""
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != memfd_id[:2]:
            return "gone"
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS == _SEALS
    except OSError:
        return "gone"
    untouched = st.st_ctime_ns == memfd_id[2] and stat.S_IMODE(st.st_mode) == _EXE_MODE
    return "intact" if sealed and untouched else "spoiled"


def _sealed_copy(program: str) -> tuple[int, tuple | None]:
    """A memfd holding ``program``, sealed so nobody can change it after the check, and the
    host file's identity (``None`` if the file changed while it was copied: not kept).

    The bytes go from file to memfd in the kernel (``sendfile``); the ELF check then reads the
    sealed copy, which is exactly what will run.
    """
    try:
        src = os.open(program, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise NvcError("ldcache", f"cannot open {escape(program)}: {exc.strerror}") from None
    fd = -1
    try:
        before = os.fstat(src)
        if not stat.S_ISREG(before.st_mode):
            raise NvcError("ldcache", f"{escape(program)} is not a regular file")
        if before.st_size > MAX_BINARY:
            raise NvcError("ldcache", f"{escape(program)} is larger than {MAX_BINARY} bytes")
        fd = _memfd("ldconfig")
        try:
            size = _copy(src, fd)
            after = os.fstat(src)
        except OSError as exc:
            raise NvcError("ldcache", f"cannot copy {escape(program)}: {exc.strerror}") from None
        if size > MAX_BINARY:
            raise NvcError("ldcache", f"{escape(program)} is larger than {MAX_BINARY} bytes")
        os.fchmod(fd, _EXE_MODE)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | _F_SEAL_EXEC)
        except OSError:  # EINVAL before 6.3
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        problem = _static_elf_fd_problem(fd, size)
        if problem:
            raise NvcError("ldcache", f"{escape(program)}: {problem}")
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        os.close(src)
    unchanged = _identity(before) == _identity(after) and after.st_size == size
    return fd, _identity(after) if unchanged else None


def _copy(src: int, dst: int) -> int:
    """Copy up to ``MAX_BINARY + 1`` bytes (one more says "too large"); returns the count."""
    done = 0
    try:
        while done <= MAX_BINARY and (n := os.sendfile(dst, src, done, MAX_BINARY + 1 - done)):
            done += n
        return done
    except OSError as exc:
        if done or exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    # A filesystem without splice support: through user space.
    while done <= MAX_BINARY and (chunk := os.pread(src, min(1 << 20, MAX_BINARY + 1 - done), done)):
        view = memoryview(chunk)
        while view:
            view = view[os.pwrite(dst, view, done + len(chunk) - len(view)):]
        done += len(chunk)
    return done


def _static_elf_fd_problem(fd: int, size: int) -> str | None:
    """:func:`static_elf_problem` on the memfd's content, mapped rather than read: only the
    header pages are touched."""
    if size < 64:
        return "not an ELF file"
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
        return static_elf_problem(data)


_MFD_EXEC = 0x10  # Linux >= 6.3; needed where vm.memfd_noexec=1 makes memfds non-executable


def _memfd(name: str) -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        return os.memfd_create(name, flags | _MFD_EXEC)
    except OSError:  # EINVAL before 6.3, where every memfd is executable anyway
        return os.memfd_create(name, flags)


def cap_last_cap() -> int:
    """Highest capability this kernel knows; may exceed what python-prctl was built with.
    Fixed while the kernel runs, so read once per process."""
    global _cap_last
    if _cap_last is None:
        try:
            with open("/proc/sys/kernel/cap_last_cap", "rb") as fh:
                value = fh.read(16).strip()
        except OSError as exc:
            raise NvcError("ldcache", f"cannot read /proc/sys/kernel/cap_last_cap: {exc.strerror}") from None
        if not value.isdigit() or not 0 < int(value) < 64:
            raise NvcError("ldcache", f"unexpected /proc/sys/kernel/cap_last_cap: {escape(value)}")
        _cap_last = int(value)
    return _cap_last




def static_elf_problem(data: bytes) -> str | None:
    """Why ``data`` is not a static ELF executable, or ``None`` if it is one.

    Static means no ``PT_INTERP``: a dynamic program would load its interpreter and libraries
    by path from the container's rootfs after pivot_root, i.e. run code from the image.
    """
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "not an ELF file"
    elf_class, order = data[4], data[5]
    if elf_class not in (1, 2) or order not in (1, 2):
        return "unknown ELF class or byte order"
    end = "<" if order == 1 else ">"
    if elf_class == 2:
        e_type, = struct.unpack_from(end + "H", data, 16)
        e_phoff, = struct.unpack_from(end + "Q", data, 32)
        e_phentsize, e_phnum = struct.unpack_from(end + "HH", data, 54)
        entry_fmt, min_entry = end + "I", 56
    else:
        e_type, = struct.unpack_from(end + "H", data, 16)
        e_phoff, = struct.unpack_from(end + "I", data, 28)
        e_phentsize, e_phnum = struct.unpack_from(end + "HH", data, 42)
        entry_fmt, min_entry = end + "I", 32
    if e_type not in (2, 3):  # ET_EXEC, ET_DYN (static-pie)
        return "not an executable"
    if e_phentsize < min_entry or e_phnum == 0 or e_phoff + e_phnum * e_phentsize > len(data):
        return "damaged program header table"
    types = [struct.unpack_from(entry_fmt, data, e_phoff + i * e_phentsize)[0] for i in range(e_phnum)]
    if 3 in types:  # PT_INTERP
        return "not a static executable (it has a program interpreter)"
    if 1 not in types:  # PT_LOAD
        return "has nothing to load"
    return None
