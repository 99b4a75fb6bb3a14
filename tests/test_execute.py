"""``apply``: one worker places the mounts and then runs the ldconfig sandbox; the host
process does the devices cgroup step once the mounts are placed, while ldconfig runs.

Against a real "container" (``unshare -m --propagation private sleep``, a mount namespace of
its own, as runc's is at prestart) and a tiny rootfs. The cgroup step is replaced by a test
double (the container is in no devices cgroup of its own here); a static C helper stands in
for ldconfig where the test needs it to wait, spin, fail or look around.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from nvcontainer import log
from nvcontainer.apply import execute
from nvcontainer.errors import NvcError
from nvcontainer.plan.model import Ldconfig, Mount, Plan, Symlink
from tests.fixtures.namespaces import private_mount_sleeper

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="apply needs root")

# Orders come from /mode in the sandbox's (pivoted) root. "go": say /started, then wait for the
# host to create /go (exit 0) or give up after 10 s (exit 5); "spin": say /started, never end;
# "fail": complain and exit 3; "ran": leave /ran; "report": write uid, gid and open fds to /report.
HELPER_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static void mark(const char *path) { int fd = open(path, O_CREAT | O_WRONLY, 0644); if (fd >= 0) close(fd); }
int main(void) {
    char mode[16] = "";
    FILE *m = fopen("/mode", "r");
    if (m) { fgets(mode, sizeof mode, m); fclose(m); }
    if (!strncmp(mode, "go", 2)) {
        mark("/started");
        for (int i = 0; i < 5000; i++) { if (!access("/go", F_OK)) return 0; usleep(2000); }
        fprintf(stderr, "helper: no go\n");
        return 5;
    }
    if (!strncmp(mode, "spin", 4)) { mark("/started"); for (;;) {} }
    if (!strncmp(mode, "fail", 4)) { fprintf(stderr, "helper: fatal\n"); return 3; }
    if (!strncmp(mode, "ran", 3)) { mark("/ran"); return 0; }
    int open_fds[64], n_open = 0;
    for (int fd = 0; fd < 64; fd++) if (fcntl(fd, F_GETFD) != -1) open_fds[n_open++] = fd;
    FILE *out = fopen("/report", "w");
    if (!out) return 4;
    fprintf(out, "uid %d\ngid %d\n", (int)getuid(), (int)getgid());
    for (int i = 0; i < n_open; i++) fprintf(out, "fd %d\n", open_fds[i]);
    fclose(out);
    return 0;
}
"""


@pytest.fixture(scope="module")
def helper(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("helper")
    (out / "helper.c").write_text(HELPER_C)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(out / "helper"), str(out / "helper.c")], check=True)
    return str(out / "helper")


@pytest.fixture
def container():
    """A process in a private mount namespace of its own; yields its PID."""
    proc = private_mount_sleeper()
    yield proc.pid
    proc.kill()
    proc.wait()


def mounts_mentioning(text: str) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        return sorted(line for line in fh if text in line)


@pytest.fixture(autouse=True)
def host_untouched(tmp_path_factory):
    """Our mount namespace and the host's mounts under this session's temp dirs stay as they
    were (other engineers may mount elsewhere meanwhile)."""
    top = str(tmp_path_factory.getbasetemp())
    before = (os.readlink("/proc/self/ns/mnt"), mounts_mentioning(top))
    yield
    assert (os.readlink("/proc/self/ns/mnt"), mounts_mentioning(top)) == before


@pytest.fixture
def debug_log(tmp_path):
    path = tmp_path / "debug.log"
    log.open_debug(str(path))
    yield path
    log.close()


def messages(path) -> list[str]:
    return [line.split("] ", 1)[1] for line in path.read_text().splitlines() if line[:1] in "IWE"]


def make_rootfs(base, mode: str = "report", owner: tuple[int, int] = (0, 0)) -> str:
    root = base / "rootfs"
    for sub in ("etc", "proc", "dev", "sys", "usr/lib/nvc"):
        (root / sub).mkdir(parents=True)
    (root / "etc/ld.so.conf").write_text("")
    (root / "etc/hostname").write_text("box\n")
    (root / "mode").write_text(mode)
    if owner != (0, 0):
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.chown(name, *owner)
    return str(root)


def host_library(base) -> str:
    path = base / "host" / "libnvc-test.so.1.0"
    path.parent.mkdir(exist_ok=True)
    path.write_text("not really a library\n")
    return str(path)


