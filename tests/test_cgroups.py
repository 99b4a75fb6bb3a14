"""Device cgroup rules: the rule model, locating a process's cgroup, the eBPF instruction
encoder, and the v1 back end against the kernel (root only).

Real-kernel checks use a device major no driver registered (195, NVIDIA's, on a machine without
the driver): an open that the cgroup allows fails with ENXIO, one it denies with EPERM. The
cgroup check happens at open time for the opener's cgroup, so each check forks a fresh child
that joins the test cgroup and then opens the node.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import stat
import time

import pytest

from nvcontainer.cgroups import CgroupTarget, apply_rules, bpf, in_user_namespace, locate, v1
from nvcontainer.cgroups.locate import (
    CgroupMount,
    cgroup_dir,
    find_cgroup_mount,
    is_identity_map,
    parse_mountinfo_line,
    parse_proc_cgroup,
)
from nvcontainer.cgroups.rules import Rule, parse_rule
from nvcontainer.errors import NvcError

V1_ROOT = "/sys/fs/cgroup/devices"

# --- helpers shared with test_cgroups_v2 ---------------------------------------------------


def make_nodes(directory) -> dict[tuple[int, int], str]:
    """Character nodes 195:0, 195:1 (no driver behind them) and 1:3 (/dev/null)."""
    nodes = {}
    for major, minor in ((195, 0), (195, 1), (1, 3)):
        path = os.path.join(str(directory), f"c{major}_{minor}")
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(major, minor))
        nodes[(major, minor)] = path
    return nodes


def open_errno(cgroup: str, node: str) -> int:
    """errno of opening ``node`` read-write from a fresh process in ``cgroup`` (0: opened)."""
    procs = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        code = 255
        try:
            os.write(procs, b"0")
            try:
                os.close(os.open(node, os.O_RDWR))
                code = 0
            except OSError as exc:
                code = exc.errno
        finally:
            os._exit(code)
    os.close(procs)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@contextlib.contextmanager
def sleeper_in(cgroup: str):
    """A child process parked in ``cgroup`` until the block ends; yields its pid."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    procs = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(hold_w)   # else the child's own copy would keep it waiting forever
            os.write(procs, b"0")
            os.write(ready_w, b"x")
            os.read(hold_r, 1)
        finally:
            os._exit(0)
    for fd in (procs, ready_w, hold_r):
        os.close(fd)
    try:
        assert os.read(ready_r, 1) == b"x"
        yield pid
    finally:
        os.close(hold_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


@contextlib.contextmanager
def fresh_cgroup(root: str):
    """A fresh child cgroup of ``root``, emptied and removed afterwards whatever happens."""
    if os.geteuid() != 0 or not os.path.isdir(root):
        pytest.skip(f"needs root and {root}")
    path = os.path.join(root, f"nvc-test-{secrets.token_hex(4)}")
    os.mkdir(path)
    try:
        yield path
    finally:
        remove_cgroup(path)


def remove_cgroup(path: str) -> None:
    with open(os.path.join(path, "cgroup.procs")) as f:
        for pid in (int(x) for x in f.read().split()):   # only our own children can be here
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    for _ in range(100):
        try:
            os.rmdir(path)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            time.sleep(0.02)
    os.rmdir(path)




# --- rules -----------------------------------------------------------------------------------


def test_rule_text_and_parse_round_trip():
    rule = Rule("c", 195, 0, "rw")
    assert rule.text == "c 195:0 rw"
    assert parse_rule("c 195:255 rw") == Rule("c", 195, 255, "rw")
    assert parse_rule("b 8:1 mwr") == Rule("b", 8, 1, "rwm")   # access normalised
    assert parse_rule(Rule("c", 511, 1048575, "r").text) == Rule("c", 511, 1048575, "r")


@pytest.mark.parametrize(
    "text",
    ["a *:* rwm", "c *:* rw", "c 195:* rw", "c 195:0", "c 195:0 rx", "c 195:0 rr", "c 4096:0 rw",
     "c 1:1048576 rw", "c -1:0 rw", "c 195:0 rw\n", "c 195:0  rw", "u 1:3 rw"],
)
def test_parse_rule_rejects_wildcards_and_junk(text):
    with pytest.raises(NvcError) as err:
        parse_rule(text)
    assert err.value.category == "cgroup"
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "args",
    [("a", 1, 3, "rw"), ("c", True, 3, "rw"), ("c", 1, 2**20, "rw"), ("c", 1, 3, ""), ("c", 1, 3, "wr"),
     ("c", "1", 3, "rw")],
)
def test_rule_constructor_validates(args):
    with pytest.raises(NvcError):
        Rule(*args)


