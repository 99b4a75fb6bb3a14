"""Mounting through fds. Every mount happens in a forked child with a private mount namespace,
so nothing reaches the host; a fixture checks the host's mountinfo afterwards."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from nvcontainer.apply import mounter
from nvcontainer.errors import NvcError
from nvcontainer.fs import mounts, syscalls
from nvcontainer.fs.inroot import create_file_at, mkdirs_in_root, mknod_at, open_in_root
from nvcontainer.fs.mounts import attach, bind_classic, clone_mount, detach, mount_info_of, set_attrs
from tests.fixtures.namespaces import run_in_private_ns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount tests need root")

LIB_ATTRS = syscalls.MOUNT_ATTR_RDONLY | syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV
DEV_ATTRS = syscalls.MOUNT_ATTR_RDONLY | syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NOEXEC
ST_LIB = os.ST_RDONLY | os.ST_NOSUID | os.ST_NODEV


def host_mounts_under(top: str) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        return sorted(line for line in fh if f" {top}" in line)


@pytest.fixture(autouse=True)
def host_mountinfo_unchanged(tmp_path_factory):
    """Other engineers may mount things on this machine meanwhile, so compare what lies under
    this session's temp dirs, plus our own mount namespace identity."""
    top = str(tmp_path_factory.getbasetemp())
    ns = os.readlink("/proc/self/ns/mnt")
    before = host_mounts_under(top)
    yield
    assert os.readlink("/proc/self/ns/mnt") == ns
    assert host_mounts_under(top) == before


def entry_at(path) -> mounts.MountEntry:
    fd = os.open(path, os.O_PATH)
    try:
        return mount_info_of(fd)
    finally:
        os.close(fd)


def mounts_under(top) -> list[str]:
    return [e.mount_point for e in mounts.parse_mountinfo(open("/proc/self/mountinfo").read()).values()
            if e.mount_point.startswith(str(top))]


@pytest.fixture
def layout(tmp_path):
    src = tmp_path / "host" / "lib"
    src.mkdir(parents=True)
    (src / "libcuda.so.1").write_text("payload")
    (src / "sub").mkdir()
    (tmp_path / "rootfs").mkdir()
    return tmp_path


def test_clone_mount_is_readonly_from_its_first_instant(layout):
    rootfs, src = layout / "rootfs", layout / "host" / "lib"

    def body():
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        mfd = clone_mount(str(src), LIB_ATTRS)
        # still detached: not in any mountinfo, yet already read-only, nosuid, nodev
        with pytest.raises(FileNotFoundError):
            mount_info_of(mfd)
        assert os.fstatvfs(mfd).f_flag & ST_LIB == ST_LIB
        with pytest.raises(OSError) as exc:
            create_file_at(mfd, "x", 0o600)
        assert exc.value.errno == errno.EROFS

        target = mkdirs_in_root(root_fd, "/usr/lib/x86_64-linux-gnu/nvidia")
        attach(mfd, target)
        entry = mount_info_of(mfd)
        assert entry.mount_point == f"{rootfs}/usr/lib/x86_64-linux-gnu/nvidia"
        assert {"ro", "nosuid", "nodev"} <= entry.options
        assert entry.propagation == {} and not entry.shared
        assert (rootfs / "usr/lib/x86_64-linux-gnu/nvidia/libcuda.so.1").read_text() == "payload"
        with pytest.raises(OSError) as exc:
            open(rootfs / "usr/lib/x86_64-linux-gnu/nvidia/new", "w")
        assert exc.value.errno == errno.EROFS

        detach(mfd)
        assert os.listdir(rootfs / "usr/lib/x86_64-linux-gnu/nvidia") == []
        assert mounts_under(rootfs) == []

    run_in_private_ns(body)


def test_clone_of_a_verified_file_fd_onto_a_placeholder(layout):
    rootfs, src = layout / "rootfs", layout / "host" / "lib"

    def body():
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        src_fd = os.open(src / "libcuda.so.1", os.O_PATH | os.O_NOFOLLOW)
        assert stat.S_ISREG(os.fstat(src_fd).st_mode)
        mfd = clone_mount(src_fd, DEV_ATTRS)
        dev = mkdirs_in_root(root_fd, "dev")
        mknod_at(dev, "nvidia0", stat.S_IFREG | 0o644)
        target = open_in_root(dev, "nvidia0", follow_last=False)
        attach(mfd, target)
        entry = mount_info_of(mfd)
        assert entry.mount_point == f"{rootfs}/dev/nvidia0"
        assert {"ro", "nosuid", "noexec"} <= entry.options
        assert (rootfs / "dev/nvidia0").read_text() == "payload"
        detach(target)  # the pre-mount target fd also names the spot
        assert (rootfs / "dev/nvidia0").read_text() == ""

    run_in_private_ns(body)


