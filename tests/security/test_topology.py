"""Mount topology: where the rootfs and its targets live decides where our mounts and files land.

* Shared propagation: a rootfs that is a peer of a mount outside the container would carry
  every mount we make back out (SECURITY.md §3.2 item 6). The run must refuse, and the
  outside world's mount table must not change.
* Host directories bind-mounted over targets (volumes): nothing may be created in, or written
  to, the host directory, neither by the mount step (placeholders, links) nor by ldconfig
  (SONAME links, the cache), and a host file bind-mounted over a target is covered, never
  changed.
* A restart after the image tampered with what the last run created (placeholders turned into
  symlinks to host files, links into directories, the cache into a link to the host's cache):
  the second run is exactly as careful as the first.
* A read-only rootfs: the direct path fails with one line where it would have to create
  something; runtimes make the rootfs read-only only after the prestart hooks, so there it
  works and the container still cannot write to its rootfs.
* User namespaces: the container's mounts live in a namespace owned by another user
  namespace; the hook places its mounts, leaves the devices cgroup alone with a warning (the
  runtime's rules decide), and the container sees its libraries owned by its own root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from tests.security import _support as s
from tests.security.conftest import RUN_SECONDS, fresh_image, mounts_of


def _tree(path) -> dict:
    """Names, types, sizes, inodes and contents below ``path`` (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [".", *dirnames, *filenames]:
            p = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(p)
            content = None
            if os.path.islink(p):
                content = os.readlink(p)
            elif os.path.isfile(p):
                content = hashlib.sha256(open(p, "rb").read()).hexdigest()
            out[os.path.relpath(p, path)] = (st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns, content)
    return out


# --- shared propagation ------------------------------------------------------------------------


@pytest.mark.parametrize("variant", (s.DIRECT_V1, s.DIRECT_FALLBACK), ids=str)
def test_shared_rootfs_is_refused_direct(sec_machine, workdir, variant):
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    with s.Container(rootfs, shared=True) as c:
        world_before = mounts_of(c.world_pid)
        res = subprocess.run(s.configure_command(machine, variant, c.pid, rootfs), capture_output=True, text=True,
                             timeout=RUN_SECONDS)
        assert mounts_of(c.world_pid) == world_before, "a mount propagated out of the container"
        line = s.one_line(res.stderr, "nvcontainer: ")
        assert "shared propagation" in line, line
        assert c.cgroup.rules() == set(), "refused, but devices were allowed"


def _shared_prelude(bundle) -> str:
    rootfs = bundle / "rootfs"
    return f'mount --bind "{rootfs}" "{rootfs}" && mount --make-shared "{rootfs}"'


@pytest.mark.parametrize("propagation", ["shared", "rslave"])
@pytest.mark.parametrize("variant", s.variants((s.RUNC_V1, s.CRUN_V1), s.RUNTIMES), ids=str)
def test_shared_rootfs_under_a_runtime(sec_machine, workdir, variant, propagation):
    """The bundle's rootfs is a shared mount in the runtime's world, and the spec asks for
    ``rootfsPropagation`` shared or the default slave. Whatever the runtime makes of it (runc
    1.1.5 and crun 1.8.1 give the container private copies either way), our hook adds nothing
    to the runtime's world: it refuses where the container's rootfs mount is a shared one,
    and succeeds otherwise."""
    s.need_runtime(variant, sec_machine)
    machine = sec_machine

    def spec(sp):
        sp["linux"]["rootfsPropagation"] = propagation

    runs = {}
    for hooked in (False, True):
        bundle, record = s.make_runtime_bundle(machine, workdir, variant, our_hook=hooked, extra_spec=spec)
        runs[hooked] = s.run_runtime(machine, workdir, variant, bundle=bundle, record=record,
                                     prelude=_shared_prelude(bundle))
    control, run = runs[False], runs[True]
    s.runtime_refuses(variant, control)
    out = run.outcome
    assert out.hook_ran, out.runtime_stderr
    ours = [m for m in out.host_mounts_in_rootfs if m.startswith("runtime namespace:")]
    assert not ours, f"our hook's mounts reached the runtime's world: {ours}"
    rootfs_shared = any(line.split()[4] == str(run.rootfs) and "shared:" in line
                        for line in run.record["before"].splitlines())
    if rootfs_shared:
        line = s.one_line(out.stderr, "nvcontainer-hook: ")
        assert "shared propagation" in line, line
        assert "DONE" not in out.facts
    else:
        assert out.returncode == 0 and "DONE" in out.facts, out.stderr or out.runtime_stderr
        assert run.granted == s.expected_allowed(machine)


# --- host directories over targets -------------------------------------------------------------

@pytest.mark.parametrize("variant", s.variants((s.DIRECT_V1, s.RUNC_V1)), ids=str)
def test_host_dir_over_the_library_dir(sec_machine, workdir, variant):
    """A host directory bind-mounted over the library directory: no placeholder or link may be
    created in it (CVE-2024-0133 class), so the GPU container is refused with one line."""
    _volume_case(sec_machine, workdir, variant, s.LIB_DIR, lambda v: (v / "hostlib.so").write_text("host\n"),
                 expect_ok=False, contains="host filesystem mounted into the container")


@pytest.mark.parametrize("variant", s.variants((s.DIRECT_V1, s.RUNC_V1, s.CRUN_V1)), ids=str)
def test_host_dir_scanned_by_ldconfig(sec_machine, workdir, variant):
    """A volume listed in the image's ld.so.conf holding a library without its SONAME link:
    ldconfig inside the container must not create that link in the host directory."""
    def populate(volume):
        shutil.copy("/usr/lib/x86_64-linux-gnu/libz.so.1", volume / "libhostz.so.1.2.3")

    def image(rootfs):
        (rootfs / "opt/vol").mkdir(parents=True, exist_ok=True)
        (rootfs / "etc/ld.so.conf.d/vol.conf").write_text("/opt/vol\n")

    _volume_case(sec_machine, workdir, variant, "opt/vol", populate, image=image, expect_ok=True)


@pytest.mark.parametrize("variant", s.variants((s.DIRECT_V1, s.RUNC_V1)), ids=str)
def test_host_dir_over_etc(sec_machine, workdir, variant):
    """/etc is a host directory: the container's ld.so.cache would be the host's file. ldconfig
    must fail cleanly rather than write it."""
    def populate(volume):
        (volume / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
        (volume / "ld.so.conf.d").mkdir()
        (volume / "ld.so.cache").write_bytes(b"host cache\n")
        (volume / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")

    _volume_case(sec_machine, workdir, variant, "etc", populate, expect_ok=False, contains="ldconfig")


@pytest.mark.parametrize("variant", s.variants((s.DIRECT_V1, s.RUNC_V1)), ids=str)
def test_host_file_over_a_target(sec_machine, workdir, variant):
    """A host file bind-mounted where the driver's nvidia-smi goes: covered in the container,
    untouched on the host."""
    volume = workdir / "host-nvidia-smi"
    volume.write_text("#!/bin/sh\necho host tool\n")
    before = _tree(workdir / "host-nvidia-smi")
    rootfs = fresh_image(workdir / "rootfs", sec_machine)
    (rootfs / "usr/bin").mkdir(parents=True, exist_ok=True)
    (rootfs / "usr/bin/nvidia-smi").write_text("image\n")
    if variant.direct:
        with s.Container(rootfs, volume=f'mount --bind "{volume}" "$r/usr/bin/nvidia-smi"',
                         cgroup_version=2 if variant.cgroup2 else 1) as c:
            res = subprocess.run(s.configure_command(sec_machine, variant, c.pid, rootfs), capture_output=True,
                                 text=True, timeout=RUN_SECONDS)
            assert res.returncode == 0, res.stderr
    else:
        s.need_runtime(variant, sec_machine)
        run = s.run_runtime(sec_machine, workdir, variant, rootfs=rootfs, extra_spec=_bind("/usr/bin/nvidia-smi", volume),
                            script='echo "SMI:$(head -c 4 /usr/bin/nvidia-smi | od -c | head -1)"')
        assert run.outcome.returncode == 0, run.outcome.stderr or run.outcome.runtime_stderr
        assert "E   L   F" in run.outcome.facts["SMI"][0], run.outcome.facts
    assert _tree(volume) == before


def _bind(destination: str, source) -> callable:
    def spec(sp):
        sp["mounts"].append({"destination": destination, "type": "bind", "source": str(source),
                             "options": ["rbind", "rw"]})
    return spec


def _volume_case(machine, workdir, variant, target: str, populate, *, image=None, expect_ok=True,
                 contains: str = "") -> None:
    volume = workdir / "volume"
    volume.mkdir()
    populate(volume)
    before = _tree(volume)
    rootfs = fresh_image(workdir / "rootfs", machine)
    (rootfs / target).mkdir(parents=True, exist_ok=True)
    if image:
        image(rootfs)
    if variant.direct:
        with s.Container(rootfs, volume=f'mount --bind "{volume}" "$r/{target}"',
                         cgroup_version=2 if variant.cgroup2 else 1) as c:
            res = subprocess.run(s.configure_command(machine, variant, c.pid, rootfs), capture_output=True,
                                 text=True, timeout=RUN_SECONDS)
            if expect_ok:
                assert res.returncode == 0, res.stderr
            else:
                assert contains in s.one_line(res.stderr, "nvcontainer: ")
    else:
        s.need_runtime(variant, machine)
        run = s.run_runtime(machine, workdir, variant, rootfs=rootfs, extra_spec=_bind("/" + target, volume))
        out = run.outcome
        if expect_ok:
            assert out.returncode == 0 and "DONE" in out.facts, out.stderr or out.runtime_stderr
        else:
            assert contains in s.one_line(out.stderr, "nvcontainer-hook: ")
    after = _tree(volume)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"the host directory changed: {changed[:10]}"


# --- restarts after tampering ------------------------------------------------------------------


def _tamper(rootfs, sentinel, *, dev: bool) -> list[str]:
    """Turn what the first run created into traps; returns what was changed."""
    lib = rootfs / s.LIB_DIR
    traps = {
        lib / "libcuda.so.550.54.14": ("link", str(sentinel.victim)),
        lib / "libnvidia-ml.so.550.54.14": ("link", sentinel.upward(sentinel.victim)),
        lib / "libcuda.so.1": ("dir", None),
        lib / "libnvidia-ml.so.1": ("link", str(sentinel.lib_dir / "libvictim.so.1")),
        rootfs / "usr/bin/nvidia-smi": ("link", sentinel.upward(sentinel.victim)),
        rootfs / "run/nvidia-persistenced": ("link", str(sentinel.empty_dir)),
        rootfs / "etc/ld.so.cache": ("link", str(sentinel.tree / "etc/ld.so.cache")),
        rootfs / "usr/lib/firmware/nvidia": ("link", sentinel.upward(sentinel.empty_dir)),
    }
    if dev:
        traps[rootfs / "dev/nvidia0"] = ("link", str(sentinel.victim))
        traps[rootfs / "dev/nvidiactl"] = ("fifo", None)
    done = []
    for path, (kind, value) in traps.items():
        if not os.path.lexists(path):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        if kind == "link":
            os.symlink(value, path)
        elif kind == "dir":
            path.mkdir()
            (path / "keep").write_text("x")
        else:
            os.mkfifo(path)
        done.append(str(path.relative_to(rootfs)))
    return done


@pytest.mark.parametrize("variant", s.ALL, ids=str)
def test_restart_after_the_image_tampered(sec_machine, host_sentinel, workdir, variant):
    machine = sec_machine
    if variant.direct:
        rootfs = fresh_image(workdir / "rootfs", machine)
        with s.Container(rootfs, cgroup_version=2 if variant.cgroup2 else 1) as c:
            res = subprocess.run(s.configure_command(machine, variant, c.pid, rootfs), capture_output=True,
                                 text=True, timeout=RUN_SECONDS)
            assert res.returncode == 0, res.stderr
        assert len(_tamper(rootfs, host_sentinel, dev=True)) >= 8
        probe = s.Probe(machine, workdir / "probe")
        with s.Container(rootfs, cgroup_version=2 if variant.cgroup2 else 1) as c:
            res = subprocess.run(s.configure_command(machine, variant, c.pid, rootfs), capture_output=True,
                                 text=True, timeout=RUN_SECONDS)
            out = s.Outcome(variant.name, res.returncode, stderr=res.stderr, new_mounts=c.new_mounts(),
                            host_mounts_in_rootfs=s.mounts_under(mounts_of(), rootfs))
            assert s.check_run(out, rootfs, machine, probe.granted(c.cgroup), "nvcontainer: "), res.stderr
    else:
        s.need_runtime(variant, sec_machine)
        first = s.run_runtime(machine, workdir, variant)
        s.runtime_refuses(variant, first)
        rootfs = first.rootfs
        assert len(_tamper(rootfs, host_sentinel, dev=False)) >= 6
        run = s.run_runtime(machine, workdir, variant, rootfs=rootfs)
        assert s.check_run(run.outcome, rootfs, machine, run.granted if "DONE" in run.outcome.facts else None,
                           "nvcontainer-hook: "), run.outcome.stderr or run.outcome.runtime_stderr
    assert not host_sentinel.damage()


# --- read-only rootfs --------------------------------------------------------------------------


def test_readonly_rootfs_direct(sec_machine, workdir):
    rootfs = fresh_image(workdir / "rootfs", sec_machine)
    with s.Container(rootfs, readonly=True) as c:
        res = subprocess.run(s.configure_command(sec_machine, s.DIRECT_V1, c.pid, rootfs), capture_output=True,
                             text=True, timeout=RUN_SECONDS)
        line = s.one_line(res.stderr, "nvcontainer: ")
        assert "read-only file system" in line, line
        assert c.new_mounts() == [], "a failed run left mounts behind"
        assert c.cgroup.rules() == set()


@pytest.mark.parametrize("variant", s.variants((s.RUNC_V1, s.RUNC_V2, s.CRUN_V1), s.RUNTIMES), ids=str)
def test_readonly_rootfs_runtime(sec_machine, workdir, variant):
    s.need_runtime(variant, sec_machine)
    run = s.run_runtime(sec_machine, workdir, variant, readonly=True,
                        script='touch /nvc-written 2>/dev/null && echo "WRITABLE:yes" || echo "WRITABLE:no"')
    out = run.outcome
    assert out.returncode == 0 and "DONE" in out.facts, out.stderr or out.runtime_stderr
    assert run.granted == s.expected_allowed(sec_machine)
    assert out.facts["WRITABLE"] == ["no"]


# --- user namespaces ---------------------------------------------------------------------------

UID_BASE = 200000


def _userns(sp):
    sp["linux"]["namespaces"].append({"type": "user"})
    sp["linux"]["uidMappings"] = [{"containerID": 0, "hostID": UID_BASE, "size": 65536}]
    sp["linux"]["gidMappings"] = [{"containerID": 0, "hostID": UID_BASE, "size": 65536}]


@pytest.mark.parametrize("variant", (s.RUNC_V1, s.CRUN_V1), ids=str)
def test_user_namespace(sec_machine, workdir, variant):
    """A user-namespaced container: the hook places the driver (owned by the container's root),
    skips the devices cgroup with a warning (the runtime's rules decide, here: denied), and the
    container runs."""
    s.need_runtime(variant, sec_machine)
    machine = sec_machine
    rootfs = fresh_image(workdir / "rootfs", machine)
    subprocess.run(["chown", "-R", "-h", f"{UID_BASE}:{UID_BASE}", str(rootfs)], check=True)
    log = workdir / "debug.log"
    script = 'echo "OWNER:$(stat -c %u:%g /usr/lib/x86_64-linux-gnu/libcuda.so.1)"\n' \
             'echo "LIB:$(head -c 4 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14 | od -c | head -1)"'
    # A user namespace cannot mount a procfs where the fake machine's world covers parts of
    # /proc, so the runtime runs in the host's world and only our hook in the fake one.
    run = s.run_runtime(machine, workdir, variant, rootfs=rootfs, extra_spec=_userns, script=script,
                        hook_args=["--debug", str(log)], hook_world=True, fake_world=False)
    out = run.outcome
    assert out.returncode == 0 and "DONE" in out.facts, out.stderr or out.runtime_stderr
    assert "E   L   F" in out.facts["LIB"][0]
    assert out.facts["OWNER"] == ["0:0"], out.facts
    assert run.granted == set(), "devices allowed although the cgroup step was skipped"
    assert "user namespace: devices cgroup left alone" in log.read_text()