def plan_for(pid: int, rootfs: str, source: str, helper: str | None, *, target: str = "/usr/lib/nvc/libnvc-test.so.1.0",
             cgroups: bool = True, owner: tuple[int, int] = (0, 0)) -> Plan:
    return Plan(
        gpu=True, rootfs=rootfs, pid=pid,
        mounts=(Mount(source, target, ("ro", "nosuid", "nodev")),),
        symlinks=(Symlink("/usr/lib/nvc/libnvc-test.so.1", "libnvc-test.so.1.0"),),
        ldconfig=Ldconfig(f"@{helper}", ("/usr/lib/nvc",)) if helper else None,
        cgroups=cgroups, cgroup_rules=("c 195:0 rw",), owner=owner,
    )


def wait_for(path: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.005)


def children(pid: int) -> list[int]:
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as fh:
            found += [int(c) for c in fh.read().split()]
    return found


def test_the_cgroup_step_runs_while_the_worker_runs_ldconfig(container, tmp_path, helper, debug_log, monkeypatch):
    """The helper (ldconfig's stand-in) waits for a file only the cgroup step creates, and the
    cgroup step waits for the helper to have started: in sequence (cgroups first, or ldconfig
    first in a worker of its own) neither would come, and the run would fail."""
    rootfs = make_rootfs(tmp_path, "go")

    def cgroup_step(plan, pinned, mountinfo_pid):
        wait_for(f"{rootfs}/started")
        with open(f"{rootfs}/go", "w"):
            pass
        log.info("devices cgroup: test double")

    monkeypatch.setattr(execute, "_cgroups", cgroup_step)
    execute.apply(plan_for(container, rootfs, host_library(tmp_path), helper), deadline=20)
    steps = [m for m in messages(debug_log) if m.startswith(("prepared", "placed", "devices cgroup", "ldconfig done"))]
    assert steps == ["prepared 1 detached mounts", f"placed 2 actions in {rootfs}", "devices cgroup: test double",
                     "ldconfig done"]
    # the mount and the link are the container's (it sees them), not the host's
    seen = f"/proc/{container}/root{rootfs}/usr/lib/nvc"
    assert open(f"{seen}/libnvc-test.so.1.0").read() == "not really a library\n"
    assert os.readlink(f"{seen}/libnvc-test.so.1") == "libnvc-test.so.1.0"
    assert open(f"{rootfs}/usr/lib/nvc/libnvc-test.so.1.0").read() == ""


def test_a_failing_cgroup_step_kills_and_reaps_the_worker_first(container, tmp_path, helper, monkeypatch):
    rootfs = make_rootfs(tmp_path, "spin")
    seen = {}

    def cgroup_step(plan, pinned, mountinfo_pid):
        wait_for(f"{rootfs}/started")
        # the worker placed the mounts and then became the sandboxed helper (no child of its own)
        (worker,) = [pid for pid in children(os.getpid()) if pid != container and is_sealed_program(pid)]
        assert children(worker) == []
        seen["worker"] = os.pidfd_open(worker)
        # what the sandboxed program inherited from the worker: not the namespace, not the mounts' fds
        links = [os.readlink(f"/proc/{worker}/fd/{fd}") for fd in os.listdir(f"/proc/{worker}/fd")]
        seen["links"] = links
        raise NvcError("device", "test double failed")

    monkeypatch.setattr(execute, "_cgroups", cgroup_step)
    with pytest.raises(NvcError, match="^device error: test double failed$"):
        execute.apply(plan_for(container, rootfs, host_library(tmp_path), helper), deadline=20)
    try:
        # reaped before the error came out: no longer our child at all, not even a zombie
        with pytest.raises(ChildProcessError):
            os.waitid(os.P_PIDFD, seen["worker"], os.WEXITED | os.WNOHANG)
    finally:
        os.close(seen["worker"])
    assert not any(link.startswith("mnt:") or "libnvc-test" in link for link in seen["links"]), seen["links"]


