"""``nvcontainer install`` against a scratch node root (its own ``/etc``, ``/usr/local``, ``/run``),
run as the DaemonSet's container runs it: a process that installs, registers, writes the ready
file, and on SIGTERM puts the node back.

The tree it installs is built here as scripts/bundle lays one out (``bin/`` with the static
fronts and the served client); the engines are real: containerd's CRI (a GPU pod with the
handler ``nvidia``, ENXIO on its GPU node) and dockerd (``--runtime=nvidia``), each started with
the configuration the installer wrote, and afterwards the configuration is compared byte for
byte with what was there before. The install directory is named by the path the engines use
(a symlink outside the scratch root points into it), so the engines execute exactly the files
the installer put there. Faults are each one line, with the engine's files intact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from nvcontainer.errors import NvcError
from nvcontainer.installer import settings as installer_settings, tree
from nvcontainer.native import build as native
from nvcontainer.setup import containerd as containerd_setup
from tests.fixtures import cri, dockerd, runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.test_engines_setup import CHECKS, ENXIO, assert_gpu0, facts, need, script

VENV = Path(sys.executable).parent
CLI = [sys.executable, "-m", "nvcontainer"]
MAIN = 'version = 2\n# the operator\'s file, comments and all\n[plugins."io.containerd.grpc.v1.cri"]\n' \
       '  sandbox_image = "pause:3"\n'


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tree as scripts/bundle makes one: bin/ with what engines execute."""
    top = tmp_path_factory.mktemp("tree")
    bin_dir = top / "bin"
    bin_dir.mkdir()
    native.build(str(bin_dir / native.NAME), sys.executable)
    native.build_runtime(str(bin_dir / "nvidia-container-runtime"), sys.executable)
    for name in native.FRONT_NAMES:
        shutil.copy2(VENV / name, bin_dir / name)
    os.symlink(VENV / "python3", bin_dir / "python3")
    os.symlink(VENV / "nvcontainer", bin_dir / "nvcontainer")
    return top


@pytest.fixture(scope="module")
def node_etc(tmp_path_factory, machine) -> Path:
    """/etc/nvcontainer/config.toml of the engines' world: the fake driver root, and a hook that
    gives the container's procfs /proc/driver/nvidia first (what a real driver's has)."""
    base = tmp_path_factory.mktemp("node-etc")
    hook = script(base / "served-hook", runtime.driver_wrapper(VENV / "nvidia-container-runtime-hook"))
    etc = base / "etc"
    (etc / "nvcontainer").mkdir(parents=True)
    (etc / "nvcontainer/config.toml").write_text(
        f'[nvidia-container-cli]\nroot = "{machine.root}"\n[nvidia-container-runtime-hook]\npath = "{hook}"\n')
    return etc


