"""The container's linker cache: the image's ld.so.conf, ld.so.cache, ldconfig and loader.

The injection refreshes ``/etc/ld.so.cache`` inside the container with the *host's* static
ldconfig, sealed in a memfd and run in a sandbox (pivoted into the rootfs, fresh procfs of its
own PID namespace, no capabilities, empty environment). These cases give that ldconfig
everything a hostile image can: configuration that reaches for the host through procfs,
include loops, files that never end or block, a cache that is a link to a host file, and an
image ``ldconfig``/loader/``ld.so.preload`` that would run code if anything from the image were
ever executed. The host must stay untouched (autouse fixtures), no image program may run
(markers), and the container's cache must list the injected libraries and nothing from the host.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from . import conftest as sec
from .conftest import RUN_SECONDS, run_both
from .test_hostile_images import chardev, directory, fifo, link, put

CACHE = "etc/ld.so.cache"
CONF = "etc/ld.so.conf"
MARKER = "nvc-image-code-ran"  # what every planted program writes, inside and outside the rootfs
EVIL_C = r"""
#include <fcntl.h>
#include <unistd.h>
static void mark(const char *path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) { write(fd, "ran\n", 4); close(fd); }
}
__attribute__((constructor)) static void evil(void) { mark(HOST_MARK); mark("/" IMAGE_MARK); }
int main(void) { return 0; }
"""


def read_cache(out) -> bytes:
    with open(out.rootfs / CACHE, "rb") as fh:
        return fh.read(8 << 20)


def assert_cache_is_the_containers(out, sentinel) -> None:
    """The cache is a regular file of the rootfs, lists the injected libraries and nothing of
    the host's sentinel libraries."""
    st = os.lstat(out.rootfs / CACHE)
    assert stat.S_ISREG(st.st_mode), f"{out.path}: {CACHE} is not a regular file"
    data = read_cache(out)
    assert b"libcuda.so.1" in data and b"libnvidia-ml.so.1" in data, out.path
    assert b"libvictim" not in data and str(sentinel.lib_dir).encode() not in data, out.path


@pytest.fixture(scope="module")
def evil_programs(tmp_path_factory, sentinel_tree):
    """A static-pie program and a shared object that leave a marker in the sentinel's empty
    directory *and* at ``/<MARKER>`` wherever they run: either marker means image code ran."""
    out = tmp_path_factory.mktemp("evil")
    host_mark = f'"{sentinel_tree.base}/{MARKER}"'
    src = out / "evil.c"
    src.write_text(EVIL_C)
    defs = [f"-DHOST_MARK={host_mark}", f'-DIMAGE_MARK="{MARKER}"']
    subprocess.run(["gcc", "-static-pie", "-O1", *defs, "-o", str(out / "evil-static"), str(src)], check=True,
                   timeout=RUN_SECONDS)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", *defs, "-o", str(out / "evil.so"), str(src)], check=True,
                   timeout=RUN_SECONDS)
    return out


def no_marker(sentinel, *rootfs_list) -> None:
    assert not (sentinel.base / MARKER).exists(), "image code ran on the host"
    for rootfs in rootfs_list:
        assert not (rootfs / MARKER).exists(), f"image code ran in {rootfs}"


# --- ld.so.conf reaching for the host ---------------------------------------------------------

def _conf(text):
    return lambda r, s: (r / CONF).write_text(text(s))


CONF_CASES = [
    ("dir-proc-1-root", _conf(lambda s: f"/proc/1/root{s.lib_dir}\n")),
    ("include-proc-1-root", _conf(lambda s: f"include /proc/1/root{s.tree}/etc/ld.so.conf.d/*.conf\n")),
    ("include-mutual", lambda r, s: ((r / CONF).write_text("include /etc/ld.so.conf.d/*.conf\n"),
                                      (r / "etc/ld.so.conf.d/loop.conf").write_text("include /etc/ld.so.conf\n"))),
    ("include-500-files", lambda r, s: [(r / f"etc/ld.so.conf.d/{i:04d}.conf").write_text(f"/opt/l{i}\n")
                                        for i in range(500)]),
    ("conf-is-link-to-host", lambda r, s: put(r, CONF, link(str(s.tree / "etc/ld.so.conf")))),
    ("conf-is-zero-device", lambda r, s: put(r, CONF, chardev(1, 5))),
]


@pytest.mark.parametrize("change", [c[1] for c in CONF_CASES], ids=[c[0] for c in CONF_CASES])
def test_ld_so_conf_cannot_reach_the_host(sec_machine, host_sentinel, workdir, change):
    both = run_both(sec_machine, host_sentinel, workdir, lambda r: change(r, host_sentinel))
    for out in both.judged:
        assert_cache_is_the_containers(out, host_sentinel)