def is_sealed_program(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe").startswith("/memfd:")
    except OSError:
        return False


@pytest.mark.parametrize("with_ldconfig", [True, False])
def test_a_mount_failure_names_the_mount_and_reaches_neither_cgroup_nor_ldconfig(container, tmp_path, helper,
                                                                                  debug_log, monkeypatch,
                                                                                  with_ldconfig):
    """Placing the mounts is also a check (a shared target is refused: a "container" that is
    the host's own namespace where the pin cannot tell), so no device is granted before it
    passed."""
    rootfs = make_rootfs(tmp_path, "ran")
    granted = []
    monkeypatch.setattr(execute, "_cgroups", lambda *args: granted.append(args))
    plan = plan_for(container, rootfs, host_library(tmp_path), helper if with_ldconfig else None,
                    target="/etc/hostname/libnvc-test.so.1.0")
    with pytest.raises(NvcError) as info:
        execute.apply(plan, deadline=20)
    assert info.value.category == "mount"
    assert info.value.detail == "mount /etc/hostname/libnvc-test.so.1.0: not a directory"
    assert granted == []
    assert not os.path.exists(f"{rootfs}/ran")
    assert not any(m.startswith(("placed", "ldconfig")) for m in messages(debug_log))


def test_an_ldconfig_failure_names_ldconfig(container, tmp_path, helper, debug_log):
    rootfs = make_rootfs(tmp_path, "fail")
    with pytest.raises(NvcError) as info:
        execute.apply(plan_for(container, rootfs, host_library(tmp_path), helper, cgroups=False), deadline=20)
    assert info.value.category == "ldcache"
    assert info.value.detail == f"process {helper} failed with error code: 3: helper: fatal"
    found = messages(debug_log)
    assert f"placed 2 actions in {rootfs}" in found and "ldconfig: helper: fatal" in found
    assert "ldconfig done" not in found


def test_a_timeout_in_ldconfig_names_ldconfig(container, tmp_path, helper):
    rootfs = make_rootfs(tmp_path, "spin")
    start = time.monotonic()
    with pytest.raises(NvcError) as info:
        execute.apply(plan_for(container, rootfs, host_library(tmp_path), helper, cgroups=False), deadline=1.5)
    assert time.monotonic() - start < 5
    assert info.value.category == "timeout"
    assert info.value.detail.startswith("ldconfig: timed out after ")


def test_ldconfig_after_entries_made_as_the_owner_behind_a_root_only_directory(container, tmp_path, helper):
    """A user-namespaced container's entries are made with the worker's filesystem identity
    switched to its owner; the sandbox after them must open and lock the rootfs as root again,
    or a path through a root-only directory (an engine's state directory) is refused."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    rootfs = make_rootfs(private, "report", owner=(1234, 5678))
    plan = plan_for(container, rootfs, host_library(tmp_path), helper, cgroups=False, owner=(1234, 5678))
    execute.apply(plan, deadline=20)
    with open(f"{rootfs}/report") as fh:
        report = fh.read().split("\n")
    assert report[:2] == ["uid 1234", "gid 5678"]
    # stdio and the rootfs lock (an fd of its own "/", see test_ldconfig_sandbox), nothing else
    assert [line for line in report if line.startswith("fd ")] == ["fd 0", "fd 1", "fd 2", "fd 4"]
    st = os.lstat(f"{rootfs}/usr/lib/nvc/libnvc-test.so.1")
    assert (st.st_uid, st.st_gid) == (1234, 5678)


def test_without_ldconfig_or_without_mounts(container, tmp_path, helper, debug_log):
    rootfs = make_rootfs(tmp_path, "ran")
    execute.apply(plan_for(container, rootfs, host_library(tmp_path), None, cgroups=False), deadline=20)
    found = messages(debug_log)
    assert f"placed 2 actions in {rootfs}" in found and not any(m.startswith("ldconfig") for m in found)
    assert not os.path.exists(f"{rootfs}/ran")

    bare = Plan(gpu=True, rootfs=rootfs, pid=container, ldconfig=Ldconfig(f"@{helper}", ()), cgroups=False)
    execute.apply(bare, deadline=20)
    assert os.path.exists(f"{rootfs}/ran")
    found = messages(debug_log)
    assert found[-3] == f"placed 0 actions in {rootfs}" and found[-1] == "ldconfig done"
    # a --debug run says what placing cost the worker (docs/performance.md, Docker's section)
    assert re.fullmatch(r"placing, in the worker: began [\d.]+ ms after the hand-over; [\d.]+ ms in all, [\d.]+ ms on a CPU, "
                        r"[\d.]+ ms waiting for one, \d+ preemptions, \d+ page faults", found[-2])