def scratch(tmp_path: Path) -> tuple[Path, Path]:
    """(the host root, the install directory as the engines name it: a link into the root)."""
    host = tmp_path / "host"
    for d in ("etc", "usr/local", "run", "var/run"):
        (host / d).mkdir(parents=True, exist_ok=True)
    named = tmp_path / "nvc"
    (host / str(named).lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(host / str(named).lstrip("/"), named)
    return host, named


def containerd_config(host: Path, content: str | bytes) -> Path:
    """The node's /etc/containerd/config.toml in the scratch root, holding ``content``."""
    main = host / "etc/containerd/config.toml"
    main.parent.mkdir(parents=True)
    if isinstance(content, str):
        content = content.encode()
    main.write_bytes(content)
    return main


def env(host: Path, named: Path, source: Path, **more) -> dict:
    out = {"PATH": os.environ["PATH"], "HOST_ROOT_MOUNT": str(host), "TOOLKIT_INSTALL_DIR": str(named),
           "NVCONTAINER_SOURCE": str(source), "RUNTIME_RESTART_MODE": "none",
           "NVIDIA_RUNTIME_SET_AS_DEFAULT": "false"}
    return {**out, **{k: str(v) for k, v in more.items()}}


def start(e: dict) -> subprocess.Popen:
    p = subprocess.Popen([*CLI, "install"], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.started = time.time()
    return p


def wait_ready(p: subprocess.Popen, host: Path, timeout: float = 60) -> None:
    ready = host / "run/nvcontainer/validations/toolkit-ready"
    end = time.monotonic() + timeout
    while not (ready.exists() and ready.stat().st_mtime >= p.started):
        if p.poll() is not None or time.monotonic() > end:
            p.kill()
            raise AssertionError(f"not ready: rc {p.poll()}\n{p.communicate()[1]}")
        time.sleep(0.1)


def stop(p: subprocess.Popen) -> str:
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return err


def once(e: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "install"], env={**e, "NO_DAEMON": "true"}, capture_output=True, text=True,
                          timeout=120)


# ---- settings: NVIDIA's names --------------------------------------------------------------------


def test_settings_read_nvidias_variables_and_aliases():
    s = installer_settings.settings({"RUNTIME": "containerd", "CONTAINERD_SET_AS_DEFAULT": "false",
                                     "CONTAINERD_SOCKET": "/run/k3s/containerd/containerd.sock",
                                     "NO_CLEANUP_ON_EXIT": "1", "CDI_ENABLED": "true"}, {})
    assert (s.set_as_default, s.socket, s.no_cleanup, s.cdi, s.restart_mode) == \
        (False, "/run/k3s/containerd/containerd.sock", True, True, "signal")
    assert installer_settings.settings({"RUNTIME": "crio", "CRIO_CONFIG": "/etc/crio/crio.conf"}, {}).restart_mode \
        == "systemd"
    assert installer_settings.settings({"RUNTIME": "docker"}, {"set_as_default": False}).set_as_default is False
    for bad, word in [({"RUNTIME": "rkt"}, "RUNTIME="), ({"RUNTIME_RESTART_MODE": "kill"}, "RUNTIME_RESTART_MODE="),
                      ({"NO_CLEANUP_ON_EXIT": "maybe"}, "NO_CLEANUP_ON_EXIT="),
                      ({"CONTAINERD_RUNTIME_CLASS": "gpu"}, "CONTAINERD_RUNTIME_CLASS="),
                      ({"TOOLKIT_INSTALL_DIR": "usr/x"}, "TOOLKIT_INSTALL_DIR="),
                      ({"CONTAINERD_CONFIG": "/etc/k3s/config.toml"}, "CONTAINERD_CONFIG=")]:
        with pytest.raises(NvcError, match=word):
            installer_settings.settings(bad, {})


# ---- containerd's CRI ----------------------------------------------------------------------------


def test_containerd_cri_gpu_pod_then_sigterm_restores_byte_for_byte(machine, source, node_etc, tmp_path):
    need("containerd", "ctr", "runc")
    pytest.importorskip("grpc")
    base = cri.prepare(tmp_path / "c")
    host, named = scratch(tmp_path)
    main = containerd_config(host, (base / "config.toml").read_bytes())
    before = main.read_bytes()
    p = start(env(host, named, source))
    wait_ready(p, host)
    assert f'imports = ["{containerd_setup.DROPIN}"]' in main.read_text()
    dropin = tomllib.loads((host / containerd_setup.DROPIN.lstrip("/")).read_text())
    handler = dropin["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"]
    assert handler["options"]["BinaryName"] == f"{named}/current/bin/nvidia-container-runtime"
    assert os.readlink(named / "current").startswith("versions/")
    results, res = cri.run(machine, base, main, f"{host / 'etc'}:{node_etc}", [
        {"name": "gpu0", "handler": "nvidia", "env": ["NVIDIA_VISIBLE_DEVICES=0"], "script": CHECKS},
        {"name": "plain", "handler": "nvidia", "env": [], "script": CHECKS},
    ])
    context = f"{res.stdout}\n{res.stderr}\n{cri.log(base)}"
    got = {r["name"]: (r["rc"], r["log"]) for r in results}
    assert len(got) == 2, context
    assert_gpu0(*got["gpu0"], context)
    assert got["plain"][0] == 0 and facts(got["plain"][1])["OPEN0"] == ["absent"], context
    err = stop(p)
    assert "putting the node back" in err
    assert main.read_bytes() == before                       # byte for byte
    assert os.listdir(main.parent) == ["config.toml"] or sorted(os.listdir(main.parent)) == ["conf.d", "config.toml"]
    assert not os.listdir(main.parent / "conf.d")             # no backup, no drop-in left
    assert not (host / containerd_setup.DROPIN.lstrip("/")).exists()
    assert not (host / "run/nvcontainer/validations/toolkit-ready").exists()
    assert not os.path.lexists(named / "current") and not (named / "versions").exists()


def test_no_cleanup_on_exit_leaves_the_node_installed(source, tmp_path):
    host, named = scratch(tmp_path)
    p = start(env(host, named, source, NO_CLEANUP_ON_EXIT="true"))
    wait_ready(p, host)
    assert "left installed" in stop(p)
    assert (host / containerd_setup.DROPIN.lstrip("/")).exists() and (named / "current/bin").is_dir()


# ---- CRI-O: the drop-in, rendered and checked ----------------------------------------------------


def test_crio_dropin_rendered_checked_and_taken_back(source, tmp_path):
    host, named = scratch(tmp_path)
    (host / "etc/crio/crio.conf.d").mkdir(parents=True)
    other = host / "etc/crio/crio.conf.d/10-operator.conf"
    other.write_text('[crio.runtime]\nlog_level = "info"\n')
    p = start(env(host, named, source, RUNTIME="crio", NVIDIA_RUNTIME_SET_AS_DEFAULT="true"))
    wait_ready(p, host)
    doc = tomllib.loads((host / "etc/crio/crio.conf.d/99-nvidia.toml").read_text())
    assert doc["crio"]["runtime"] == {
        "default_runtime": "nvidia",
        "runtimes": {"nvidia": {"runtime_path": f"{named}/current/bin/nvidia-container-runtime",
                                "runtime_type": "oci"}}}
    if shutil.which("crio"):   # CRI-O itself reads it
        res = subprocess.run(["crio", "--config", "/dev/null", "--config-dir", str(host / "etc/crio/crio.conf.d"),
                              "config"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and "nvidia" in res.stdout, res.stderr
    stop(p)
    assert not (host / "etc/crio/crio.conf.d/99-nvidia.toml").exists()
    assert other.read_text() == '[crio.runtime]\nlog_level = "info"\n'


# ---- dockerd -------------------------------------------------------------------------------------


def test_dockerd_runtime_nvidia_then_sigterm_restores(machine, source, node_etc, tmp_path):
    need("dockerd", "docker", "runc")
    host, named = scratch(tmp_path)
    daemon = host / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    daemon.write_text('{\n  "log-level": "warn"\n}\n')
    before = daemon.read_bytes()
    p = start(env(host, named, source, RUNTIME="docker"))
    wait_ready(p, host)
    doc = json.loads(daemon.read_text())
    assert doc["runtimes"] == {"nvidia": {"path": f"{named}/current/bin/nvidia-container-runtime"}}
    base = dockerd.prepare(tmp_path / "d")
    run = ["run", "--rm", "--network", "none"]
    results, res = dockerd.run(machine, base, daemon, [
        [*run, "--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=0", dockerd.IMAGE, "sh", "-c", CHECKS],
        [*run, "--runtime=nvidia", dockerd.IMAGE, "sh", "-c", CHECKS],
    ], etc=node_etc, served=True)
    context = f"{res.stderr}\n{dockerd.log(base)}"
    assert len(results) == 2, context
    assert_gpu0(*results[0], context)
    assert results[1][0] == 0 and facts(results[1][1])["OPEN0"] == ["absent"], context
    served = (base / "serve.log").read_text()
    assert served.count("runtime request from pid ") == 1, served   # the GPU create, handed to the server
    stop(p)
    assert daemon.read_bytes() == before
    assert os.listdir(daemon.parent) == ["daemon.json"]      # the backup went with the restore


# ---- faults: one line, the engine's files intact, nothing left half-written -----------------------


def assert_untouched(res, host: Path, named: Path, files: dict[Path, bytes], word: str) -> None:
    assert res.returncode == 1, res.stderr
    lines = [line for line in res.stderr.splitlines() if "nvcontainer install" in line or "Error" in line]
    assert word in lines[-1] and "the engine's files are as they were" in lines[-1], res.stderr
    assert "Traceback" not in res.stderr
    for path, data in files.items():
        assert path.read_bytes() == data if not path.is_symlink() else True
    assert not (host / "run/nvcontainer/validations/toolkit-ready").exists()
    assert not os.path.lexists(named / "current")
    assert not (host / containerd_setup.DROPIN.lstrip("/")).exists()


@pytest.mark.parametrize("text, word", [
    ("version = 2\n[plugins\n", "config.toml"),
    ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
     '  BinaryName = "/usr/bin/nvidia-container-runtime"\n', "already has a runtime 'nvidia'"),
    ("version = 1\n", "config version 1"),
])
def test_a_containerd_config_it_cannot_take_is_one_line(source, tmp_path, text, word):
    host, named = scratch(tmp_path)
    main = containerd_config(host, text)
    assert_untouched(once(env(host, named, source)), host, named, {main: text.encode()}, word)


def test_docker_with_another_nvidia_runtime_is_refused(source, tmp_path):
    host, named = scratch(tmp_path)
    daemon = host / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    text = b'{"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime"}}}\n'
    daemon.write_bytes(text)
    res = once(env(host, named, source, RUNTIME="docker"))
    assert_untouched(res, host, named, {daemon: text}, "already has a runtime 'nvidia'")


def test_a_symlinked_config_is_refused_not_followed(source, tmp_path):
    host, named = scratch(tmp_path)
    real = tmp_path / "elsewhere.toml"
    real.write_text(MAIN)
    (host / "etc/containerd").mkdir(parents=True)
    os.symlink(real, host / "etc/containerd/config.toml")
    res = once(env(host, named, source))
    assert_untouched(res, host, named, {real: MAIN.encode()}, "not a regular file")
    assert os.path.islink(host / "etc/containerd/config.toml")


def _unshared(script_: str, e: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script_, "sh", *CLI,
                           "install"], env={**e, "NO_DAEMON": "true"}, capture_output=True, text=True, timeout=120)


def test_a_read_only_config_directory_leaves_everything_as_it_was(source, tmp_path):
    host, named = scratch(tmp_path)
    main = containerd_config(host, MAIN)
    d = host / "etc/containerd"
    res = _unshared(f'mount --bind {d} {d} && mount -o remount,bind,ro {d} && exec "$@"', env(host, named, source))
    assert_untouched(res, host, named, {main: MAIN.encode()}, "Read-only file system")


def test_a_read_only_usr_falls_back_to_opt_in_one_line(source, tmp_path):
    host, _ = scratch(tmp_path)
    usr = host / "usr"
    e = env(host, Path("/x"), source)
    del e["TOOLKIT_INSTALL_DIR"]
    res = _unshared(f'mount --bind {usr} {usr} && mount -o remount,bind,ro {usr} && exec "$@"', e)
    assert res.returncode == 0, res.stderr
    assert "/usr/local/nvcontainer is not writable (Read-only file system): installing into /opt/nvcontainer" \
        in res.stderr
    dropin = tomllib.loads((host / containerd_setup.DROPIN.lstrip("/")).read_text())
    handler = dropin["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"]
    assert handler["options"]["BinaryName"] == "/opt/nvcontainer/current/bin/nvidia-container-runtime"
    assert (host / "opt/nvcontainer/current/bin/nvidia-container-runtime").is_file()


def test_a_host_glibc_older_than_the_trees_is_one_line(source, tmp_path):
    host, named = scratch(tmp_path)
    lib = host / "lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libc.so.6").write_bytes(b"\x7fELF" + b"\0GLIBC_2.2.5\0GLIBC_2.17\0GLIBC_PRIVATE\0")
    dynamic = tmp_path / "tree"
    shutil.copytree(source, dynamic, symlinks=True)
    shutil.copy2("/usr/bin/true", dynamic / "bin/true")   # linked against this machine's glibc
    res = once(env(host, named, dynamic))
    assert res.returncode == 1 and "the host's glibc is 2.17; the programs to install need 2." in res.stderr
    assert not os.path.lexists(named / "current")
    # the same tree on a host as new as ours installs; a tree with its own libc needs none
    assert tree.glibc_problem(tree.tree_needs(str(dynamic)), (2, 99)) is None
    (dynamic / "lib").mkdir()
    (dynamic / "lib/libc.so.6").write_bytes(b"\x7fELF")
    assert tree.tree_needs(str(dynamic)) is None