def test_recursive_clone_carries_submounts_and_their_flags(layout):
    rootfs, src = layout / "rootfs", layout / "host" / "lib"

    def body():
        syscalls.mount("tmpfs", str(src / "sub"), "tmpfs", 0)
        (src / "sub" / "inner").write_text("inner")
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        flat, deep = mkdirs_in_root(root_fd, "flat"), mkdirs_in_root(root_fd, "deep")
        attach(clone_mount(str(src), LIB_ATTRS), flat)
        attach(clone_mount(str(src), LIB_ATTRS, recursive=True), deep)
        assert os.listdir(rootfs / "flat/sub") == []
        assert (rootfs / "deep/sub/inner").read_text() == "inner"
        assert {"ro", "nosuid", "nodev"} <= entry_at(rootfs / "deep/sub").options
        with pytest.raises(OSError) as exc:
            open(rootfs / "deep/sub/new", "w")
        assert exc.value.errno == errno.EROFS

    run_in_private_ns(body)


def test_classic_bind_matches_the_new_api(layout):
    rootfs, src = layout / "rootfs", layout / "host" / "lib"

    def body():
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        libdir = mkdirs_in_root(root_fd, "usr/lib")
        os.close(mkdirs_in_root(libdir, "classic"))
        os.close(mkdirs_in_root(libdir, "modern"))
        mounted = bind_classic(str(src), libdir, "classic", syscalls.MS_RDONLY | syscalls.MS_NOSUID | syscalls.MS_NODEV)
        assert os.fstat(mounted).st_ino == os.stat(src).st_ino
        attach(clone_mount(str(src), LIB_ATTRS), open_in_root(libdir, "modern"))
        classic, modern = entry_at(rootfs / "usr/lib/classic"), entry_at(rootfs / "usr/lib/modern")
        assert {"ro", "nosuid", "nodev"} <= classic.options
        assert classic.options == modern.options
        assert classic.propagation == modern.propagation == {}
        assert (rootfs / "usr/lib/classic/libcuda.so.1").read_text() == "payload"
        with pytest.raises(OSError) as exc:
            open(rootfs / "usr/lib/classic/new", "w")
        assert exc.value.errno == errno.EROFS
        detach(mounted)
        assert os.listdir(rootfs / "usr/lib/classic") == []

    run_in_private_ns(body)


def test_classic_bind_refuses_a_symlink_target(layout):
    rootfs, src = layout / "rootfs", layout / "host" / "lib"
    outside = layout / "outside"
    outside.mkdir()
    os.symlink(outside, rootfs / "evil")

    def body():
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        with pytest.raises(OSError) as exc:
            bind_classic(str(src), root_fd, "evil", syscalls.MS_RDONLY)
        assert exc.value.errno == errno.ELOOP
        assert os.listdir(outside) == [] and mounts_under(layout) == []

    run_in_private_ns(body)


def test_classic_bind_is_undone_when_the_target_is_swapped(layout):
    """A second container sharing the volume renames the target away right after our bind
    (it can: in its namespace the name is no mount point) and puts a fresh directory there."""
    rootfs, src = layout / "rootfs", layout / "host" / "lib"
    (rootfs / "target").mkdir()

    def start_attacker():
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        if os.fork() == 0:  # stays in the host namespace
            try:
                os.read(go_r, 1)
                os.rename(rootfs / "target", rootfs / "moved")
                os.mkdir(rootfs / "target")
                os.write(done_w, b"x")
            finally:
                os._exit(0)
        return go_w, done_r

    def body(pipes):
        go_w, done_r = pipes
        real_mount = syscalls.mount

        def mount_then_race(source, target, fstype, flags, data=None):
            real_mount(source, target, fstype, flags, data)
            if flags == syscalls.MS_BIND:
                os.write(go_w, b"x")
                assert os.read(done_r, 1) == b"x"

        syscalls.mount = mount_then_race
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        with pytest.raises(OSError) as exc:
            bind_classic(str(src), root_fd, "target", syscalls.MS_RDONLY)
        assert exc.value.errno == errno.EAGAIN
        assert os.listdir(rootfs / "moved") == []  # our bind followed the rename and was undone
        assert mounts_under(layout) == []

    run_in_private_ns(body, start_attacker)


