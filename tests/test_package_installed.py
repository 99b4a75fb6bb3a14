"""The installed package (``.ci/package`` installs it, then runs this file): its programs, as a node
runs them, with no compiler involved.

One GPU container through a private dockerd configured by the installed ``nvcontainer setup
docker`` (``--runtime=nvidia``, the installed runtime shim, the installed native hook client,
served by the installed interpreter's ``nvcontainer serve``), on the fake GPU machine; and the
installed programs run with planted ``PYTHONPATH``/``PYTHONHOME``/``LD_PRELOAD`` code and a
hostile working directory, none of which runs. Skipped unless ``NVC_PACKAGE_TEST=1`` and the
package is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.fixtures import dockerd, runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.test_engines_setup import CHECKS, assert_gpu0, script

LIB = Path("/usr/lib/nvcontainer")
pytestmark = pytest.mark.skipif(os.environ.get("NVC_PACKAGE_TEST") != "1" or not (LIB / "bin/python3").exists(),
                                reason="the package is not installed (.ci/package installs it and runs this)")


def test_a_gpu_container_through_the_installed_package(fake_machine_factory, tmp_path):
    machine = fake_machine_factory(FakeSpec(gpus=2))
    python = str(LIB / "bin/python3")
    hook = script(tmp_path / "hook", runtime.driver_wrapper(LIB / "bin/nvcontainer-hook-client", python))
    etc = tmp_path / "etc"
    (etc / "nvcontainer").mkdir(parents=True)
    (etc / "nvcontainer/config.toml").write_text(
        f'[nvidia-container-cli]\nroot = "{machine.root}"\ndebug = "{tmp_path / "hook.log"}"\n'
        f'[nvidia-container-runtime-hook]\npath = "{hook}"\n')
    prefix = tmp_path / "root"
    res = subprocess.run(["/usr/bin/nvcontainer", "setup", "docker", "--prefix", str(prefix)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "built" not in res.stdout   # the package's native programs are used as they are
    daemon = prefix / "etc/docker/daemon.json"
    assert json.loads(daemon.read_text())["runtimes"]["nvidia"] == {"path": str(LIB / "bin/nvidia-container-runtime")}
    base = dockerd.prepare(tmp_path / "d")
    results, out = dockerd.run(machine, base, daemon, [
        ["run", "--rm", "--network", "none", "--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=0", dockerd.IMAGE,
         "sh", "-c", CHECKS]], etc=etc, served=True, python=python)
    context = f"{out.stderr}\n{dockerd.log(base)}"
    assert len(results) == 1, context
    assert_gpu0(*results[0], context)
    assert "(served by nvcontainer serve, pid " in (tmp_path / "hook.log").read_text()
    # the package's runtime front and its server are one install: the spec edit was served too
    served = (base / "serve.log").read_text()
    assert served.count("runtime request from pid ") == 1 and "request declined" not in served, served


PLANTED = "import os; open(os.environ['NVC_MARK'], 'w').write('ran')\n"


def test_installed_programs_ignore_planted_code(tmp_path):
    evil = tmp_path / "evil"
    (evil / "lib/python3.11").mkdir(parents=True)
    for name in ("sitecustomize.py", "nvcontainer.py", "click.py", "json.py"):
        (evil / name).write_text(PLANTED)
        (evil / "lib/python3.11" / name).write_text(PLANTED)
    preload = evil / "preload.so"
    src = evil / "preload.c"
    src.write_text('#include <stdlib.h>\n#include <stdio.h>\n__attribute__((constructor)) static void m(void) '
                   '{ FILE *f = fopen(getenv("NVC_MARK"), "w"); if (f) fclose(f); }\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(preload), str(src)], check=True, timeout=60)
    state = json.dumps({"ociVersion": "1.0.2", "id": "x", "pid": 1, "bundle": str(tmp_path / "no-bundle")})
    mark = tmp_path / "ran"
    programs = [["/usr/bin/nvidia-container-runtime-hook", "prestart"], ["/usr/bin/nvcontainer-hook", "prestart"],
                [str(LIB / "bin/nvcontainer-hook-client"), "prestart"], ["/usr/bin/nvidia-container-cli", "--version"],
                ["/usr/bin/nvidia-container-runtime", "--version"]]
    for argv in programs:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(evil), "PYTHONHOME": str(evil),
               "NVC_MARK": str(mark), "PYTHONSTARTUP": str(evil / "json.py")}
        # LD_PRELOAD: for the static native client (whose fallback runs the interpreter without
        # it). Not for the scripts (their interpreter is dynamic: every registration setup makes
        # gives them an explicit environment), nor the runtime shim, which hands its environment
        # to runc unchanged, as the engine would have.
        if os.path.basename(argv[0]) == "nvcontainer-hook-client":
            env["LD_PRELOAD"] = str(preload)
        subprocess.run(argv, input=state, capture_output=True, text=True, cwd=evil, env=env, timeout=60)
        assert not mark.exists(), f"planted code ran in {argv[0]}"


def test_the_installed_fronts_start_their_interpreter_without_site():
    """The package's venv (Debian's python3, pip and setuptools removed) holds only directory
    lines in its .pth files: its fronts' boot takes the fast path, and the program sees the
    sys.path site would give it (tests/test_front_boot.py covers the rest)."""
    python = str(LIB / "bin/python3")
    env = {"PATH": "/usr/bin:/bin"}
    line = subprocess.run([python, "-I", "-c", "from nvcontainer.native import build; print(build.boot_line())"],
                          capture_output=True, text=True, env=env, cwd="/", check=True).stdout
    probe = "import sys; print(sys.path, sys.prefix)"
    booted = subprocess.run([python, "-I", "-S", "-c", line + probe + "; print(_nvc_start)"], capture_output=True,
                            text=True, env=env, cwd="/", check=True).stdout.splitlines()
    plain = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, env=env, cwd="/",
                           check=True).stdout.strip()
    assert booted == [plain, "fast"]
