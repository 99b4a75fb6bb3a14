"""The ldconfig sandbox, against a real "container" mount namespace and a tiny rootfs.

The container is ``unshare -m --propagation private sleep``: a mount namespace of its own
whose "/" is a copy of the host's, as runc's is at prestart time. Hostile images are built
in temp dirs; the sandbox must leave the host (mounts, ld.so.cache, files outside the rootfs)
and the container's mount table untouched. A static C helper stands in for ldconfig where the
test needs to look at the sandbox from inside.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import resource
import shutil
import stat
import subprocess
import time

import pytest

from nvcontainer.apply import ldconfig, sandbox, sealed
from nvcontainer.apply.ldconfig import run_ldconfig, static_elf_problem
from nvcontainer.errors import NvcError
from tests.fixtures.namespaces import private_mount_sleeper

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root")

LIBS = {  # file name -> (directory in the rootfs, SONAME)
    "libfoo.so.1.2.3": ("/usr/lib/a", "libfoo.so.1"),
    "libbar.so.2.0": ("/usr/lib/nvc", "libbar.so.2"),
    "libbaz.so.3.1": ("/usr/lib/nvc", "libbaz.so.3"),
}

# Reads its orders from /mode in the (pivoted) root: "report" writes what it sees to /report,
# "fail" complains and exits 3, "spin" never ends; "tamper" tries to write and chmod its own
# program (the memfd it runs from), "touch" to set its times, and both then report.
HELPER_C = r"""
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>
extern char **environ;
static void copy_lines(FILE *out, const char *path, const char *prefix) {
    char line[1024];
    FILE *in = fopen(path, "r");
    if (!in) { fprintf(out, "%s unreadable %s\n", prefix, strerror(errno)); return; }
    while (fgets(line, sizeof line, in)) fprintf(out, "%s %s", prefix, line);
    fclose(in);
}
int main(int argc, char **argv) {
    char mode[16] = "";
    int open_fds[64], n_open = 0;
    for (int fd = 0; fd < 64; fd++) if (fcntl(fd, F_GETFD) != -1) open_fds[n_open++] = fd;
    FILE *m = fopen("/mode", "r");
    if (m) { fgets(mode, sizeof mode, m); fclose(m); }
    if (!strncmp(mode, "spin", 4)) for (;;) {}
    if (!strncmp(mode, "fail", 4)) {
        fprintf(stderr, "helper: warning first\nhelper: fatal \x1b[31mred\n");
        return 3;
    }
    FILE *out = fopen("/report", "w");
    if (!out) return 4;
    if (!strncmp(mode, "tamper", 6)) {
        int wfd = open("/proc/self/exe", O_WRONLY);
        fprintf(out, "exewrite %s\n", wfd < 0 ? strerror(errno) : "ok");
        fprintf(out, "exechange %s\n", chmod("/proc/self/exe", 04555) ? strerror(errno) : "ok");
    }
    if (!strncmp(mode, "touch", 5))
        fprintf(out, "exechange %s\n", utimes("/proc/self/exe", NULL) ? strerror(errno) : "ok");
    struct stat self, self_root;
    stat("/", &self_root);
    if (!stat("/proc/self/exe", &self))
        fprintf(out, "exe %lu\nexemode %o\n", (unsigned long)self.st_ino, (unsigned)(self.st_mode & 07777));
    for (int i = 0; i < n_open; i++) {
        char link[64], target[256] = "";
        snprintf(link, sizeof link, "/proc/self/fd/%d", open_fds[i]);
        ssize_t n = readlink(link, target, sizeof target - 1);
        struct stat st;
        int dir = !fstat(open_fds[i], &st) && S_ISDIR(st.st_mode);
        fprintf(out, "fd %d\nfdlink %d %s %s\n", open_fds[i], open_fds[i], n > 0 ? target : "?",
                dir ? (st.st_ino == self_root.st_ino && st.st_dev == self_root.st_dev ? "root" : "dir") : "-");
    }
    for (int i = 0; i < argc; i++) fprintf(out, "argv %s\n", argv[i]);
    int n_env = 0;
    for (char **e = environ; *e; e++) n_env++;
    fprintf(out, "env %d\n", n_env);
    fprintf(out, "pid %d\n", (int)getpid());
    copy_lines(out, "/proc/self/status", "status");
    copy_lines(out, "/proc/self/net/dev", "netdev");
    copy_lines(out, "/proc/self/mountinfo", "mount");
    int fd = open("/dev/created", O_CREAT | O_WRONLY, 0600);
    fprintf(out, "devwrite %s\n", fd < 0 ? strerror(errno) : "ok");
    DIR *d = opendir("/proc");
    struct dirent *ent;
    while (d && (ent = readdir(d)))
        if (ent->d_name[0] >= '1' && ent->d_name[0] <= '9') fprintf(out, "proc %s\n", ent->d_name);
    fclose(out);
    return 0;
}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Shared libraries with SONAMEs and the static helper, compiled once."""
    out = tmp_path_factory.mktemp("built")
    src = out / "f.c"
    src.write_text("int f(void) { return 1; }\n")
    for name, (_, soname) in LIBS.items():
        subprocess.run(
            ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out / name), str(src)], check=True
        )
    (out / "helper.c").write_text(HELPER_C)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(out / "helper"), str(out / "helper.c")], check=True)
    return out


@pytest.fixture(scope="module")
def container():
    """A process in a private mount namespace; yields (pid, open fd of its mount namespace)."""
    proc = private_mount_sleeper()
    fd = os.open(f"/proc/{proc.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    yield proc.pid, fd
    os.close(fd)
    proc.kill()
    proc.wait()


def sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def mounts_mentioning(text: str, path: str = "/proc/self/mountinfo") -> list[str]:
    with open(path) as fh:
        return sorted(line for line in fh if text in line)


@pytest.fixture(autouse=True)
def nothing_leaks(container, tmp_path_factory):
    """Host: our ns, the mounts under this session's temp dirs and the host's ld.so.cache stay
    as they were (others may mount elsewhere meanwhile). Container: its whole mount table."""
    pid, _ = container
    top = str(tmp_path_factory.getbasetemp())
    before = (
        os.readlink("/proc/self/ns/mnt"),
        mounts_mentioning(top),
        sha256("/etc/ld.so.cache"),
        mounts_mentioning("", f"/proc/{pid}/mountinfo"),
    )
    yield
    after = (
        os.readlink("/proc/self/ns/mnt"),
        mounts_mentioning(top),
        sha256("/etc/ld.so.cache"),
        mounts_mentioning("", f"/proc/{pid}/mountinfo"),
    )
    assert after == before


def make_rootfs(base, built) -> str:
    root = base / "rootfs"
    for sub in ("etc/ld.so.conf.d", "proc", "dev", "sys", "bin", "sbin", "tmp"):
        (root / sub).mkdir(parents=True)
    (root / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (root / "etc/ld.so.conf.d/a.conf").write_text("/usr/lib/a\n")
    for name, (directory, _) in LIBS.items():
        target = root / directory.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(built / name, target / name)
    shutil.copy("/bin/busybox", root / "bin/busybox")
    os.symlink("busybox", root / "bin/sh")
    return str(root)


def cache_entries(rootfs: str) -> dict[str, str]:
    """SONAME -> path, as the host's ldconfig reads the container's cache."""
    out = subprocess.run(
        ["ldconfig", "-p", "-C", f"{rootfs}/etc/ld.so.cache"], check=True, capture_output=True, text=True
    ).stdout
    entries = {}
    for line in out.splitlines()[1:]:
        if "=>" in line:
            left, path = line.split("=>")
            entries[left.split()[0]] = path.strip()
    return entries


def run(container, rootfs: str, **kwargs) -> None:
    _, fd = container
    kwargs.setdefault("deadline", 10)
    run_ldconfig(fd, rootfs, ["/usr/lib/nvc"], **kwargs)


def test_builds_the_cache_and_soname_links_inside_the_rootfs(container, tmp_path, built):
    rootfs = make_rootfs(tmp_path, built)
    run(container, rootfs)
    assert cache_entries(rootfs) == {
        "libfoo.so.1": "/usr/lib/a/libfoo.so.1",  # from the image's ld.so.conf.d
        "libbar.so.2": "/usr/lib/nvc/libbar.so.2",  # from the command line
        "libbaz.so.3": "/usr/lib/nvc/libbaz.so.3",
    }
    for name, (directory, soname) in LIBS.items():
        assert os.readlink(f"{rootfs}{directory}/{soname}") == name


def test_missing_ld_so_conf_still_scans_the_given_directories(container, tmp_path, built):
    rootfs = make_rootfs(tmp_path, built)
    os.unlink(f"{rootfs}/etc/ld.so.conf")
    run(container, rootfs)
    assert set(cache_entries(rootfs)) == {"libbar.so.2", "libbaz.so.3"}


def test_cache_symlink_to_a_host_file_is_replaced_not_followed(container, tmp_path, built):
    rootfs = make_rootfs(tmp_path, built)
    sentinel = tmp_path / "host" / "precious"
    sentinel.parent.mkdir()
    sentinel.write_text("host data\n")
    os.symlink(str(sentinel), f"{rootfs}/etc/ld.so.cache")
    run(container, rootfs)
    assert sentinel.read_text() == "host data\n"
    assert not os.path.islink(f"{rootfs}/etc/ld.so.cache")
    assert "libbar.so.2" in cache_entries(rootfs)


def test_include_loop_ends_quickly(container, tmp_path, built):
    """glibc's ldconfig follows the loop until it runs out of fds; with 64 that is at once."""
    rootfs = make_rootfs(tmp_path, built)
    (tmp_path / "rootfs/etc/ld.so.conf.d/loop.conf").write_text("include /etc/ld.so.conf\n")
    start = time.monotonic()
    run(container, rootfs)
    assert time.monotonic() - start < 5
    assert {"libbar.so.2", "libbaz.so.3"} <= set(cache_entries(rootfs))