def test_tmpfs_is_populated_detached_then_attached_read_only(layout):
    rootfs = layout / "rootfs"

    def body():
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        attrs = syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV | syscalls.MOUNT_ATTR_NOEXEC
        mfd = mounts.tmpfs_detached({"mode": "0555", "size": "1m"}, attrs)
        assert syscalls.fstatfs_type(mfd) == syscalls.TMPFS_MAGIC
        fd = create_file_at(mfd, "params", 0o444)
        os.write(fd, b"ModifyDeviceFiles: 0\n")
        os.close(fd)
        set_attrs(mfd, syscalls.MOUNT_ATTR_RDONLY)
        with pytest.raises(OSError) as exc:
            create_file_at(mfd, "late", 0o444)
        assert exc.value.errno == errno.EROFS
        target = mkdirs_in_root(root_fd, "proc/driver/nvidia")
        attach(mfd, target)
        entry = mount_info_of(mfd)
        assert entry.fstype == "tmpfs" and entry.mount_point == f"{rootfs}/proc/driver/nvidia"
        assert {"ro", "nosuid", "nodev", "noexec"} <= entry.options
        assert (rootfs / "proc/driver/nvidia/params").read_text() == "ModifyDeviceFiles: 0\n"
        vfs = os.statvfs(rootfs / "proc/driver/nvidia")
        assert vfs.f_blocks * vfs.f_frsize == 1 << 20
        assert stat.S_IMODE(os.stat(rootfs / "proc/driver/nvidia").st_mode) == 0o555

    run_in_private_ns(body)


def test_tmpfs_bad_option_is_an_oserror():
    def body():
        with pytest.raises(OSError) as exc:
            mounts.tmpfs_detached({"no_such_option": "1"}, 0)
        assert exc.value.errno == errno.EINVAL

    run_in_private_ns(body)


def shared_volume(layout) -> None:
    """In a private namespace (a test's ``body``): ``rootfs/vol`` a tmpfs with shared
    propagation and a peer at ``peer``, as a container's volume whose peer is on the host."""
    vol, peer = layout / "rootfs" / "vol", layout / "peer"
    vol.mkdir()
    peer.mkdir()
    syscalls.mount("tmpfs", str(vol), "tmpfs", 0)
    syscalls.mount(None, str(vol), None, syscalls.MS_SHARED)
    syscalls.mount(str(vol), str(peer), None, syscalls.MS_BIND)


def test_shared_parent_is_detected(layout):
    """A mount made below a shared mount shows up at its peers (for a container: on the host),
    which is why callers must be able to tell."""
    rootfs, src = layout / "rootfs", layout / "host" / "lib"

    def body():
        shared_volume(layout)
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        in_vol = mkdirs_in_root(root_fd, "vol/lib")
        assert mount_info_of(in_vol).shared
        assert "shared" in mount_info_of(in_vol).propagation
        private_dir = mkdirs_in_root(root_fd, "usr/lib")
        assert not mount_info_of(private_dir).shared
        attach(clone_mount(str(src), LIB_ATTRS), in_vol)
        assert (layout / "peer/lib/libcuda.so.1").read_text() == "payload"  # it leaked

    run_in_private_ns(body)


def counting_parses(monkeypatch) -> list[int]:
    """How often mountinfo text gets parsed from here on (one element per parse)."""
    calls: list[int] = []
    real = mounts.parse_mountinfo

    def counted(text):
        calls.append(1)
        return real(text)

    monkeypatch.setattr(mounts, "parse_mountinfo", counted)
    return calls


