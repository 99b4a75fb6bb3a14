"""``pip install`` of the built wheel: every program the README and the man pages present as a
command is installed, and each runs this install's Python.

A real ``pip wheel`` of a copy of the source tree (offline: no build isolation, the current
environment's setuptools), installed with ``--no-index --no-deps`` into a new virtual
environment whose dependencies come from this one's site-packages through a ``.pth`` file. The
runtime shim and the served hook client are native programs built when the wheel is, with no
interpreter path embedded: they must find the new environment's ``python3`` beside themselves.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from nvcontainer.native import build

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("nvcontainer", "nvcontainer-hook", "nvidia-container-runtime-hook", "nvidia-container-cli",
            "nvidia-container-runtime", "nvcontainer-runtime", "nvcontainer-hook-client")
NATIVE = ("nvidia-container-runtime", "nvcontainer-runtime", "nvcontainer-hook-client")

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler: the wheel has no native programs")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
        ".import_linter_cache", "demo"))
    wheels = tmp / "wheels"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "were not built" not in res.stderr, res.stderr
    (wheel,) = wheels.glob("nvcontainer-*.whl")
    env = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(env / "bin/python"), "install", "-q",
                          "--no-index", "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    purelib = subprocess.run([str(env / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


def test_every_command_is_installed(venv):
    for name in COMMANDS:
        path = venv / "bin" / name
        assert path.is_file() and path.stat().st_mode & 0o111, name
    for name in NATIVE:
        assert (venv / "bin" / name).read_bytes()[:4] == b"\x7fELF", name


def test_the_native_programs_run_this_installs_python(venv, tmp_path):
    """Each reaches the Python code (its error is Python's, one line) from an empty environment,
    so the interpreter it ran is the one beside it."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2",
                                                    "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}}))
    for name in ("nvidia-container-runtime", "nvcontainer-runtime"):
        res = subprocess.run([str(venv / "bin" / name), "create", "--bundle", str(bundle), "x"], env={},
                             cwd=bundle, capture_output=True, text=True, timeout=60)
        assert (res.returncode, res.stderr) == (1, f"{name}: input error: config.json: root: expected an object, "
                                                   "got null\n")
    res = subprocess.run([str(venv / "bin/nvcontainer-hook-client"), "--socket", "", "prestart"], env={},
                         input="{}", capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stderr) == (1, "nvcontainer-hook: input error: state: pid: missing\n")
    res = subprocess.run([str(venv / "bin/nvidia-container-cli"), "--version"], env={}, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("nvcontainer ")


def test_without_python_beside_it_a_native_program_says_so(venv, tmp_path):
    alone = tmp_path / "nvcontainer-hook-client"
    shutil.copy(venv / "bin/nvcontainer-hook-client", alone)
    res = subprocess.run([str(alone), "--socket", "", "prestart"], env={}, input="{}", capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr == f"nvcontainer-hook: error: cannot run {tmp_path}/python3: No such file or directory\n"