def test_include_explosion_ends_at_once(container, tmp_path, built):
    """Two includes of itself per level make 2**depth reads for glibc's ldconfig (the fd limit
    bounds the depth, not the work; before the sandbox read the configuration itself only the
    CPU rlimit ended it, as SIGXCPU after 10 s). Our reader skips a file that includes itself:
    the run succeeds at once, with every library."""
    rootfs = make_rootfs(tmp_path, built)
    with open(f"{rootfs}/etc/ld.so.conf", "a") as fh:
        fh.write("include /etc/ld.so.conf\n")
    (tmp_path / "rootfs/etc/ld.so.conf.d/loop.conf").write_text("include /etc/ld.so.conf\n")
    start = time.monotonic()
    run(container, rootfs)
    assert time.monotonic() - start < 2
    assert {"libbar.so.2", "libbaz.so.3"} <= set(cache_entries(rootfs))


def host_escape_config(tmp_path, built, rootfs: str, pid: int) -> None:
    """Make the image's ld.so.conf point at a host library dir through ``/proc/PID/root``.
    A sandbox that showed the host's procfs would put ``libhost.so.9`` into the cache."""
    hostlib = tmp_path / "hostlibs"
    hostlib.mkdir()
    shutil.copy(built / "libfoo.so.1.2.3", hostlib / "libhost.so.9")
    hostconf = tmp_path / "hostconf"
    hostconf.mkdir()
    (hostconf / "evil.conf").write_text(f"/proc/{pid}/root{hostlib}\n")
    if not os.path.isfile(f"/proc/{pid}/root{hostconf}/evil.conf"):
        pytest.skip(f"PID {pid} lives in another mount namespace")
    (tmp_path / "rootfs/etc/ld.so.conf").write_text(f"include /proc/{pid}/root{hostconf}/*.conf\n")