# An engine started by a service manager has SIGHUP's default action, whatever the test runner
# has (nohup, a CI agent, ignores it, and an ignored signal is inherited and cannot be reset by
# a shell): the restart-by-signal tests depend on it.
DEFAULT_HUP = ["env", "--default-signal=HUP"]


def fake_engine(sock: Path, *, supervised: bool, pidfile: Path | None = None) -> subprocess.Popen:
    """A process answering on ``sock`` that SIGHUP ends, as it ends containerd; ``supervised``:
    started again by a loop, as systemd's Restart= would; ``pidfile``: where each start writes its pid."""
    note = f"open('{pidfile}','w').write(str(os.getpid()));" if pidfile else ""
    serve = (f"import socket,os;{note}s=socket.socket(socket.AF_UNIX);"
             f"os.path.exists('{sock}') and os.unlink('{sock}');s.bind('{sock}');s.listen(8)\n"
             "while True: s.accept()[0].close()")
    loop = f'while true; do {sys.executable} -c "{serve}"; sleep 0.2; done' if supervised else \
        f'exec {sys.executable} -c "{serve}"'
    p = subprocess.Popen([*DEFAULT_HUP, "sh", "-c", loop], start_new_session=True)
    for _ in range(100):
        if sock.exists():
            break
        time.sleep(0.05)
    return p