def test_mount_table_parses_once_and_rereads_only_for_mounts_it_has_not_seen(layout, monkeypatch):
    rootfs, src = layout / "rootfs", layout / "host" / "lib"
    parses = counting_parses(monkeypatch)

    def body():
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        lib = mkdirs_in_root(root_fd, "usr/lib")
        want = mount_info_of(lib)
        parses.clear()
        table = mounts.MountTable()
        for _ in range(5):
            assert table.entry_of(lib).mount_point == want.mount_point
            assert table.entry_of(root_fd).mnt_id == want.mnt_id
        assert len(parses) == 1
        mfd = clone_mount(str(src), LIB_ATTRS)
        with pytest.raises(FileNotFoundError):
            table.entry_of(mfd)   # detached: a miss, read again, still not there
        assert len(parses) == 2
        attach(mfd, lib)
        table.changed_by_us()
        on_top = open_in_root(root_fd, "usr/lib")
        entry = table.entry_of(on_top)   # our new mount: not in the table, so read again
        assert entry.mount_point == f"{rootfs}/usr/lib" and {"ro", "nosuid"} <= entry.options
        assert not entry.shared
        assert len(parses) == 3
        assert table.entry_of(on_top) is entry and table.entry_of(lib).mnt_id == want.mnt_id
        assert len(parses) == 3
        table.close()

    run_in_private_ns(body)


def test_mount_table_rereads_after_a_change_it_did_not_make(layout, monkeypatch):
    """Mount ids are reused, and the host can mount and unmount in a container's namespace
    through propagation: a change the caller did not announce makes the next lookup read the
    table again, even for an id the table knows."""
    rootfs = layout / "rootfs"
    (rootfs / "a").mkdir()
    (rootfs / "b").mkdir()
    parses = counting_parses(monkeypatch)

    def body():
        syscalls.mount("tmpfs", str(rootfs / "a"), "tmpfs", 0)
        fd = os.open(rootfs / "a", os.O_PATH | os.O_DIRECTORY)
        table = mounts.MountTable()
        assert table.entry_of(fd).mount_point == f"{rootfs}/a"
        syscalls.mount(str(rootfs / "a"), str(rootfs / "b"), None, 0x2000)   # MS_MOVE, same mount id
        assert table.entry_of(fd).mount_point == f"{rootfs}/b"
        assert len(parses) == 2
        # The same change announced as ours is not read back: the table still says "a". Only
        # our own attaches, which change no known entry, may be announced.
        syscalls.mount(str(rootfs / "b"), str(rootfs / "a"), None, 0x2000)
        table.changed_by_us()
        assert table.entry_of(fd).mount_point == f"{rootfs}/b"
        assert len(parses) == 2
        table.close()

    run_in_private_ns(body)


def test_mount_table_sees_a_shared_mount(layout):
    rootfs = layout / "rootfs"

    def body():
        shared_volume(layout)
        root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        table = mounts.MountTable()
        assert table.entry_of(mkdirs_in_root(root_fd, "vol/lib")).shared
        assert not table.entry_of(mkdirs_in_root(root_fd, "usr/lib")).shared
        table.close()

    run_in_private_ns(body)


# --- mounter.place: the worker body, run here in the test's own private namespace ------------


def place_here(rootfs, actions) -> dict:
    ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return mounter.place(ns, str(rootfs), actions)
    finally:
        os.close(ns)


def file_mount(src, target) -> dict:
    return {"op": "mount", "fd": clone_mount(str(src), LIB_ATTRS), "target": target, "kind": "file", "step": "mount"}


def test_place_resolves_parents_again_after_a_directory_mount(layout):
    """A directory mount covers what a parent resolved earlier in the run led to: later
    targets below it must land in the new mount, where the container sees them."""
    rootfs, src = layout / "rootfs", layout / "host" / "lib"

    def body():
        tmpfs = mounts.tmpfs_detached({"mode": "0755", "size": "1m"}, 0)
        place_here(rootfs, [
            file_mount(src / "libcuda.so.1", "/opt/a/x"),
            {"op": "mount", "fd": tmpfs, "target": "/opt/a", "kind": "dir", "step": "tmpfs"},
            file_mount(src / "libcuda.so.1", "/opt/a/y"),
        ])
        assert os.listdir(rootfs / "opt/a") == ["y"]
        assert (rootfs / "opt/a/y").read_text() == "payload"

    run_in_private_ns(body)