def assert_no_host_library(tmp_path, rootfs: str) -> None:
    entries = cache_entries(rootfs)
    assert set(entries) == {"libbar.so.2", "libbaz.so.3"}
    assert not os.path.exists(tmp_path / "hostlibs/libfoo.so.1")  # no SONAME link made on the host


@pytest.fixture
def runc_like(tmp_path, built):
    """A container namespace whose rootfs already has the host's procfs on ``/proc``, as runc
    leaves it at prestart time. Yields (rootfs, mount namespace fd)."""
    rootfs = make_rootfs(tmp_path, built)
    script = 'mount -t proc proc "$1/proc" && exec sleep 300'
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "-", rootfs])
    mountinfo = f"/proc/{proc.pid}/mountinfo"
    end = time.monotonic() + 10
    while not any(line.split()[4] == f"{rootfs}/proc" for line in mounts_mentioning(rootfs, mountinfo)):
        assert time.monotonic() < end and proc.poll() is None, "could not prepare the container's /proc"
        time.sleep(0.01)
    fd = os.open(f"/proc/{proc.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    before = mounts_mentioning("", mountinfo)
    yield rootfs, fd
    assert mounts_mentioning("", mountinfo) == before
    os.close(fd)
    proc.kill()
    proc.wait()


@pytest.fixture
def capless_host_process():
    """A host process as uid 0 without capabilities: the sandbox, also uid 0 without
    capabilities, passes the ptrace check for its ``/proc/PID/root`` if it can see it at all."""
    proc = subprocess.Popen(["setpriv", "--inh-caps=-all", "--bounding-set=-all", "sleep", "300"])
    end = time.monotonic() + 10
    while os.readlink(f"/proc/{proc.pid}/exe") != "/usr/bin/sleep":
        assert time.monotonic() < end, "setpriv did not start sleep"
        time.sleep(0.01)
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("target", ["init", "capless"])
def test_the_containers_host_procfs_is_replaced(runc_like, tmp_path, built, capless_host_process, target):
    """``/proc/1/root`` (or any host PID's root) must not lead out: the sandbox mounts a fresh
    procfs of its own PID namespace over the host one, where PID 1 is the sandbox itself."""
    rootfs, fd = runc_like
    host_escape_config(tmp_path, built, rootfs, 1 if target == "init" else capless_host_process)
    run_ldconfig(fd, rootfs, ["/usr/lib/nvc"], deadline=10)
    assert_no_host_library(tmp_path, rootfs)


def test_a_proc_symlink_is_left_alone(container, tmp_path, built):
    rootfs = make_rootfs(tmp_path, built)
    os.rmdir(f"{rootfs}/proc")
    os.symlink("/", f"{rootfs}/proc")
    host_escape_config(tmp_path, built, rootfs, os.getpid())
    run(container, rootfs)
    assert_no_host_library(tmp_path, rootfs)
    assert os.readlink(f"{rootfs}/proc") == "/"


def test_the_images_ldconfig_never_runs(container, tmp_path, built):
    rootfs = make_rootfs(tmp_path, built)
    host_marker = tmp_path / "host-marker"
    script = f"#!/bin/sh\necho pwned > /marker\necho pwned > {host_marker}\n"
    for name in ("sbin/ldconfig", "sbin/ldconfig.real"):
        path = f"{rootfs}/{name}"
        with open(path, "w") as fh:
            fh.write(script)
        os.chmod(path, 0o755)
    run(container, rootfs)
    assert not os.path.exists(f"{rootfs}/marker")
    assert not host_marker.exists()
    assert "libbar.so.2" in cache_entries(rootfs)


def report(rootfs: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    with open(f"{rootfs}/report") as fh:
        for line in fh:
            key, _, value = line.rstrip("\n").partition(" ")
            found.setdefault(key, []).append(value)
    return found


def helper_rootfs(tmp_path, built, mode: str) -> str:
    rootfs = make_rootfs(tmp_path, built)
    (tmp_path / "rootfs/mode").write_text(mode)
    return rootfs


def test_sandbox_seen_from_inside(container, tmp_path, built, monkeypatch):
    rootfs = helper_rootfs(tmp_path, built, "report")
    monkeypatch.setenv("LD_PRELOAD", "/tmp/evil.so")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    run(container, rootfs, ldconfig_host_path=str(built / "helper"))
    monkeypatch.delenv("LD_PRELOAD")
    seen = report(rootfs)
    # the image's configuration, flattened by the sandbox into its /dev cover
    assert seen["argv"] == ["ldconfig", "-f", "/dev/ld.so.conf", "-C", "/etc/ld.so.cache", "/usr/lib/nvc"]
    assert seen["env"] == ["0"]
    # nothing else from the host, not even the program: stdio, and the rootfs lock, which is
    # held through an fd of the sandbox's own "/" (so it lasts until ldconfig exits)
    assert seen["fd"] == ["0", "1", "2", "4"]
    assert seen["fdlink"][3] == "4 / root"
    assert seen["pid"] == ["1"]  # init of its own PID namespace ...
    assert seen["proc"] == ["1"]  # ... and the only process its /proc shows
    status = dict(line.split(":", 1) for line in seen["status"])
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps].strip(), 16) == 0, caps
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"           # a filter is installed (mode 2)
    assert status["Seccomp_filters"].strip() == "1"   # ours, only
    assert status["Uid"].split() == ["0"] * 4
    assert status["Groups"].strip() == ""
    netdevs = [line.split(":")[0].strip() for line in seen["netdev"][2:]]
    assert netdevs == ["lo"]
    mountpoints = sorted(line.split()[4] for line in seen["mount"])
    assert mountpoints == ["/", "/dev", "/proc", "/sys"]
    for line in seen["mount"]:
        fields = line.split()
        options = fields[5].split(",")
        assert "nosuid" in options and "nodev" in options, line
        if fields[4] != "/":
            assert "ro" in options, line
    assert seen["devwrite"] == ["Read-only file system"]