@pytest.mark.parametrize("supervised", [True, False])
def test_restart_by_signal_waits_for_the_engine_or_puts_its_files_back(source, tmp_path, supervised):
    host, named = scratch(tmp_path)
    main = containerd_config(host, MAIN)
    (host / "run/containerd").mkdir()
    engine_ = fake_engine(host / "run/containerd/containerd.sock", supervised=supervised)
    try:
        # a supervised engine comes back at once (the wait ends then): a loaded CI machine gets room
        res = once(env(host, named, source, RUNTIME_RESTART_MODE="signal",
                       RUNTIME_RESTART_TIMEOUT="20" if supervised else "3"))
    finally:
        os.killpg(engine_.pid, signal.SIGKILL)
        engine_.wait()
    if supervised:
        assert res.returncode == 0 and "containerd restarted (signal): answering on /run/containerd/containerd.sock" \
            in res.stderr, res.stderr
        assert containerd_setup.DROPIN in main.read_text()
    else:
        assert_untouched(res, host, named, {main: MAIN.encode()}, "did not answer on /run/containerd/containerd.sock")


SYSTEMCTL = """#!/bin/sh
echo "$*" >> /systemctl.log
{action}
"""


@pytest.mark.parametrize("works", [True, False])
def test_restart_by_systemd_runs_the_host_s_systemctl_in_its_root(source, tmp_path, works):
    """RUNTIME_RESTART_MODE=systemd: ``systemctl restart containerd`` run in the host's root
    (chroot: the host's own systemctl, never one of the image), then the wait for a new engine
    process. Here the host root is a busybox with a systemctl that restarts the supervised fake
    engine as systemd would; one that fails puts the files back, in one line."""
    host, named = scratch(tmp_path)
    main = containerd_config(host, MAIN)
    (host / "run/containerd").mkdir()
    for d in ("bin", "usr/bin"):
        (host / d).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", host / "bin/busybox")
    for applet in ("sh", "cat", "kill"):
        os.symlink("busybox", host / "bin" / applet)
    action = "kill -HUP $(cat /engine.pid)" if works else \
        "echo 'Failed to restart containerd.service: Unit containerd.service not found.' >&2; exit 5"
    script(host / "usr/bin/systemctl", SYSTEMCTL.format(action=action))
    engine_ = fake_engine(host / "run/containerd/containerd.sock", supervised=True, pidfile=host / "engine.pid")
    try:
        res = once(env(host, named, source, RUNTIME_RESTART_MODE="systemd", RUNTIME_RESTART_TIMEOUT="20"))
    finally:
        os.killpg(engine_.pid, signal.SIGKILL)
        engine_.wait()
    assert (host / "systemctl.log").read_text().splitlines()[0] == "restart containerd"
    if works:
        assert res.returncode == 0 and "containerd restarted (systemd): answering on /run/containerd/containerd.sock" \
            in res.stderr, res.stderr
        assert containerd_setup.DROPIN in main.read_text()
    else:
        assert_untouched(res, host, named, {main: MAIN.encode()}, "Unit containerd.service not found")