def test_ld_so_conf_fifo_is_skipped_at_once(sec_machine, host_sentinel, workdir):
    """A FIFO as ld.so.conf blocked glibc's ldconfig until the run's deadline (this case used to
    expect "timeout error: ldconfig: timed out"). The sandbox now reads the configuration
    itself, skips the FIFO with a warning and the container starts, well before the deadline."""
    config = workdir / "config.toml"
    config.write_text("deadline = 60\n")
    both = run_both(sec_machine, host_sentinel, workdir, lambda r: put(r, CONF, fifo),
                    global_args=("--config", str(config)))
    for out in both.judged:
        assert_cache_is_the_containers(out, host_sentinel)


# --- ld.so.cache that points at the host ------------------------------------------------------

CACHE_CASES = [
    ("link-absolute", lambda s: link(str(s.tree / "etc/ld.so.cache"))),
    ("link-magic", lambda s: link(f"/proc/self/root{s.tree}/etc/ld.so.cache")),
    ("fifo", lambda s: fifo),
]


@pytest.mark.parametrize("make", [c[1] for c in CACHE_CASES], ids=[c[0] for c in CACHE_CASES])
def test_ld_so_cache_link_is_replaced_not_followed(sec_machine, host_sentinel, workdir, make):
    """ldconfig writes a temporary and renames it over the name: the link itself is replaced,
    the host cache it pointed at keeps its content (autouse sentinel)."""
    both = run_both(sec_machine, host_sentinel, workdir, lambda r: put(r, CACHE, make(host_sentinel)))
    for out in both.judged:
        assert_cache_is_the_containers(out, host_sentinel)


def test_ld_so_cache_temporary_is_a_link_to_the_victim(sec_machine, host_sentinel, workdir):
    """ldconfig's own temporary name, planted as a link to a host file: glibc's ldconfig opens
    it with O_NOFOLLOW and gives up, so the run is refused; the host file is untouched
    (autouse sentinel), and would be even if it were followed (pivoted sandbox)."""
    image = lambda r: put(r, CACHE + "~", link(str(host_sentinel.victim)))
    run_both(sec_machine, host_sentinel, workdir, image,
             expect=("ldcache error", "ld.so.cache~: Too many levels of symbolic links"))


def test_ld_so_cache_directory_fails_in_one_escaped_line(sec_machine, host_sentinel, workdir):
    """ldconfig cannot replace a directory; its complaint, which carries names chosen by the
    image (here with a terminal escape and a newline), comes back as one escaped line."""
    def image(r: Path) -> None:
        put(r, CACHE, directory)
        (r / CONF).write_text("/usr/lib/x86_64-linux-gnu\n/opt/\x1b]0;owned\x07\nnvcontainer: forged line\n")

    both = run_both(sec_machine, host_sentinel, workdir, image, expect="ldcache error")
    for out in both.judged:
        assert "\x1b" not in out.stderr


# --- programs in the image are never run ------------------------------------------------------


def test_image_ldconfig_loader_and_preload_never_run(sec_machine, host_sentinel, workdir, evil_programs):
    """The image's /sbin/ldconfig, its dynamic loader, its libc and /etc/ld.so.preload are
    all booby-trapped; the host's static ldconfig uses none of them."""
    def image(r: Path) -> None:
        for rel in ("sbin/ldconfig", "usr/sbin/ldconfig", "sbin/ldconfig.real"):
            put(r, rel, lambda p: (p.write_bytes((evil_programs / "evil-static").read_bytes()), p.chmod(0o755)))
        for rel in ("lib64/ld-linux-x86-64.so.2", "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"):
            put(r, rel, lambda p: (p.write_bytes((evil_programs / "evil-static").read_bytes()), p.chmod(0o755)))
        put(r, "usr/lib/x86_64-linux-gnu/libc.so.6", lambda p: p.write_bytes((evil_programs / "evil.so").read_bytes()))
        put(r, "evil.so", lambda p: p.write_bytes((evil_programs / "evil.so").read_bytes()))
        (r / "etc/ld.so.preload").write_text("/evil.so\n")

    # the container's own `ldconfig -p` would run the trap: the probe must not use it
    both = run_both(sec_machine, host_sentinel, workdir, image)
    no_marker(host_sentinel, *(out.rootfs for out in both.judged))
    for out in both.judged:
        assert_cache_is_the_containers(out, host_sentinel)


LDCONFIG_OPTION = [
    ("container-path", "/sbin/ldconfig"),
    ("relative", "@sbin/ldconfig"),
    ("at-only", "@"),
]