def test_runs_as_the_given_ids(container, tmp_path, built):
    rootfs = helper_rootfs(tmp_path, built, "report")
    os.chown(rootfs, 1234, 5678)
    run(container, rootfs, ldconfig_host_path=str(built / "helper"), uid=1234, gid=5678)
    status = dict(line.split(":", 1) for line in report(rootfs)["status"])
    assert status["Uid"].split() == ["1234"] * 4
    assert status["Gid"].split() == ["5678"] * 4
    assert int(status["CapEff"].strip(), 16) == 0


def test_failure_carries_ldconfigs_message_escaped(container, tmp_path, built):
    rootfs = helper_rootfs(tmp_path, built, "fail")
    program = str(built / "helper")
    with pytest.raises(NvcError) as info:
        run(container, rootfs, ldconfig_host_path=program)
    assert info.value.category == "ldcache"
    # one line: what failed and its last line (the fatal one); the warning before it is in the
    # --debug trace only, and the escape sequence is escaped
    assert info.value.detail == f"process {program} failed with error code: 3: helper: fatal \\x1b[31mred"


def test_unwritable_etc_is_reported(container, tmp_path, built):
    rootfs = make_rootfs(tmp_path, built)
    with pytest.raises(NvcError) as info:
        run(container, rootfs, uid=1000, gid=1000)
    assert info.value.category == "ldcache"
    assert "failed with error code: 1" in info.value.detail
    assert "/etc/ld.so.cache~: Permission denied" in info.value.detail