def test_place_refuses_an_entry_in_a_host_directory_mounted_during_the_run(layout):
    """The directory was the rootfs's own (entries allowed) until a host directory was mounted
    over it: the next target there is refused, not made in the covered directory."""
    rootfs, src = layout / "rootfs", layout / "host" / "lib"
    hostdir = layout / "host" / "dir"
    hostdir.mkdir()

    def body():
        actions = [
            file_mount(src / "libcuda.so.1", "/opt/a/x"),
            {"op": "mount", "fd": clone_mount(str(hostdir), LIB_ATTRS), "target": "/opt/a", "kind": "dir",
             "step": "mount"},
            file_mount(src / "libcuda.so.1", "/opt/a/y"),
        ]
        with pytest.raises(NvcError, match="mount /opt/a/y: the directory is a host filesystem mounted into"):
            place_here(rootfs, actions)
        assert os.listdir(hostdir) == [] and mounts_under(rootfs) == []

    run_in_private_ns(body)


def test_place_resolves_parents_again_after_replacing_a_symlink(layout):
    rootfs, src = layout / "rootfs", layout / "host" / "lib"
    (rootfs / "opt/one").mkdir(parents=True)
    (rootfs / "opt/two").mkdir()
    os.symlink("one", rootfs / "opt/lib")

    def body():
        place_here(rootfs, [
            file_mount(src / "libcuda.so.1", "/opt/lib/x"),
            {"op": "symlink", "target": "/opt/lib", "link": "two"},
            file_mount(src / "libcuda.so.1", "/opt/lib/y"),
        ])
        assert os.listdir(rootfs / "opt/one") == ["x"] and os.listdir(rootfs / "opt/two") == ["y"]
        assert (rootfs / "opt/two/y").read_text() == "payload"

    run_in_private_ns(body)


def test_place_refuses_a_shared_target_after_earlier_mounts(layout):
    """The table is read before the first mount; a later target below a shared mount is still
    refused, and what the run had mounted is undone."""
    rootfs, src = layout / "rootfs", layout / "host" / "lib"

    def body():
        shared_volume(layout)
        (rootfs / "vol/y").write_text("")
        with pytest.raises(NvcError, match="mount /vol/y: .* has shared propagation: refusing"):
            place_here(rootfs, [file_mount(src / "libcuda.so.1", "/usr/lib/x"),
                                file_mount(src / "libcuda.so.1", "/vol/y")])
        assert os.listdir(rootfs / "usr/lib") == []   # attached, detached again, placeholder removed
        assert (layout / "peer/y").read_text() == ""
        assert sorted(mounts_under(rootfs)) == [f"{rootfs}/vol"]

    run_in_private_ns(body)


def test_parse_mountinfo():
    text = (
        "22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"
        "97 29 0:44 / /mnt/with\\040space ro,nosuid master:3 propagate_from:2 - tmpfs tmpfs rw,size=1024k\n"
        "98 29 0:45 / /mnt/plain rw unbindable - ext4 /dev/sda1 rw\n"
        "garbage line without separator\n"
        "x y z\n"
    )
    entries = mounts.parse_mountinfo(text)
    assert sorted(entries) == [22, 97, 98]
    assert entries[22].shared and entries[22].propagation == {"shared": 12}
    assert entries[22].fstype == "proc" and "noexec" in entries[22].options
    assert entries[97].mount_point == "/mnt/with space"
    assert entries[97].propagation == {"master": 3, "propagate_from": 2} and not entries[97].shared
    assert entries[97].options == frozenset({"ro", "nosuid"}) and entries[97].parent_id == 29
    assert entries[98].propagation == {"unbindable": 0}


def test_mount_info_of_a_host_fd():
    fd = os.open("/proc", os.O_PATH)
    try:
        entry = mount_info_of(fd)
        assert entry.mount_point == "/proc" and entry.fstype == "proc"
        assert entry.mnt_id == mounts.mnt_id_of(fd)
        assert syscalls.fstatfs_type(fd) == syscalls.PROC_SUPER_MAGIC
    finally:
        os.close(fd)


def test_syscall_errors_carry_errno(tmp_path):
    with pytest.raises(FileNotFoundError):
        clone_mount(str(tmp_path / "missing"), LIB_ATTRS)
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    with pytest.raises(FileExistsError):
        syscalls.renameat2(syscalls.AT_FDCWD, str(tmp_path / "a"), syscalls.AT_FDCWD, str(tmp_path / "b"),
                           syscalls.RENAME_NOREPLACE)
    syscalls.renameat2(syscalls.AT_FDCWD, str(tmp_path / "a"), syscalls.AT_FDCWD, str(tmp_path / "b"),
                       syscalls.RENAME_EXCHANGE)
    assert (tmp_path / "a").read_text() == "b"
