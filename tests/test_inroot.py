"""In-root resolution and creation against hostile trees.

Every resolution test runs twice: with openat2(2) and with the openat(2) walker forced, and
both must give the same answer. A sentinel directory next to the root must never change.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvcontainer.fs import inroot, syscalls
from nvcontainer.fs.inroot import create_file_at, inspect_at, mkdirs_in_root, mknod_at, open_in_root, symlink_at
from tests.fixtures.namespaces import run_in_private_ns

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


@pytest.fixture(params=["openat2", "walker"])
def mode(request, monkeypatch):
    if request.param == "openat2":
        if not syscalls.openat2_available():
            pytest.skip("kernel has no openat2")
    monkeypatch.setattr(syscalls, "FORCE_NO_OPENAT2", request.param == "walker")
    return request.param


def snapshot(top: str) -> list:
    """Everything observable about a directory tree without following links."""
    out = [("<top>", os.lstat(top).st_mtime_ns)]
    for dirpath, dirnames, filenames in os.walk(top):
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            s = os.lstat(full)
            out.append((os.path.relpath(full, top), stat.S_IFMT(s.st_mode), s.st_size, s.st_mtime_ns))
    return sorted(out)


class Tree:
    """root/ is the hostile image, outside/ is the host the image must never reach."""

    def __init__(self, base):
        self.base = str(base)
        self.root = os.path.join(self.base, "root")
        self.outside = os.path.join(self.base, "outside")
        os.makedirs(os.path.join(self.root, "etc"))
        os.makedirs(os.path.join(self.outside, "etc"))
        for top, text in ((self.root, "in-root\n"), (self.outside, "HOST\n")):
            with open(os.path.join(top, "etc", "passwd"), "w") as fh:
                fh.write(text)
        with open(os.path.join(self.outside, "secret"), "w") as fh:
            fh.write("HOST\n")
        links = {
            "abs_root": "/",
            "abs_outside": self.outside,
            "rel_escape": "../../../../../../../../..",
            "rel_outside": "../outside",
            "dotdot_chain": "etc/../../../outside",
            "dangling": "nowhere/at/all",
            "loop1": "loop2",
            "loop2": "loop1",
            "dirlink": "etc",
            "filelink": "etc/passwd",
            "self_root": "/proc/self/root",
        }
        for name, target in links.items():
            os.symlink(target, os.path.join(self.root, name))
        self.root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY)
        self.before = snapshot(self.outside)

    def chain(self, length: int, target: str) -> str:
        """c0 -> c1 -> ... -> c{length-1} -> target: following c0 takes ``length`` links."""
        for i in range(length):
            dest = target if i == length - 1 else f"c{i + 1}"
            os.symlink(dest, os.path.join(self.root, f"c{i}"))
        return "c0"

    def ino(self, rel: str) -> tuple[int, int]:
        s = os.lstat(os.path.join(self.root, rel))
        return s.st_dev, s.st_ino

    def close(self) -> None:
        os.close(self.root_fd)
        assert snapshot(self.outside) == self.before, "something outside the root changed"


@pytest.fixture
def tree(tmp_path):
    t = Tree(tmp_path)
    yield t
    t.close()


def ident(fd: int) -> tuple[int, int]:
    try:
        s = os.fstat(fd)
        return s.st_dev, s.st_ino
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("mode")
class TestOpenInRoot:
    @pytest.mark.parametrize(
        "path",
        [
            "etc/passwd",
            "/etc/passwd",
            "../../../etc/passwd",
            "abs_root/etc/passwd",
            "rel_escape/etc/passwd",
            "dirlink/passwd",
            "filelink",
            "etc/../etc/./passwd",
            "dirlink/../dirlink/../../etc/passwd",
        ],
    )
    def test_escapes_land_on_the_root_copy(self, tree, path):
        assert ident(open_in_root(tree.root_fd, path)) == tree.ino("etc/passwd")

    @pytest.mark.parametrize("path", ["abs_outside/secret", "rel_outside/secret", "dotdot_chain/secret"])
    def test_links_to_the_host_are_rerooted(self, tree, path):
        with pytest.raises(FileNotFoundError):
            open_in_root(tree.root_fd, path)
        # once the image supplies the names itself, those in-root copies are what we get
        decoy_dir = os.path.join(tree.root, tree.outside.lstrip("/"))
        os.makedirs(decoy_dir)
        os.makedirs(os.path.join(tree.root, "outside"))
        for d in (decoy_dir, os.path.join(tree.root, "outside")):
            with open(os.path.join(d, "secret"), "w") as fh:
                fh.write("decoy")
        fd = open_in_root(tree.root_fd, path, os.O_RDONLY)
        with os.fdopen(fd) as fh:
            assert fh.read() == "decoy"

    def test_read_flags_give_a_readable_fd(self, tree):
        fd = open_in_root(tree.root_fd, "abs_root/filelink", os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd) as fh:
            assert fh.read() == "in-root\n"

    def test_fds_are_close_on_exec(self, tree):
        fd = open_in_root(tree.root_fd, "etc/passwd", os.O_RDONLY)
        try:
            assert not os.get_inheritable(fd)
        finally:
            os.close(fd)

    @pytest.mark.parametrize("path", ["", "/", ".", "..", "/../..", "abs_root", "rel_escape/"])
    def test_root_itself(self, tree, path):
        if path == "":
            with pytest.raises(FileNotFoundError):
                open_in_root(tree.root_fd, path)
            return
        assert ident(open_in_root(tree.root_fd, path)) == ident(os.dup(tree.root_fd))
        assert ident(open_in_root(tree.root_fd, path, os.O_RDONLY | os.O_DIRECTORY)) == ident(os.dup(tree.root_fd))

    def test_dangling_link(self, tree):
        with pytest.raises(FileNotFoundError):
            open_in_root(tree.root_fd, "dangling")
        fd = open_in_root(tree.root_fd, "dangling", follow_last=False)
        try:
            assert stat.S_ISLNK(os.fstat(fd).st_mode)
            assert os.readlink("", dir_fd=fd) == "nowhere/at/all"
        finally:
            os.close(fd)

    def test_nofollow_last_still_follows_parents(self, tree):
        fd = open_in_root(tree.root_fd, "abs_root/dirlink", follow_last=False)
        assert ident(fd) == tree.ino("dirlink")
        assert ident(open_in_root(tree.root_fd, "dirlink/passwd", follow_last=False)) == tree.ino("etc/passwd")
        # a trailing slash means "follow and be a directory", as for the kernel
        assert ident(open_in_root(tree.root_fd, "dirlink/", follow_last=False)) == tree.ino("etc")

    def test_nofollow_last_with_real_access_is_eloop(self, tree):
        with pytest.raises(OSError) as exc:
            open_in_root(tree.root_fd, "filelink", os.O_RDONLY, follow_last=False)
        assert exc.value.errno == errno.ELOOP
        with pytest.raises(OSError) as exc:
            open_in_root(tree.root_fd, "filelink", os.O_RDONLY | os.O_NOFOLLOW)
        assert exc.value.errno == errno.ELOOP

    def test_loop(self, tree):
        with pytest.raises(OSError) as exc:
            open_in_root(tree.root_fd, "loop1/x")
        assert exc.value.errno == errno.ELOOP

    def test_forty_links_are_fine_forty_one_are_not(self, tree):
        os.makedirs(os.path.join(tree.root, "long"))
        start = tree.chain(40, "/etc/passwd")
        assert ident(open_in_root(tree.root_fd, start)) == tree.ino("etc/passwd")
        os.symlink("/" + start, os.path.join(tree.root, "long", "one_more"))
        with pytest.raises(OSError) as exc:
            open_in_root(tree.root_fd, "long/one_more")
        assert exc.value.errno == errno.ELOOP

    @pytest.mark.parametrize("path", ["etc/passwd/x", "etc/passwd/", "filelink/.."])
    def test_file_where_a_directory_is_expected(self, tree, path):
        with pytest.raises(NotADirectoryError):
            open_in_root(tree.root_fd, path)

    def test_o_directory_on_a_file(self, tree):
        with pytest.raises(NotADirectoryError):
            open_in_root(tree.root_fd, "filelink", os.O_PATH | os.O_DIRECTORY)

    def test_creation_flags_are_refused(self, tree):
        with pytest.raises(ValueError):
            open_in_root(tree.root_fd, "new", os.O_WRONLY | os.O_CREAT)

    def test_does_not_open_fifos_it_merely_resolves(self, tree):
        os.mkfifo(os.path.join(tree.root, "fifo"))
        fd = open_in_root(tree.root_fd, "fifo")  # O_PATH: would block forever if really opened
        try:
            assert stat.S_ISFIFO(os.fstat(fd).st_mode)
        finally:
            os.close(fd)

    @needs_root
    def test_proc_magic_links_are_refused(self, tree):
        """With a real procfs inside the root, /proc/self/root is the host's "/" unless the
        resolver refuses magic links."""
        os.makedirs(os.path.join(tree.root, "proc"))
        os.symlink("/proc/self/root/etc", os.path.join(tree.root, "etc_via_proc"))
        os.symlink("/proc/self/cwd", os.path.join(tree.root, "cwd_via_proc"))
        root, outside = tree.root, tree.outside

        def body():
            syscalls.mount("proc", os.path.join(root, "proc"), "proc", 0)
            # an fd opened before unshare() still walks the old namespace's mounts
            root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
            host_fd = os.open(outside, os.O_PATH | os.O_DIRECTORY)
            os.symlink(f"/proc/self/fd/{host_fd}", os.path.join(root, "fd_via_proc"))
            os.chdir(outside)
            # the hazard is real: a plain dir_fd-relative open walks straight out to the host
            with open("fd_via_proc/secret", opener=lambda p, f: os.open(p, f, dir_fd=root_fd)) as fh:
                assert fh.read() == "HOST\n"
            for path in (
                "etc_via_proc/passwd",
                "cwd_via_proc/secret",
                "fd_via_proc/secret",
                "proc/self/root/etc/passwd",
                f"proc/{os.getpid()}/root/etc/passwd",
                f"proc/{os.getpid()}/cwd",
                "self_root/etc/passwd",
            ):
                try:
                    fd = open_in_root(root_fd, path)
                except OSError as exc:
                    assert exc.errno == errno.ELOOP, (path, exc)
                else:
                    os.close(fd)
                    raise AssertionError(f"{path} was opened")
            # procfs itself stays usable as a plain tree
            fd = open_in_root(root_fd, "proc/sys/kernel/ostype", os.O_RDONLY)
            assert os.read(fd, 64) == b"Linux\n"

        run_in_private_ns(body)


@pytest.mark.usefixtures("mode")
class TestMkdirs:
    def test_creates_missing_levels(self, tree):
        old = os.umask(0o022)
        try:
            fd = mkdirs_in_root(tree.root_fd, "/a/b/c", 0o750)
        finally:
            os.umask(old)
        try:
            assert inroot.fd_path(fd) == os.path.join(tree.root, "a/b/c")
            assert stat.S_ISDIR(os.fstat(fd).st_mode)
            assert stat.S_IMODE(os.lstat(os.path.join(tree.root, "a/b")).st_mode) == 0o750
        finally:
            os.close(fd)

    def test_existing_directory(self, tree):
        assert ident(mkdirs_in_root(tree.root_fd, "etc")) == tree.ino("etc")

    @pytest.mark.parametrize(
        "path, lands_at",
        [
            ("abs_root/new", "new"),
            ("abs_outside/new", None),  # the host path, re-created inside the root
            ("rel_outside/new", "outside/new"),
            ("dotdot_chain/new", "outside/new"),
            ("rel_escape/../../new", "new"),
            ("dangling/new", "nowhere/at/all/new"),
            ("dirlink/new", "etc/new"),
        ],
    )
    def test_links_are_followed_inside_the_root(self, tree, path, lands_at):
        if lands_at is None:
            lands_at = tree.outside.lstrip("/") + "/new"
        fd = mkdirs_in_root(tree.root_fd, path)
        try:
            assert inroot.fd_path(fd) == os.path.join(tree.root, lands_at)
        finally:
            os.close(fd)

    @pytest.mark.parametrize("path", ["etc/passwd", "etc/passwd/x", "filelink/x"])
    def test_non_directory_in_the_way(self, tree, path):
        with pytest.raises(NotADirectoryError):
            mkdirs_in_root(tree.root_fd, path)

    def test_loop(self, tree):
        with pytest.raises(OSError) as exc:
            mkdirs_in_root(tree.root_fd, "loop1/x")
        assert exc.value.errno == errno.ELOOP

    def test_fifo_in_the_way_is_not_opened(self, tree):
        os.mkfifo(os.path.join(tree.root, "fifo"))
        with pytest.raises(NotADirectoryError):
            mkdirs_in_root(tree.root_fd, "fifo/x")


@pytest.mark.usefixtures("mode")
class TestResolveInRoot:
    @pytest.fixture
    def driver_root(self, tmp_path):
        libdir = tmp_path / "usr/lib/x86_64-linux-gnu"
        libdir.mkdir(parents=True)
        (libdir / "libcuda.so.550.54.14").write_bytes(b"\x7fELF")
        os.symlink("libcuda.so.550.54.14", libdir / "libcuda.so.1")
        os.symlink("usr/lib", tmp_path / "lib")
        os.symlink("/", libdir / "to_slash")
        os.symlink("../../../../../../nonexistent/libfoo.so.2", libdir / "libfoo.so.1")
        return str(tmp_path)

    @pytest.mark.parametrize(
        "path, expected",
        [
            ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14"),
            ("/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14"),
            ("lib/./x86_64-linux-gnu//libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14"),
            ("/usr/lib/x86_64-linux-gnu/to_slash/lib", "/usr/lib"),
            ("/../../usr/lib/../../..", "/"),
            ("", "/"),
            ("/usr/missing/a/b", "/usr/missing/a/b"),
            ("/usr/missing/../lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14"),
            ("/usr/lib/x86_64-linux-gnu/libfoo.so.1", "/nonexistent/libfoo.so.2"),
            ("/usr/lib/x86_64-linux-gnu/to_slash/etc/passwd", "/etc/passwd"),
        ],
    )
    def test_resolves_like_upstream(self, driver_root, path, expected):
        assert inroot.resolve_in_root(driver_root, path) == expected

    def test_too_many_links(self, driver_root):
        for i in range(41):
            os.symlink(f"l{i + 1}", os.path.join(driver_root, f"l{i}"))
        with pytest.raises(OSError) as exc:
            inroot.resolve_in_root(driver_root, "/l0")
        assert exc.value.errno == errno.ELOOP

    def test_file_in_the_way(self, driver_root):
        with pytest.raises(NotADirectoryError):
            inroot.resolve_in_root(driver_root, "/usr/lib/x86_64-linux-gnu/libcuda.so.1/x")

    def test_host_root(self, tmp_path):
        (tmp_path / "real").mkdir()
        os.symlink("real", tmp_path / "link")
        path = str(tmp_path / "link" / "missing")
        assert inroot.resolve_in_root("/", path) == os.path.realpath(path)


@pytest.mark.usefixtures("mode")
class TestRace:
    def test_exchange_race_never_reaches_outside(self, tree):
        """An attacker swaps a directory with a link to the host as fast as it can while we
        create directories and files below it and open a file through it."""
        os.makedirs(os.path.join(tree.root, "a"))
        with open(os.path.join(tree.root, "a", "secret"), "w") as fh:
            fh.write("in-root")
        os.symlink(tree.outside, os.path.join(tree.root, "b"))
        host_secret = os.lstat(os.path.join(tree.outside, "secret"))
        pid = os.fork()
        if pid == 0:
            try:
                signal.alarm(30)
                while True:
                    syscalls.renameat2(tree.root_fd, "a", tree.root_fd, "b", syscalls.RENAME_EXCHANGE)
            finally:
                os._exit(0)
        seen_link = created = 0
        deadline = time.monotonic() + 20
        try:
            for i in range(200):
                if time.monotonic() > deadline:
                    break
                st_a = inspect_at(tree.root_fd, "a")
                seen_link += bool(st_a and stat.S_ISLNK(st_a.st_mode))
                try:
                    d = mkdirs_in_root(tree.root_fd, f"a/d{i}")
                    try:
                        os.close(create_file_at(d, f"f{i}", 0o644))
                        created += 1
                    finally:
                        os.close(d)
                except OSError:
                    pass
                try:
                    fd = open_in_root(tree.root_fd, "a/secret")
                except OSError:
                    continue
                s = os.fstat(fd)
                os.close(fd)
                assert (s.st_dev, s.st_ino) != (host_secret.st_dev, host_secret.st_ino)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert seen_link > 0, "the race never ran"
        assert created > 0
        # tree.close() asserts that outside/ is unchanged


@needs_root
def test_mknod_and_inspect(tree):
    mknod_at(tree.root_fd, "placeholder", stat.S_IFREG | 0o644)
    mknod_at(tree.root_fd, "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    mknod_at(tree.root_fd, "fifo", stat.S_IFIFO | 0o600)
    assert stat.S_ISREG(inspect_at(tree.root_fd, "placeholder").st_mode)
    assert inspect_at(tree.root_fd, "null").st_rdev == os.makedev(1, 3)
    assert stat.S_ISFIFO(inspect_at(tree.root_fd, "fifo").st_mode)  # did not block
    assert stat.S_ISLNK(inspect_at(tree.root_fd, "abs_outside").st_mode)
    assert inspect_at(tree.root_fd, "missing") is None
    for name in ("placeholder", "abs_outside", "dangling"):
        with pytest.raises(FileExistsError):
            mknod_at(tree.root_fd, name, stat.S_IFREG | 0o644)


def test_create_file_at(tree):
    dir_fd = open_in_root(tree.root_fd, "etc")  # O_PATH directory fds are enough
    try:
        fd = create_file_at(dir_fd, "new", 0o600)
        os.write(fd, b"data")
        os.close(fd)
        with open(os.path.join(tree.root, "etc", "new"), "rb") as fh:
            assert fh.read() == b"data"
        for name in ("new", "passwd"):
            with pytest.raises(FileExistsError):
                create_file_at(dir_fd, name, 0o600)
        os.symlink(os.path.join(tree.outside, "created"), os.path.join(tree.root, "etc", "evil"))
        with pytest.raises(FileExistsError):
            create_file_at(dir_fd, "evil", 0o600)  # a dangling link to the host is not followed
    finally:
        os.close(dir_fd)


def test_symlink_at(tree):
    symlink_at(tree.root_fd, "newlink", "/etc/passwd")
    assert os.readlink(os.path.join(tree.root, "newlink")) == "/etc/passwd"
    with pytest.raises(FileExistsError):
        symlink_at(tree.root_fd, "abs_outside", "x")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/etc"])
def test_helpers_take_single_components_only(tree, name):
    for call in (
        lambda: create_file_at(tree.root_fd, name, 0o600),
        lambda: mknod_at(tree.root_fd, name, stat.S_IFREG),
        lambda: symlink_at(tree.root_fd, name, "x"),
        lambda: inspect_at(tree.root_fd, name),
    ):
        with pytest.raises(ValueError):
            call()


def test_fd_path(tree):
    fd = open_in_root(tree.root_fd, "dirlink")
    try:
        assert inroot.fd_path(fd) == os.path.join(tree.root, "etc")
    finally:
        os.close(fd)


def test_force_switch_and_probe(monkeypatch):
    monkeypatch.setattr(syscalls, "FORCE_NO_OPENAT2", True)
    assert syscalls.openat2_available() is False
    monkeypatch.setattr(syscalls, "FORCE_NO_OPENAT2", False)
    first = syscalls.openat2_available()
    assert syscalls.openat2_available() is first


def test_openat2_errors_carry_errno(tmp_path):
    if not syscalls.openat2_available():
        pytest.skip("kernel has no openat2")
    root_fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as exc:
            syscalls.openat2(root_fd, "missing", os.O_PATH, syscalls.RESOLVE_IN_ROOT)
        assert exc.value.errno == errno.ENOENT
        os.symlink("x", tmp_path / "l")
        with pytest.raises(OSError) as exc:
            syscalls.openat2(root_fd, "l", os.O_PATH, syscalls.RESOLVE_NO_SYMLINKS)
        assert exc.value.errno == errno.ELOOP
    finally:
        os.close(root_fd)


# --- differential: the walker must agree with the kernel on random trees ---------------------

_NAMES = ["a", "b", "c"]
_PIECES = st.sampled_from(["a", "b", "c", "..", ".", "", "x"])
_TARGETS = st.builds(
    lambda absolute, parts, trail: ("/" if absolute else "") + "/".join(parts) + ("/" if trail else ""),
    st.booleans(),
    st.lists(_PIECES, min_size=1, max_size=4),
    st.booleans(),
)
_ENTRY = st.one_of(st.just("dir"), st.just("file"), st.tuples(st.just("link"), _TARGETS))


def _build(top: str, spec: dict) -> None:
    for rel, kind in spec.items():
        full = os.path.join(top, rel)
        try:  # only ever create below real directories: a link could point at the host
            if not stat.S_ISDIR(os.lstat(os.path.dirname(full)).st_mode) or os.path.lexists(full):
                continue
        except FileNotFoundError:
            continue
        if kind == "dir":
            os.mkdir(full)
        elif kind == "file":
            open(full, "w").close()
        else:
            os.symlink(kind[1] or ".", full)


def _outcome(call):
    try:
        fd = call()
    except OSError as exc:
        return ("error", exc.errno)
    return ("ok",) + ident(fd)


@pytest.mark.skipif(not syscalls.openat2_available(), reason="kernel has no openat2")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.dictionaries(
        st.sampled_from([n for n in _NAMES] + [f"{p}/{n}" for p in _NAMES for n in _NAMES]), _ENTRY, max_size=8
    ),
    path=_TARGETS,
    follow_last=st.booleans(),
)
def test_walker_agrees_with_openat2(spec, path, follow_last):
    with tempfile.TemporaryDirectory() as top:
        root = os.path.join(top, "root")
        os.mkdir(root)
        _build(root, spec)
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
        try:
            results = []
            for force in (False, True):
                syscalls.FORCE_NO_OPENAT2 = force
                results.append(_outcome(lambda: open_in_root(root_fd, path or ".", follow_last=follow_last)))
            syscalls.FORCE_NO_OPENAT2 = False
            assert results[0] == results[1]
            if results[0][0] == "ok" and follow_last:
                resolved = inroot.resolve_in_root(root, path)
                s = os.lstat(root + resolved)
                assert results[0][1:] == (s.st_dev, s.st_ino)
        finally:
            syscalls.FORCE_NO_OPENAT2 = False
            os.close(root_fd)