def memfd_ldconfig_processes() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/exe").startswith("/memfd:ldconfig"):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_deadline_kills_the_sandbox(container, tmp_path, built):
    rootfs = helper_rootfs(tmp_path, built, "spin")
    with pytest.raises(NvcError, match=r"^timeout error: ldconfig: timed out after 1s$"):
        run(container, rootfs, ldconfig_host_path=str(built / "helper"), deadline=1)
    end = time.monotonic() + 5
    while memfd_ldconfig_processes():
        assert time.monotonic() < end, "the sandboxed process survived the deadline"
        time.sleep(0.05)


def test_runs_on_one_rootfs_wait_for_each_other(container, tmp_path, built):
    """glibc's ldconfig writes through the fixed name /etc/ld.so.cache~, so two runs on one
    rootfs must not overlap: a run waits while the rootfs's lock is held, and ldconfig itself
    holds it for as long as it runs (the sandbox hands it the locked fd)."""
    rootfs = helper_rootfs(tmp_path, built, "spin")
    lock = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (tmp_path / "rootfs/mode").write_text("report")
        with pytest.raises(NvcError, match=r"^timeout error: ldconfig: timed out after 1s$"):
            run(container, rootfs, ldconfig_host_path=str(built / "helper"), deadline=1)
        assert not os.path.exists(f"{rootfs}/report")   # it never ran
        fcntl.flock(lock, fcntl.LOCK_UN)

        (tmp_path / "rootfs/mode").write_text("spin")
        pid = os.fork()
        if pid == 0:   # a run that holds the lock until its deadline
            try:
                run(container, rootfs, ldconfig_host_path=str(built / "helper"), deadline=3)
            finally:
                os._exit(0)
        try:
            end = time.monotonic() + 2.5
            while not memfd_ldconfig_processes():
                assert time.monotonic() < end, "the spinning run did not start"
                time.sleep(0.02)
            with pytest.raises(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.waitpid(pid, 0)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)   # free once it was killed
    finally:
        os.close(lock)


def test_dynamic_program_is_refused(container, tmp_path, built):
    rootfs = make_rootfs(tmp_path, built)
    with pytest.raises(NvcError, match="/bin/true: not a static executable"):
        run(container, rootfs, ldconfig_host_path="/bin/true")
    assert not os.path.exists(f"{rootfs}/etc/ld.so.cache")


@pytest.mark.parametrize("directory", ["usr/lib", "-p", "/x\0y"])
def test_directory_arguments_must_be_absolute(container, tmp_path, built, directory):
    rootfs = make_rootfs(tmp_path, built)
    with pytest.raises(NvcError, match="invalid library directory"):
        run_ldconfig(container[1], rootfs, [directory])