# --- /proc/PID/cgroup ------------------------------------------------------------------------

HYBRID = """\
9:name=systemd:/docker/abc
8:pids:/docker/abc
5:devices:/docker/abc
4:memory:/docker/abc
0::/system.slice/docker-abc.scope
"""


def test_proc_cgroup_v1_and_hybrid_prefer_devices_controller():
    assert parse_proc_cgroup(HYBRID) == (1, "/docker/abc")
    assert parse_proc_cgroup("3:cpuset,devices:/lxc/c1\n") == (1, "/lxc/c1")


def test_proc_cgroup_v2_and_v2_with_named_v1():
    assert parse_proc_cgroup("0::/system.slice/docker-abc.scope\n") == (2, "/system.slice/docker-abc.scope")
    assert parse_proc_cgroup("1:name=systemd:/x\n0::/kubepods/pod1/c:2\n") == (2, "/kubepods/pod1/c:2")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1:name=systemd:/\n", "no devices or unified cgroup entries"),
        ("0::/a (deleted)\n", "container exited during configuration"),
        ("0::/../outside\n", "outside this cgroup namespace"),
        ("5:devices:/a/../b\n", "invalid cgroup path"),
        ("5:devices:relative\n", "invalid cgroup path"),
        ("0::/a\n0::/b\n", "ambiguous"),
        ("5:devices:/a\nbogus\n", "malformed"),
    ],
)
def test_proc_cgroup_errors(text, message):
    with pytest.raises(NvcError, match=message):
        parse_proc_cgroup(text)