def test_killed_mid_install_leaves_nothing_half_written_and_the_next_run_completes(source, tmp_path):
    host, named = scratch(tmp_path)
    main = containerd_config(host, MAIN)
    for delay in (0.3, 0.5, 0.7, 0.9, 1.1):
        p = start(env(host, named, source))
        time.sleep(delay)
        p.kill()
        p.communicate()
        if os.path.lexists(named / "current"):   # points at a whole version, never a staging one
            assert (named / "current/bin/nvidia-container-runtime").is_file()
        dropin = host / containerd_setup.DROPIN.lstrip("/")
        if dropin.exists():
            tomllib.loads(dropin.read_text())                       # whole, never half
        text = main.read_text()        # as it was, or with its one imports entry: never half of one
        assert text == MAIN or (containerd_setup.DROPIN in text and tomllib.loads(text)["imports"])
    p = start(env(host, named, source))
    wait_ready(p, host)
    assert not [n for n in os.listdir(named / "versions") if n.startswith(tree.STAGING)]
    stop(p)
    assert main.read_text() == MAIN


# ---- two installers, and a rolling update -------------------------------------------------------


def test_a_second_installer_stands_by_and_takes_over_with_its_version_atomically(source, tmp_path):
    host, named = scratch(tmp_path)
    main = containerd_config(host, MAIN)
    newer = tmp_path / "newer"
    shutil.copytree(source, newer, symlinks=True)
    (newer / "VERSION").write_text("the next build\n")
    first = start(env(host, named, source))
    wait_ready(first, host)
    old = os.readlink(named / "current")
    second = start(env(host, named, newer))
    time.sleep(1.5)
    assert second.poll() is None and os.readlink(named / "current") == old   # standing by, nothing written
    seen = []
    import threading

    done = threading.Event()

    def watch():   # what a container starting meanwhile finds: always a whole version
        while not done.is_set():
            seen.append(os.path.isfile(named / "current/bin/nvidia-container-runtime")
                        and (host / containerd_setup.DROPIN.lstrip("/")).exists())

    t = threading.Thread(target=watch)
    t.start()
    err = stop(first)
    assert "another installer stands by; handing the node over as it is" in err
    for _ in range(300):
        if os.readlink(named / "current") != old:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    done.set()
    t.join()
    assert seen and all(seen)
    new = os.readlink(named / "current")
    assert new != old and (named / new / "VERSION").exists()
    assert sorted(os.listdir(named / "versions")) == sorted([os.path.basename(old), os.path.basename(new)])
    stop(second)
    assert main.read_text() == MAIN and not os.path.lexists(named / "current")


# ---- the installed programs in a root with no Python ---------------------------------------------