def test_static_elf_check():
    with open("/sbin/ldconfig", "rb") as fh:
        assert static_elf_problem(fh.read()) is None
    with open("/bin/true", "rb") as fh:
        assert "program interpreter" in static_elf_problem(fh.read())
    assert static_elf_problem(b"#!/bin/sh\n" + b"\0" * 100) == "not an ELF file"
    with open("/sbin/ldconfig", "rb") as fh:
        head = fh.read(64)  # program headers cut off
    assert static_elf_problem(head) == "damaged program header table"


# --- the program copy: made once, kept while the host file is unchanged ----------------------


def own_helper(tmp_path, built) -> str:
    """A copy of the helper at a path of this test's own: nothing kept from other tests."""
    path = tmp_path / "bin" / "helper"
    path.parent.mkdir()
    shutil.copy(built / "helper", path)
    return str(path)


def exe_seen(container, rootfs: str, program: str) -> tuple[int, int]:
    """Inode and mode of the program the sandbox ran (its memfd, seen from inside)."""
    run(container, rootfs, ldconfig_host_path=program)
    seen = report(rootfs)
    os.unlink(f"{rootfs}/report")
    return int(seen["exe"][0]), int(seen["exemode"][0], 8)


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def test_prepared_copy_is_what_every_run_and_forked_child_runs(container, tmp_path, built):
    """What ``nvcontainer serve`` does: prepare once, then each forked request child runs the
    same sealed memfd instead of copying the host file again."""
    rootfs = helper_rootfs(tmp_path, built, "report")
    program = own_helper(tmp_path, built)
    before = open_fds()
    ldconfig.prepare(program)
    (memfd,) = open_fds() - before
    assert os.readlink(f"/proc/self/fd/{memfd}").startswith("/memfd:ldconfig")
    kept = os.fstat(memfd).st_ino
    assert exe_seen(container, rootfs, program) == (kept, 0o555)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if exe_seen(container, rootfs, program)[0] == kept else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert exe_seen(container, rootfs, program)[0] == kept
    assert open_fds() == before | {memfd}


def test_kept_copy_cannot_be_changed(tmp_path, built):
    program = own_helper(tmp_path, built)
    before = open_fds()
    ldconfig.prepare(program)
    (memfd,) = open_fds() - before
    seals = fcntl.fcntl(memfd, fcntl.F_GET_SEALS)
    for seal in (fcntl.F_SEAL_WRITE, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_SEAL):
        assert seals & seal
    with pytest.raises(PermissionError):
        os.pwrite(memfd, b"\0", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(memfd, 0)
    with pytest.raises(PermissionError):
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, 0)  # the seal set itself is sealed
    if seal_exec_supported():
        with pytest.raises(PermissionError):
            os.fchmod(memfd, 0o444)
    assert stat.S_IMODE(os.fstat(memfd).st_mode) == 0o555


