"""The environment a runtime hands a program of ours never runs code in it (issue 15, item 1).

Class: whoever executes our entry programs chooses their environment and working directory,
and may pass on the image's (CVE-2025-23266: a createContainer hook without an explicit ``env``).
An interpreter started from that environment runs planted code as root before any check of
ours: ``LD_PRELOAD`` through the dynamic loader, ``PYTHONPATH`` (``sitecustomize``),
``PYTHONHOME``, ``PYTHONSTARTUP`` with ``PYTHONINSPECT``, ``PYTHONUSERBASE``, ``GCONV_PATH``,
and a working directory holding modules named like ours or the standard library's.

Every installed name a runtime or engine executes (``nvcontainer-hook`` for the prestart and
CDI hooks, ``nvidia-container-runtime-hook``, ``nvidia-container-cli``, the served native
client's fallback, the runtime shim's front with its spec edit served or not) is run here with
all of them planted, as a runtime would run it; each planted
piece leaves a marker if it ever runs in a Python process, and none may appear. Then the same
through real runc, with a prestart hook registered without ``env`` (runc then hands the hook its
own environment, which here carries the plants).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvcontainer.native import build
from tests.fixtures.runtime import PROC_DRIVER_HOOK, make_bundle
from tests.fixtures.fakegpu.runner import fake_proc_command

BIN = Path(sys.executable).parent   # the development venv: its editable finder makes the boot run site
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs hooks and runc as root")

# The preloaded library marks only Python processes: sh, unshare and runc load it too (they are
# the engine's programs, started with the engine's environment, not ours).
PRELOAD_C = r"""
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    char exe[4096] = "";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) exe[n] = 0;
    const char *base = strrchr(exe, '/');
    if (!strstr(base ? base : exe, "python")) return;
    int fd = open(MARKERS "/ld_preload", O_CREAT | O_WRONLY, 0644);
    if (fd >= 0) close(fd);
}
"""


def _mark(markers: Path, name: str) -> str:
    return f"open({str(markers / name)!r}, 'w').close()\n"


@pytest.fixture(scope="module")
def plants(tmp_path_factory):
    """(environment, working directory, markers directory): every way in, planted."""
    base = tmp_path_factory.mktemp("plants")
    base.chmod(0o755)
    markers = base / "markers"
    markers.mkdir(mode=0o777)
    (base / "preload.c").write_text(PRELOAD_C)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARKERS="{markers}"', "-o", str(base / "libplanted.so"),
                    str(base / "preload.c")], check=True)
    path = base / "pythonpath"
    path.mkdir()
    (path / "sitecustomize.py").write_text(_mark(markers, "pythonpath_sitecustomize"))
    (path / "usercustomize.py").write_text(_mark(markers, "pythonpath_usercustomize"))
    for module in ("nvcontainer", "click"):   # shadowing what we import
        (path / module).mkdir()
        (path / module / "__init__.py").write_text(_mark(markers, f"pythonpath_{module}"))
    # the codecs, imported before builtins exist (no open() yet: it runs, and stops the start)
    early = base / "pythonpath-early"
    (early / "encodings").mkdir(parents=True)
    (early / "encodings" / "__init__.py").write_text("raise SystemExit('planted encodings ran')\n")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    home = base / "home" / "lib" / version
    (home / "encodings").mkdir(parents=True)
    (home / "encodings" / "__init__.py").write_text(_mark(markers, "pythonhome"))
    (home / "site.py").write_text(_mark(markers, "pythonhome_site"))
    user = base / "userbase" / "lib" / version / "site-packages"
    user.mkdir(parents=True)
    (user / "usercustomize.py").write_text(_mark(markers, "pythonuserbase"))
    (base / "startup.py").write_text(_mark(markers, "pythonstartup"))
    gconv = base / "gconv"
    gconv.mkdir()
    (gconv / "gconv-modules").write_text("module  INTERNAL  PLANTED//  planted  1\n")
    cwd = base / "cwd"
    for module in ("nvcontainer", "click", "encodings", "json"):
        (cwd / module).mkdir(parents=True)
        (cwd / module / "__init__.py").write_text(_mark(markers, f"cwd_{module}"))
    (cwd / "sitecustomize.py").write_text(_mark(markers, "cwd_sitecustomize"))
    for where, directory in (("cwd", cwd), ("pythonpath", path)):   # the boot imports site itself (-S)
        (directory / "site.py").write_text(_mark(markers, f"{where}_site"))
    (cwd / "pyvenv.cfg").write_text(f"home = {base / 'home'}\ninclude-system-site-packages = true\n")
    (cwd / "config.json").write_text("{}")
    env = {
        "PATH": f"{SAFE_PATH}",
        "LD_PRELOAD": str(base / "libplanted.so"),
        "PYTHONPATH": f"{path}:{early}",
        "PYTHONHOME": str(base / "home"),
        "PYTHONUSERBASE": str(base / "userbase"),
        "PYTHONSTARTUP": str(base / "startup.py"),
        "PYTHONINSPECT": "1",
        "PYTHONSAFEPATH": "",
        "GCONV_PATH": str(gconv),
    }
    return env, cwd, markers


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    """{how the interpreter starts: its bin/}: the development venv (site's own start, for the
    editable install's finder) and a venv whose .pth holds directory lines only, as a wheel or
    the package makes (the boot's start without site), each with the fronts built in."""
    from benchmarks.workspace import production_venv

    fast = production_venv(tmp_path_factory.mktemp("install") / "venv")[0].parent
    found = {}
    for b in (BIN, fast):
        out = subprocess.run([str(b / "python3"), "-I", "-S", "-c", build.boot_line() + "print(_nvc_start)"],
                             capture_output=True, text=True, cwd="/", env={"PATH": SAFE_PATH}, check=True)
        found[out.stdout.strip()] = b
    assert set(found) == {"site", "fast"}, found
    return found


def _clear(markers: Path) -> None:
    for marker in markers.iterdir():
        marker.unlink()


def _planted_runs(markers: Path) -> list[str]:
    return sorted(p.name for p in markers.iterdir())


def _bundle(base: Path, env: list[str]) -> Path:
    bundle = base / "bundle"
    (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
    spec = {"ociVersion": "1.0.2", "process": {"env": env, "args": ["true"], "cwd": "/"},
            "root": {"path": "rootfs"}, "linux": {}}
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def _state(bundle: Path) -> str:
    return json.dumps({"ociVersion": "1.0.2", "id": "planted", "status": "creating", "pid": os.getpid(),
                       "bundle": str(bundle)})


@pytest.mark.parametrize("start", ["site", "fast"])
@pytest.mark.parametrize("name, args, wants_state", [
    ("nvcontainer-hook", ["prestart"], True),
    ("nvidia-container-runtime-hook", ["prestart"], True),
    ("nvcontainer-hook", ["create-symlinks", "--link", "a::/b"], True),   # a CDI hook, as a spec runs it
    ("nvidia-container-cli", ["--version"], False),
])
def test_an_entry_runs_nothing_from_its_environment(plants, installs, tmp_path, name, args, wants_state, start):
    env, cwd, markers = plants
    program = installs[start] / name
    assert program.is_file(), f"{program} is not installed (scripts/install builds the fronts)"
    with open(program, "rb") as f:
        assert f.read(4) == b"\x7fELF", f"{name} must be the static front, not a script"
    _clear(markers)
    bundle = _bundle(tmp_path, ["PATH=/bin"])   # asks for no GPU: the hook decides and ends
    res = subprocess.run([str(program), *args], env=env, cwd=cwd, input=_state(bundle) if wants_state else "",
                         capture_output=True, text=True, timeout=60)
    assert _planted_runs(markers) == [], (res.returncode, res.stderr)
    # and the entry itself ran: our interpreter, our code
    assert "Traceback" not in res.stderr, res.stderr
    if name == "nvidia-container-cli":
        assert res.returncode == 0 and res.stdout.startswith("nvcontainer "), res.stdout + res.stderr
    elif args[0] == "prestart":
        assert res.returncode == 0, res.stderr


def test_the_front_is_static_so_no_loader_reads_its_environment():
    out = subprocess.run(["file", "-L", str(BIN / "nvcontainer-hook")], capture_output=True, text=True).stdout
    assert "statically linked" in out or "static-pie linked" in out, out


@pytest.mark.parametrize("start", ["site", "fast"])
def test_the_native_clients_fallback_runs_nothing_from_its_environment(plants, installs, tmp_path, start):
    """The served path's client, when no server answers, executes the Python hook: from a clean
    environment too."""
    env, cwd, markers = plants
    client = tmp_path / "client"
    build.build(str(client), str(installs[start] / "python3"))
    _clear(markers)
    bundle = _bundle(tmp_path, ["PATH=/bin"])
    res = subprocess.run([str(client), "--socket", str(tmp_path / "nobody.sock"), "prestart"], env=env, cwd=cwd,
                         input=_state(bundle), capture_output=True, text=True, timeout=60)
    assert _planted_runs(markers) == [], res.stderr
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("served", [True, False])
def test_the_runtime_front_runs_nothing_from_its_environment(plants, sec_machine, tmp_path, served):
    """``nvidia-container-runtime`` on a GPU ``create``, as an engine runs it with the plants: its
    spec edit done by ``nvcontainer serve``'s child (served) or by its own Python half (no server
    at its socket); neither runs a planted piece, and the spec is edited either way. The
    low-level runtime it then executes (``/bin/true`` here) gets the engine's environment, as
    runc always does."""
    from tests.test_serve import in_world

    env, cwd, markers = plants
    sock = tmp_path / "srv" / "hook.sock"
    config = tmp_path / "config.toml"
    config.write_text(f'[nvidia-container-cli]\nroot = "{sec_machine.root}"\n'
                      f'[nvidia-container-runtime]\nruntimes = ["/bin/true"]\n'
                      f'[nvidia-container-runtime-hook]\npath = "{BIN / "nvcontainer-hook"}"\n'
                      f'[nvcontainer]\ncache-dir = "{tmp_path / "cache"}"\n')
    front = tmp_path / "nvidia-container-runtime"
    build.build_runtime(str(front), str(BIN / "python3"), str(config),
                        defines=(f'NVC_SOCKET="{sock if served else tmp_path / "nobody.sock"}"',))
    bundle = _bundle(tmp_path, ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0"])
    _clear(markers)
    # in the fake machine's world (its /proc/driver/nvidia), beside a server; from the planted
    # directory (sh changes to it: not a Python process) with the planted environment
    step = {"argv": ["sh", "-c", 'cd "$0" && exec "$@"', str(cwd), str(front), "create", "--bundle", str(bundle),
                     "planted"], "env": env, "pause": 0.2}
    out = in_world(sec_machine, tmp_path, [step], str(sock))
    res = subprocess.CompletedProcess(step["argv"], out["steps"][0]["rc"], out["steps"][0]["stdout"],
                                      out["steps"][0]["stderr"])
    assert _planted_runs(markers) == [], res.stderr
    assert res.returncode == 0, res.stderr
    spec = json.loads((bundle / "config.json").read_text())
    assert [h["path"] for h in spec["hooks"]["prestart"]] == [str(BIN / "nvcontainer-hook")]
    trace = (tmp_path / "serve.log").read_text() if served else ""
    assert ("runtime request from pid " in trace) == served, trace


def test_runc_hands_a_hook_without_env_its_own_environment_and_nothing_runs(plants, sec_machine, workdir):
    """Through real runc: the prestart hook has no ``env`` (runc then passes its own environment,
    here the plants), asks for GPU 0, and the container still gets it (ENXIO on the node)."""
    env, cwd, markers = plants
    bundle = make_bundle(workdir, sec_machine, ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility"],
                         "cat /dev/nvidia0 2>&1; true", our_hook=False)
    spec = json.loads((bundle / "config.json").read_text())
    spec["hooks"]["prestart"] = [
        {"path": sys.executable, "args": [sys.executable, "-I", "-c", PROC_DRIVER_HOOK], "env": [f"PATH={SAFE_PATH}"]},
        {"path": str(BIN / "nvcontainer-hook"), "args": ["nvcontainer-hook", "--root", str(sec_machine.root),
                                                          "prestart"]},
    ]
    (bundle / "config.json").write_text(json.dumps(spec))
    _clear(markers)
    argv = ["runc", "--root", str(workdir / "state"), "run", "--bundle", str(bundle), "planted"]
    try:
        res = subprocess.run(fake_proc_command(sec_machine, argv), env=env, cwd=cwd, capture_output=True,
                             text=True, timeout=120)
    finally:
        subprocess.run(fake_proc_command(sec_machine, ["runc", "--root", str(workdir / "state"), "delete", "-f",
                                                       "planted"]), capture_output=True, timeout=60)
    assert _planted_runs(markers) == [], res.stderr
    assert res.returncode == 0, res.stderr
    assert "No such device or address" in res.stdout, res.stdout + res.stderr


def test_without_the_front_the_plants_would_run(plants, tmp_path):
    """The test's own check: a console script (what pip installs for a Python entry) started
    from the same environment does run them, so the assertions above can fail."""
    env, cwd, markers = plants
    script = tmp_path / "console-script"
    script.write_text(f"#!{BIN / 'python3'}\nimport sys\nsys.exit(0)\n")
    script.chmod(0o755)
    _clear(markers)
    plain = {**{k: v for k, v in env.items() if k != "PYTHONHOME"},   # these would stop it early
             "PYTHONPATH": env["PYTHONPATH"].split(":")[0]}
    subprocess.run([str(script)], env=plain, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    found = _planted_runs(markers)
    assert "ld_preload" in found and "pythonpath_sitecustomize" in found, found