@pytest.mark.parametrize("value", [c[1] for c in LDCONFIG_OPTION], ids=[c[0] for c in LDCONFIG_OPTION])
def test_ldconfig_must_be_a_host_path(sec_machine, host_sentinel, workdir, value):
    """Upstream runs the *container's* ldconfig for a value without '@'; here such values are
    refused, from the command line and from the configuration file the hook reads."""
    config = workdir / "config.toml"
    config.write_text(f"ldconfig = {json.dumps(value)}\n")
    run_both(sec_machine, host_sentinel, workdir, global_args=("--config", str(config)), expect="config error")
    rootfs = sec.fresh_image(workdir / "cli" / "rootfs", sec_machine)
    out = sec.run_configure(sec_machine, rootfs, extra=("--ldconfig", value))
    sec.assert_one_line_failure(out, "nvcontainer: input error: --ldconfig")


# --- the image's environment ------------------------------------------------------------------


def test_image_environment_never_reaches_our_processes(sec_machine, host_sentinel, workdir, evil_programs):
    """LD_PRELOAD, LD_LIBRARY_PATH and PYTHON* set by the image (CVE-2025-23266 used
    LD_PRELOAD): prestart hooks get the runtime's environment and the ldconfig sandbox an empty
    one, so nothing planted runs and Python starts normally."""
    site = workdir / "pysite"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"open({str(host_sentinel.base / MARKER)!r}, 'a').write('ran')\n")
    libdir = workdir / "evil-libs"
    libdir.mkdir()
    (libdir / "libc.so.6").write_bytes((evil_programs / "evil.so").read_bytes())
    env = [*sec.DEFAULT_ENV,
           f"LD_PRELOAD={evil_programs / 'evil.so'}:/evil.so",
           f"LD_LIBRARY_PATH={libdir}:/usr/lib/x86_64-linux-gnu",
           f"PYTHONPATH={site}", f"PYTHONSTARTUP={site / 'sitecustomize.py'}", "PYTHONHOME=/nonexistent",
           "PYTHONINSPECT=1", "PYTHONWARNINGS=error", "PYTHONMALLOC=debug"]

    def image(r: Path) -> None:
        put(r, "evil.so", lambda p: p.write_bytes((evil_programs / "evil.so").read_bytes()))

    both = run_both(sec_machine, host_sentinel, workdir, image, env=env, script="")
    no_marker(host_sentinel, both.direct.rootfs)
    # The container process itself does load the image's LD_PRELOAD (its own business): the
    # host marker it leaves is from inside the container, where that path does not exist.
    assert not (host_sentinel.base / MARKER).exists()


def test_shipped_hook_registrations_pin_env_and_stage():
    """Only the engine's registration decides the hook's environment. Ours must carry an
    explicit ``env`` (else runc < 1.3 hands createContainer hooks the image's environment, the
    NVIDIAScape vector) and run at prestart."""
    hooks = Path(__file__).resolve().parents[2] / "hooks"
    entry = json.loads((hooks / "oci-hook-entry.json").read_text())
    podman = json.loads((hooks / "oci-nvcontainer-hook.json").read_text())
    for hook in (entry, podman["hook"]):
        assert hook["env"] and all(not e.startswith(("LD_", "PYTHON")) for e in hook["env"])
        assert hook["timeout"] > 0
    assert podman["stages"] == ["prestart"]


def test_create_container_hook_without_env_gets_the_image_environment(sec_machine, host_sentinel, workdir,
                                                                     evil_programs):
    """What only the registration can prevent, shown on this machine's runc: a createContainer
    hook registered *without* ``env`` runs with the image's LD_PRELOAD (resolved in the
    container's mount namespace, cwd = rootfs), before any code of the hook runs. With our
    registration's explicit ``env`` the same image leaves no marker."""
    marker = host_sentinel.base / MARKER

    def run(with_env: bool):
        def spec(s):
            hook = {"path": sys.executable, "args": [sys.executable, "-I", "-c", "pass"]}
            if with_env:
                hook["env"] = ["PATH=/usr/bin:/bin"]
            s["hooks"]["createContainer"] = [hook]
        env = [*sec.DEFAULT_ENV, "LD_PRELOAD=/proc/self/cwd/evil.so"]
        out, rootfs = sec.run_runtime(sec_machine, workdir, lambda r: put(r, "evil.so", lambda p: p.write_bytes(
            (evil_programs / "evil.so").read_bytes())), env, our_hook=False, extra_spec=spec)
        return out, rootfs

    out, rootfs = run(with_env=True)
    assert "DONE" in out.facts, out.runtime_stderr
    assert not marker.exists()
    out, rootfs = run(with_env=False)
    leaked = marker.exists()
    if leaked:
        marker.unlink()
    else:
        pytest.skip("this runc does not pass the image environment to createContainer hooks (runc >= 1.3)")