def seal_exec_supported() -> bool:
    """F_SEAL_EXEC (Linux >= 6.3), tried on a scratch memfd."""
    fd = os.memfd_create("probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0x20)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_a_changed_host_program_is_copied_again(container, tmp_path, built):
    rootfs = helper_rootfs(tmp_path, built, "report")
    program = own_helper(tmp_path, built)
    first = exe_seen(container, rootfs, program)
    assert exe_seen(container, rootfs, program) == first
    # Rewritten in place (same inode, new mtime and ctime): a new copy.
    with open(program, "r+b") as fh:
        data = fh.read()
        fh.seek(0)
        fh.write(data)
    second = exe_seen(container, rootfs, program)
    assert second[0] != first[0]
    # Replaced by a dynamic program: checked again, and refused.
    os.rename(shutil.copy("/bin/true", f"{program}.new"), program)
    with pytest.raises(NvcError, match="not a static executable"):
        run(container, rootfs, ldconfig_host_path=program)


@pytest.mark.parametrize("how", ["tamper", "touch"])
def test_a_tampered_copy_is_not_run_again(container, tmp_path, built, how):
    """The sandbox runs as uid 0 and owns the memfd, so it may change its metadata (the seals
    stop writes, and on Linux >= 6.3 changes of the exec bits): the next run must not use it."""
    rootfs = helper_rootfs(tmp_path, built, how)
    program = own_helper(tmp_path, built)
    before = open_fds()
    run(container, rootfs, ldconfig_host_path=program)
    seen = report(rootfs)
    assert seen.get("exewrite", ["refused"]) != ["ok"]
    tampered = int(seen["exe"][0])
    (tmp_path / "rootfs/mode").write_text("report")
    inode, mode = exe_seen(container, rootfs, program)
    assert mode == 0o555
    if seen["exechange"] == ["ok"]:
        assert inode != tampered
    else:
        assert inode == tampered
    assert len(open_fds() - before) == 1  # a spoiled copy was closed, not leaked


def test_a_reused_fd_number_is_left_alone(container, tmp_path, built):
    """Someone closed the kept memfd and the number now names another file, even one that
    looks the same (a sealed 0555 memfd): a new copy is made, the other file is neither run
    nor closed."""
    rootfs = helper_rootfs(tmp_path, built, "report")
    program = own_helper(tmp_path, built)
    before = open_fds()
    ldconfig.prepare(program)
    (memfd,) = open_fds() - before
    impostor = os.memfd_create("ldconfig", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    with open(program, "rb") as fh:
        os.write(impostor, fh.read())
    os.fchmod(impostor, 0o555)
    fcntl.fcntl(impostor, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
                | fcntl.F_SEAL_SEAL)
    os.dup2(impostor, memfd)
    os.close(impostor)
    try:
        inode, _ = exe_seen(container, rootfs, program)
        assert inode != os.fstat(memfd).st_ino
        assert os.readlink(f"/proc/self/fd/{memfd}").startswith("/memfd:ldconfig")  # still open
    finally:
        os.close(memfd)


@pytest.mark.parametrize("program, problem", [
    ("/bin/true", "/bin/true: not a static executable (it has a program interpreter)"),
    ("/etc", "/etc is not a regular file"),
    ("/nonexistent/ldconfig", "cannot open /nonexistent/ldconfig: No such file or directory"),
])
def test_prepare_refuses_what_a_run_would(program, problem):
    before = open_fds()
    with pytest.raises(NvcError) as info:
        ldconfig.prepare(program)
    assert info.value.category == "ldcache"
    assert info.value.detail == problem
    assert open_fds() == before


def test_copy_is_bounded(tmp_path, monkeypatch):
    """By the size the file claims, and by what it really holds (procfs files claim 0)."""
    monkeypatch.setattr(sealed, "MAX_BINARY", 4096)
    big = tmp_path / "big"
    big.write_bytes(b"\x7fELF" + b"\0" * 5000)
    with open("/proc/self/maps", "rb") as fh:
        assert len(fh.read()) > 4096 and os.stat("/proc/self/maps").st_size == 0
    before = open_fds()
    for program in (str(big), "/proc/self/maps"):
        with pytest.raises(NvcError, match=f"^ldcache error: {program} is larger than 4096 bytes$"):
            ldconfig.prepare(program)
    assert open_fds() == before


def test_copy_without_sendfile(container, tmp_path, built, monkeypatch):
    """A filesystem that cannot splice: the copy goes through user space, same result."""
    def no_sendfile(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "sendfile", no_sendfile)
    rootfs = helper_rootfs(tmp_path, built, "report")
    program = own_helper(tmp_path, built)
    run(container, rootfs, ldconfig_host_path=program)
    assert report(rootfs)["argv"][0] == "ldconfig"


def _raise_ambient(cap: int) -> None:
    """Put ``cap`` into this process's inheritable and ambient sets."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()  # {effective, permitted, inheritable} x 2
    assert libc.capget(header, data) == 0
    data[2] |= 1 << cap
    assert libc.capset(header, data) == 0
    assert libc.prctl(47, 2, cap, 0, 0) == 0  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE


def test_inherited_inheritable_and_ambient_capabilities_are_cleared(container, tmp_path, built):
    """A hook may be started with ambient capabilities; ldconfig still gets none."""
    rootfs = helper_rootfs(tmp_path, built, "report")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _raise_ambient(13)  # CAP_NET_RAW
            with open("/proc/self/status") as fh:
                ambient = next(int(line.split()[1], 16) for line in fh if line.startswith("CapAmb:"))
            if ambient == 1 << 13:
                run(container, rootfs, ldconfig_host_path=str(built / "helper"))
                code = 0
            else:
                code = 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    status = dict(line.split(":", 1) for line in report(rootfs)["status"])
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[caps].strip(), 16) == 0, caps