def busybox_node(tmp_path: Path) -> Path:
    """A node root with busybox only (no Python, no libc), and a stand-in runc that says it ran."""
    root = tmp_path / "node"
    (root / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", root / "bin/busybox")
    for tool in ("sh", "cat", "echo"):
        os.symlink("busybox", root / f"bin/{tool}")
    for d in ("etc", "usr/local", "usr/sbin", "run", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    script(root / "usr/sbin/runc", '#!/bin/sh\necho "runc $*" >> /tmp/ran\n')
    (root / "dev").mkdir()
    os.mknod(root / "dev/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return root


def test_in_a_busybox_root_a_create_without_a_gpu_never_leaves_native_code(source, tmp_path):
    root = busybox_node(tmp_path)
    res = once({**env(root, Path("/x"), source), "TOOLKIT_INSTALL_DIR": "/usr/local/nvcontainer"})
    assert res.returncode == 0, res.stderr
    assert "note: the tree is not self-contained: " in res.stderr and "bin/python3 -> " in res.stderr
    # no interpreter in the root: the tree's python3 is a link to one outside it
    assert not [p for p in root.rglob("python*") if not p.is_symlink()]
    front = "/usr/local/nvcontainer/current/bin/nvidia-container-runtime"
    for name, env_ in (("plain", []), ("gpu", ["NVIDIA_VISIBLE_DEVICES=0"])):
        b = root / "b" / name
        b.mkdir(parents=True)
        (b / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "process": {"args": ["sh"], "env": env_},
                                                   "root": {"path": "rootfs"}}))
    plain = subprocess.run([shutil.which("chroot"), str(root), front, "create", "--bundle", "/b/plain", "c1"],
                           capture_output=True, text=True, timeout=30, env={})
    assert plain.returncode == 0 and (root / "tmp/ran").read_text() == "runc create --bundle /b/plain c1\n", \
        plain.stderr
    # a GPU create needs the server or the tree's own interpreter: this tree's is outside the root,
    # so it stops with one line and runc never runs
    gpu = subprocess.run([shutil.which("chroot"), str(root), front, "create", "--bundle", "/b/gpu", "c2"],
                         capture_output=True, text=True, timeout=30, env={})
    assert gpu.returncode != 0 and len(gpu.stderr.strip().splitlines()) == 1, gpu.stderr
    assert "runtime error: cannot run" in gpu.stderr and (root / "tmp/ran").read_text().count("\n") == 1


# ---- the DaemonSet ---------------------------------------------------------------------------------


def test_the_installer_daemonset_says_what_the_code_reads():
    from tests.test_k8s_manifests import container_of, objects, one

    objs = objects("base")
    ds = one(objs, "DaemonSet", "nvcontainer-installer")
    spec = ds["spec"]["template"]["spec"]
    c = container_of(ds)
    env_ = {e["name"]: e["value"] for e in c["env"]}
    known = {n for names in installer_settings.VARIABLES.values() for n in names}
    assert set(env_) <= known, set(env_) - known
    s = installer_settings.settings(env_, {})
    assert (s.runtime, s.restart_mode, s.set_as_default, s.serve) == ("containerd", "signal", False, True)
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert spec["hostPID"] is True and spec["terminationGracePeriodSeconds"] >= 60
    for name in ("nvcontainer-device-plugin", "nvcontainer-node-labeller"):   # they wait for it
        (init,) = one(objs, "DaemonSet", name)["spec"]["template"]["spec"]["initContainers"]
        assert init["command"][3:] == ["install", "--wait-ready"]


def test_wait_ready_returns_once_the_file_is_there(tmp_path):
    ready = tmp_path / "toolkit-ready"
    p = subprocess.Popen([*CLI, "install", "--wait-ready", "--ready-file", str(ready)], stderr=subprocess.PIPE,
                         text=True)
    time.sleep(1.5)
    assert p.poll() is None
    ready.write_text("x\n")
    assert p.wait(timeout=20) == 0


# ---- the CDI spec: written for the host's driver, kept fresh --------------------------------------


def test_the_cdi_spec_names_the_installed_hook_and_is_kept_fresh(machine, source, tmp_path):
    from tests.fixtures.fakegpu.runner import fake_proc_command

    import tempfile

    # NVML is loaded by a child that drops to nobody: the driver's path must be one it may walk
    top = Path(tempfile.mkdtemp(prefix="nvc-installer-"))
    top.chmod(0o755)
    request_cleanup = top
    host, named = scratch(top)
    os.symlink(machine.root, host / "driver")          # the host's driver root, as the pod sees it
    spec = host / "var/run/cdi/nvidia.yaml"
    e = env(host, named, source, NVIDIA_DRIVER_ROOT="/driver", NVCONTAINER_CDI_REFRESH="0.3")
    p = subprocess.Popen(fake_proc_command(machine, [*CLI, "install"]), env=e, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.started = time.time()
    try:
        wait_ready(p, host)
        if not spec.exists():
            p.send_signal(signal.SIGTERM)
            raise AssertionError(p.communicate(timeout=60)[1])
        text = spec.read_text()
        assert "nvidia.com/gpu" in text.replace('"', "") or "kind: nvidia.com/gpu" in text, text[:400]
        assert f"{named}/current/bin/nvcontainer-hook" in text
        spec.unlink()                                   # gone (or stale): back within a refresh
        for _ in range(50):
            if spec.exists():
                break
            time.sleep(0.1)
        assert spec.read_text() == text
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        assert not spec.exists()                        # removed with the rest
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        shutil.rmtree(request_cleanup, ignore_errors=True)
    assert "wrote the CDI spec /var/run/cdi/nvidia.yaml" in err


def test_serve_is_refused_where_pid_1_does_not_have_the_host_root(source, tmp_path):
    host, named = scratch(tmp_path)
    res = once(env(host, named, source, NVCONTAINER_SERVE="true"))
    assert res.returncode == 0 and "does not have" in res.stderr and "not serving" in res.stderr, res.stderr


def test_dockerd_reloads_on_the_signal_and_keeps_its_pid(source, tmp_path):
    host, named = scratch(tmp_path)
    (host / "var/run").mkdir(parents=True, exist_ok=True)
    sock = host / "var/run/docker.sock"
    serve = (f"import signal,socket,os;signal.signal(signal.SIGHUP,lambda *a:open('{tmp_path}/hup','w').close());"
             f"s=socket.socket(socket.AF_UNIX);s.bind('{sock}');s.listen(8)\n"
             "while True: s.accept()[0].close()")
    engine_ = subprocess.Popen([sys.executable, "-c", serve])
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        res = once(env(host, named, source, RUNTIME="docker", RUNTIME_RESTART_MODE="signal"))
    finally:
        engine_.kill()
        engine_.wait()
    assert res.returncode == 0, res.stderr
    assert f"docker reloaded (signal): answering on /var/run/docker.sock (pid {engine_.pid})" in res.stderr
    assert (tmp_path / "hup").exists()


def test_another_nvidia_handler_in_containerd_2s_layout_is_named():
    from nvcontainer.installer import engine

    files = {"/etc/containerd/config.toml": 'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd.runtimes'
                                            '.nvidia.options]\nBinaryName = "/usr/local/nvidia/toolkit/nvidia-'
                                            'container-runtime"\n'}
    why = engine.conflict("containerd", files.get, lambda p: [], "/usr/local/nvcontainer/current/bin/x")
    assert "already has a runtime 'nvidia' (/usr/local/nvidia/toolkit/nvidia-container-runtime)" in why
    assert engine.conflict("containerd", {"/etc/containerd/config.toml": "version = 3\n"}.get, lambda p: [], "x") \
        is None


# ---- a real containerd restarted by the signal, its running containers kept ----------------------

# the world: containerd under a loop that starts it again when it exits (its service manager's
# part), a long-running pod, then (after the installer ran) that pod's state and a GPU pod
RESTART_WORLD = cri.WORLD_PRELUDE + r"""
( while [ ! -e "$base/stop" ]; do containerd --config "$config" >> "$base/containerd.log" 2>&1 || true; done ) &
""" + cri.WORLD_READY + r"""
touch "$base/stop"; pkill -x containerd; wait
exit $rc
"""

RESTART_CLIENT = r"""
import os, time
IMAGE = sys.argv[3]
def connect():
    global channel
    channel = grpc.insecure_channel("unix://" + sock)
def call(method, request):
    rpc = channel.unary_unary("/runtime.v1.RuntimeService/" + method, request_serializer=None,
                              response_deserializer=None)
    return fields(rpc(request, timeout=120))
def pod(name, handler, env, script):
    p = msg(1, msg(1, name), msg(2, "u-" + name), msg(3, "default")) + msg(3, logs) + msg(8, msg(2, msg(1, num(1, 2))))
    sandbox = call("RunPodSandbox", msg(1, p) + msg(2, handler))[1][0].decode()
    config = msg(1, msg(1, name)) + msg(2, msg(1, IMAGE)) + msg(3, "/bin/sh") + msg(3, "-c") + msg(3, script) \
        + b"".join(msg(6, msg(1, k), msg(2, v)) for k, v in (e.split("=", 1) for e in env)) + msg(11, name + ".log")
    container = call("CreateContainer", msg(1, sandbox) + msg(2, config) + msg(3, p))[1][0].decode()
    call("StartContainer", msg(1, container))
    return container
def state(container):
    return fields(call("ContainerStatus", msg(1, container))[1][0]).get(3, [0])[0]
connect()
long = pod("long", "", [], "sleep 300")
time.sleep(1)
print("BEFORE", state(long), flush=True)
open(os.path.join(logs, "..", "phase1"), "w").close()
while not os.path.exists(os.path.join(logs, "..", "phase2")):
    time.sleep(0.1)
connect()
print("AFTER", state(long), flush=True)
gpu = pod("gpu", "nvidia", ["NVIDIA_VISIBLE_DEVICES=0"], "cat /dev/nvidia0 2>&1 | head -1")
for _ in range(300):
    if state(gpu) == 2:
        break
    time.sleep(0.1)
print("GPU", open(os.path.join(logs, "gpu.log")).read().strip().split(" ", 3)[-1], flush=True)
"""


def test_containerd_restarted_by_the_signal_keeps_running_containers_and_runs_gpu_pods(
        machine, source, node_etc, tmp_path):
    need("containerd", "ctr", "runc")
    pytest.importorskip("grpc")
    from tests.fixtures.fakegpu.runner import fake_proc_command

    base = cri.prepare(tmp_path / "c")
    host, named = scratch(tmp_path)
    main = containerd_config(host, (base / "config.toml").read_bytes())
    (host / "run/containerd").mkdir()
    os.symlink(base / "c.sock", host / "run/containerd/containerd.sock")   # the engine's socket on the host
    helpers = cri.CLIENT[:cri.CLIENT.index("sock, logs, wanted")]
    client = [sys.executable, "-I", "-c", helpers + "sock, logs = sys.argv[1], sys.argv[2]\n" + RESTART_CLIENT,
              str(base / "c.sock"), str(base / "logs"), cri.IMAGE]
    inner = ["sh", "-c", RESTART_WORLD, "sh", str(base), str(main), f"{host / 'etc'}:{node_etc}", *client]
    world = subprocess.Popen([*DEFAULT_HUP, "unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation",
                              "private",
                              "--", *fake_proc_command(machine, inner)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        for _ in range(600):
            if (base / "phase1").exists() or world.poll() is not None:
                break
            time.sleep(0.1)
        assert (base / "phase1").exists(), world.communicate(timeout=30)
        res = once(env(host, named, source, RUNTIME_RESTART_MODE="signal", RUNTIME_RESTART_TIMEOUT="30"))
        (base / "phase2").touch()
        out, err = world.communicate(timeout=300)
    finally:
        if world.poll() is None:
            world.kill()
    context = f"{res.stderr}\n{out}\n{err}\n{cri.log(base)}"
    assert res.returncode == 0 and "containerd restarted (signal)" in res.stderr, context
    assert "BEFORE 1" in out and "AFTER 1" in out, context               # CONTAINER_RUNNING throughout
    assert f"GPU cat: can't open '/dev/nvidia0': {ENXIO}" in out, context  # the handler it now has


# the installer killed (SIGKILL's os._exit: no finally, no handler) right before or right after it
# writes containerd's config.toml, the drop-in already written
KILLED_AT = r"""
import os, sys
from nvcontainer.setup import perform
real = perform._write
def write(path, content, mode):
    if path.endswith("/etc/containerd/config.toml") and sys.argv[1] == "before":
        os._exit(9)
    real(path, content, mode)
    if path.endswith("/etc/containerd/config.toml"):
        os._exit(9)
perform._write = write
from nvcontainer.cli.main import main
main(["install"])
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_killed_between_two_engine_writes_the_next_run_takes_both_back(source, tmp_path, when):
    host, named = scratch(tmp_path)
    main = containerd_config(host, MAIN)
    e = env(host, named, source)
    res = subprocess.run([sys.executable, "-c", KILLED_AT, when], env=e, capture_output=True, text=True, timeout=120)
    assert res.returncode == 9, res.stderr
    assert (host / containerd_setup.DROPIN.lstrip("/")).exists()
    assert (main.read_text() == MAIN) == (when == "before")
    p = start(e)
    wait_ready(p, host)
    stop(p)
    assert main.read_text() == MAIN
    assert not (host / containerd_setup.DROPIN.lstrip("/")).exists()


def test_a_node_set_up_by_hand_is_left_to_the_package(source, tmp_path):
    host, named = scratch(tmp_path)
    main = containerd_config(host, MAIN)
    subprocess.run([*CLI, "setup", "containerd", "--prefix", str(host), "--engine-version", "1.6.20", "--hook-path",
                    str(VENV / "nvcontainer-hook")], check=True, capture_output=True, timeout=120)
    before = {p: p.read_bytes() for p in (main, host / containerd_setup.DROPIN.lstrip("/"))}
    res = once(env(host, named, source))
    assert res.returncode == 1 and "nvcontainer setup did that" in res.stderr, res.stderr
    assert {p: p.read_bytes() for p in before} == before