# --- mountinfo -------------------------------------------------------------------------------

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime shared:13 master:2 - cgroup cgroup rw,devices
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
50 22 0:33 / /mnt/devices\\040copy rw - cgroup cgroup rw,devices
"""


def test_mountinfo_line_fields():
    line = "50 22 0:33 /a\\040b /mnt/x\\134y rw shared:3 master:1 - cgroup none rw,devices"
    assert parse_mountinfo_line(line) == ("/a b", "/mnt/x\\y", "cgroup", ["rw", "devices"])
    assert parse_mountinfo_line("garbage") is None
    assert parse_mountinfo_line("1 2 3:4 / / rw - ext4") is None


def test_find_mount_v1_and_v2():
    lines = MOUNTINFO.splitlines()
    assert find_cgroup_mount(lines, 1, "/docker/abc") == CgroupMount("/", "/sys/fs/cgroup/devices")
    assert find_cgroup_mount(lines, 2, "/x") == CgroupMount("/", "/sys/fs/cgroup/unified")


def test_find_mount_v1_comounted_controllers():
    line = "40 31 0:40 / /sys/fs/cgroup/cpu,devices rw - cgroup cgroup rw,cpu,devices"
    assert find_cgroup_mount([line], 1, "/a") == CgroupMount("/", "/sys/fs/cgroup/cpu,devices")


def test_find_mount_nested_root_is_stripped():
    # Inside a container: the hierarchy's /docker/abc is what is mounted at /sys/fs/cgroup/devices.
    lines = [
        "36 31 0:33 /other /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices",
        "37 31 0:33 /docker/abc /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices",
    ]
    mount = find_cgroup_mount(lines, 1, "/docker/abc/inner")
    assert mount == CgroupMount("/docker/abc", "/sys/fs/cgroup/devices")
    assert cgroup_dir("/docker/abc/inner", mount) == "/sys/fs/cgroup/devices/inner"
    assert cgroup_dir("/docker/abc", mount) == "/sys/fs/cgroup/devices"
    assert cgroup_dir("/a/b", CgroupMount("/", "/sys/fs/cgroup/unified")) == "/sys/fs/cgroup/unified/a/b"
    # /docker/abcdef is not below /docker/abc
    with pytest.raises(NvcError, match="no devices cgroup \\(v1\\) mount shows"):
        find_cgroup_mount(lines, 1, "/docker/abcdef")


def test_find_mount_asks_about_visibility_only_for_the_mounts_it_could_pick():
    """A covered mount counts as absent (the next one of its hierarchy is taken), and the
    visibility check (system calls per line) is made for the devices or cgroup2 lines only,
    up to the first that fits: not for the dozen other v1 hierarchies a host lists."""
    lines = MOUNTINFO.splitlines()
    asked: list[str] = []

    def covered_devices(line: str) -> bool:
        asked.append(line.split(" ", 1)[0])
        return line.split(" ", 1)[0] != "36"

    assert find_cgroup_mount(lines, 1, "/docker/abc", covered_devices) == CgroupMount("/", "/mnt/devices copy")
    assert asked == ["36", "50"]
    asked.clear()
    assert find_cgroup_mount(lines, 2, "/x", covered_devices) == CgroupMount("/", "/sys/fs/cgroup/unified")
    assert asked == ["41"]
    asked.clear()
    with pytest.raises(NvcError, match="no devices cgroup \\(v1\\) mount found"):
        find_cgroup_mount(lines, 1, "/a", lambda line: asked.append(line) and False)
    assert len(asked) == 2   # the two devices lines, both covered: as if neither were listed


def test_find_mount_errors():
    with pytest.raises(NvcError, match="outside this cgroup namespace"):
        find_cgroup_mount(["41 31 0:38 /.. /sys/fs/cgroup rw - cgroup2 cgroup2 rw"], 2, "/a")
    with pytest.raises(NvcError, match="no cgroup2 mount found"):
        find_cgroup_mount(MOUNTINFO.splitlines()[:4], 2, "/a")
    with pytest.raises(NvcError, match="no devices cgroup \\(v1\\) mount found"):
        find_cgroup_mount(["41 31 0:38 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw"], 1, "/a")


def test_identity_map():
    assert is_identity_map("         0          0 4294967295\n")
    assert not is_identity_map("         0     100000      65536\n")
    assert not is_identity_map("")
    assert not is_identity_map("0 0 4294967295\n1 1 1\n")


def test_in_user_namespace_real():
    if os.geteuid() != 0 or not is_identity_map(open("/proc/self/uid_map").read()):
        pytest.skip("needs root in the initial user namespace")
    from nvcontainer.fs.syscalls import unshare

    assert not in_user_namespace(os.getpid())
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(hold_w)
            unshare(0x10000000)   # CLONE_NEWUSER
            os.write(ready_w, b"x")
            os.read(hold_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(hold_r)
    try:
        assert os.read(ready_r, 1) == b"x"
        assert in_user_namespace(pid)
    finally:
        os.close(hold_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


def test_locate_of_a_dead_process_says_exited():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    with pytest.raises(NvcError, match="container exited during configuration"):
        locate(pid)


# --- instruction encoder ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("insn", "hexbytes"),
    [
        (bpf.mov64_imm(0, 1), "b700000001000000"),
        (bpf.exit_insn(), "9500000000000000"),
        (bpf.ldx_w(2, 1, 4), "6112040000000000"),
        (bpf.alu32_imm(bpf.AND, 2, 0xFFFF), "54020000ffff0000"),
        (bpf.alu32_imm(bpf.RSH, 3, 16), "7403000010000000"),
        (bpf.jmp_imm(bpf.JNE, 4, 195, 3), "55040300c3000000"),
        (bpf.jmp_imm(bpf.JSET, 3, 0xFFFFFFF9, 4), "45030400f9ffffff"),
        (bpf.mov32_reg(1, 3), "bc31000000000000"),
        (bpf.mov32_imm(0, 0), "b400000000000000"),
    ],
)
def test_encoder_golden(insn, hexbytes):
    assert insn.encode().hex() == hexbytes
    assert bpf.decode(bytes.fromhex(hexbytes)) == [insn]


def test_encoder_rejects_out_of_range_immediate():
    with pytest.raises(ValueError):
        bpf.mov64_imm(0, 1 << 32)
    with pytest.raises(ValueError):
        bpf.decode(b"\x95" * 7)


# --- v1 against the kernel -------------------------------------------------------------------

C195_0 = Rule("c", 195, 0, "rw")


def _devices_list(cgroup: str) -> list[str]:
    with open(os.path.join(cgroup, "devices.list")) as f:
        return f.read().splitlines()


def test_v1_allow_opens_exactly_the_device(tmp_path):
    nodes = make_nodes(tmp_path)
    with fresh_cgroup(V1_ROOT) as cg:
        with open(os.path.join(cg, "devices.deny"), "w") as f:
            f.write("a")
        assert _devices_list(cg) == []
        assert open_errno(cg, nodes[(195, 0)]) == errno.EPERM
        assert open_errno(cg, nodes[(1, 3)]) == errno.EPERM

        v1.allow(cg, [C195_0])
        assert open_errno(cg, nodes[(195, 0)]) == errno.ENXIO   # allowed: no driver behind it
        assert open_errno(cg, nodes[(195, 1)]) == errno.EPERM
        assert open_errno(cg, nodes[(1, 3)]) == errno.EPERM
        assert _devices_list(cg) == ["c 195:0 rw"]

        v1.allow(cg, [C195_0, Rule("c", 195, 1, "rw")])        # repeated run: no duplicates
        assert _devices_list(cg) == ["c 195:0 rw", "c 195:1 rw"]
        assert open_errno(cg, nodes[(195, 1)]) == errno.ENXIO


def test_apply_rules_end_to_end_v1(tmp_path):
    nodes = make_nodes(tmp_path)
    with fresh_cgroup(V1_ROOT) as cg:
        with open(os.path.join(cg, "devices.deny"), "w") as f:
            f.write("a")
        with sleeper_in(cg) as pid:
            assert locate(pid) == CgroupTarget(1, cg)
            assert locate(pid, os.getpid()) == CgroupTarget(1, cg)
            message = apply_rules(pid, [C195_0, C195_0])
            assert cg in message
        assert _devices_list(cg) == ["c 195:0 rw"]
        assert open_errno(cg, nodes[(195, 0)]) == errno.ENXIO
        assert apply_rules(os.getpid(), []) == "no device rules to add"


def test_v1_refuses_a_directory_that_is_not_a_cgroup(tmp_path):
    (tmp_path / "devices.allow").write_text("")
    with pytest.raises(NvcError, match="not a cgroup v1 directory"):
        v1.allow(str(tmp_path), [C195_0])
    assert (tmp_path / "devices.allow").read_text() == ""


def test_v1_cgroup_gone_reports_exited():
    with fresh_cgroup(V1_ROOT) as cg:
        pass
    with pytest.raises(NvcError, match="container exited during configuration"):
        v1.allow(cg, [C195_0])


def test_v1_rule_beyond_parent_names_rule_and_path():
    with fresh_cgroup(V1_ROOT) as parent:
        with open(os.path.join(parent, "devices.deny"), "w") as f:
            f.write("a")
        child = os.path.join(parent, "inner")
        os.mkdir(child)
        try:
            with pytest.raises(NvcError) as err:
                v1.allow(child, [C195_0])
            assert "c 195:0 rw" in err.value.detail and child in err.value.detail
        finally:
            os.rmdir(child)
