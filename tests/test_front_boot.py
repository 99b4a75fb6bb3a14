"""The fronts' interpreter starts without ``site`` (``-I -S``) and runs ``native/boot.py`` first
(issue 27, target 2): the program must see exactly what ``-I`` gives it (``sys.path``,
``sys.prefix``, the builtins ``site`` adds) in every install, by the boot's fast path where the
venv's ``.pth`` files hold directory lines only, and by ``site.main()`` itself where anything
else is there (an import line, an odd file, the system's site-packages, no venv at all).

Through the real front, a GPU start of the in-process hook under runc: on the fast path the
interpreter never runs ``site``'s start (no ``sitecustomize`` looked for) and still finds every
module; an import line added to the install sends it to ``site``'s start, and the start works.
"""

from __future__ import annotations

import importlib.util
import json
import marshal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from benchmarks.workspace import production_venv
from nvcontainer.native import build
from tests.fixtures import runtime as rt

REPO = Path(__file__).resolve().parent.parent
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What site gives a program under -I that ours could ever read.
PROBE = ("import sys, builtins, site; print(repr((sys.path, sys.prefix, sys.exec_prefix, getattr(sys, '_home', 0), "
         "[hasattr(builtins, n) for n in ('exit', 'quit', 'help', 'copyright', 'credits', 'license')], "
         "site.PREFIXES, site.ENABLE_USER_SITE)))")
SHIM = ("import os; var = 'SETUPTOOLS_USE_DISTUTILS'; enabled = os.environ.get(var, 'local') == 'local'; "
        "enabled and __import__('_distutils_hack').add_shim(); \n")


def _run(argv: list[str]) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, cwd="/", env={"PATH": SAFE_PATH}, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _booted(python: str, code: str, line: str | None = None) -> tuple[str, str]:
    """(the probe's line, "fast" or "site") under the fronts' start."""
    out = _run([python, "-I", "-S", "-c", (line or build.boot_line()) + code + "; print(_nvc_start)"]).splitlines()
    return out[0], out[1]


def _venv(base: Path, *, system: bool = False, pth: dict[str, str | bytes] | None = None,
          interpreter: str = sys.executable) -> str:
    subprocess.run([interpreter, "-m", "venv", "--without-pip", *(["--system-site-packages"] if system else []),
                    str(base)], check=True)
    python = str(base / "bin" / "python")
    purelib = Path(_run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (purelib / "relative-dir").mkdir()
    for name, text in (pth or {}).items():
        (purelib / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return python


PLAIN = {"a.pth": f"{REPO}\n# a comment\n\n   \nrelative-dir\n/nowhere/at/all\n{REPO}/\n",
         "b.pth": f"{sysconfig.get_paths()['purelib']}\nrelative-dir\n"}


@pytest.mark.parametrize("how, system, pth, start", [
    ("directory lines only", False, PLAIN, "fast"),
    ("and setuptools' distutils hack", False, {**PLAIN, "distutils-precedence.pth": SHIM}, "fast"),
    ("no .pth at all", False, {}, "fast"),
    ("an import line", False, {**PLAIN, "z.pth": "import os\n"}, "site"),
    ("an import line with a tab", False, {"z.pth": f"{REPO}\nimport\tos\n"}, "site"),
    ("a line that is not ASCII", False, {"z.pth": f"{REPO}\n/tmp/caf\u00e9\n"}, "site"),
    ("carriage returns", False, {"z.pth": f"{REPO}\r\nrelative-dir\r\n"}, "site"),
    ("a vertical tab in a comment", False, {"z.pth": f"# note\x0b{REPO}\n"}, "site"),
    ("a hidden .pth file", False, {**PLAIN, ".hidden.pth": f"{REPO}\n"}, "site"),
    ("the system's site-packages too", True, PLAIN, "site"),
])
def test_the_boot_gives_what_site_gives(tmp_path, how, system, pth, start):
    python = _venv(tmp_path / "venv", system=system, pth=pth)
    expected = _run([python, "-I", "-c", PROBE]).strip()
    assert _booted(python, PROBE) == (expected, start), how
    assert _booted(python, PROBE, build.boot_code()) == (expected, start), how   # the source itself


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no distribution python3")
@pytest.mark.parametrize("pth, start", [(PLAIN, "fast"), ({**PLAIN, "distutils-precedence.pth": SHIM}, "fast"),
                                        ({**PLAIN, "z.pth": "import os\n"}, "site")])
def test_the_distributions_python_as_the_package_uses_it(tmp_path, pth, start):
    """The package's venv is made with Debian's /usr/bin/python3, whose site lists
    dist-packages directories too (its getsitepackages is patched): the boot asks it."""
    python = _venv(tmp_path / "venv", pth=pth, interpreter="/usr/bin/python3")
    (Path(python).parent.parent / "lib" / "python3" / "dist-packages").mkdir(parents=True)   # Debian's extra one
    expected = _run([python, "-I", "-c", PROBE]).strip()
    assert "python3/dist-packages" in expected
    assert _booted(python, PROBE) == (expected, start)


def test_an_interpreter_outside_a_venv_gets_sites_start():
    python = getattr(sys, "_base_executable", sys.executable)
    assert _booted(python, PROBE) == (_run([python, "-I", "-c", PROBE]).strip(), "site")


def test_the_development_venvs_editable_finder_gets_sites_start():
    """scripts/install's editable install: setuptools' finder is an import line."""
    assert _booted(sys.executable, PROBE) == (_run([sys.executable, "-I", "-c", PROBE]).strip(), "site")


def test_the_byte_code_is_the_sources_and_another_pythons_start_is_sites(tmp_path, monkeypatch):
    line = build.boot_line()
    code = line.split("exec(marshal.loads(bytes.fromhex('", 1)[1].split("'", 1)[0]
    assert marshal.loads(bytes.fromhex(code)) == compile(build.boot_code(), "<nvcontainer boot>", "exec")
    python = _venv(tmp_path / "venv", pth=PLAIN)
    expected = _run([python, "-I", "-c", PROBE]).strip()
    assert _booted(python, PROBE, build.boot_line()) == (expected, "fast")
    monkeypatch.setattr(importlib.util, "MAGIC_NUMBER", b"\0\0\r\n")   # as if built by another Python
    assert _booted(python, PROBE, build.boot_line()) == (expected, "site")


# --- through the front, a GPU start ------------------------------------------------------------

@pytest.fixture(scope="module")
def fast_install(tmp_path_factory):
    """A venv as a wheel or the package makes it (directory lines only) and a front whose
    interpreter is that venv's python with ``-X importtime`` (a wrapper: the front's own argv
    follows), writing the imports to ``imports.log``."""
    base = tmp_path_factory.mktemp("fast-install")
    python = production_venv(base / "venv")[0]
    log = base / "imports.log"
    wrapper = base / "python-importtime"
    wrapper.write_text(f'#!/bin/sh\nexec "{python}" -X importtime "$@" 2>>"{log}"\n')
    wrapper.chmod(0o755)
    fronts = base / "fronts"
    fronts.mkdir()
    build.build_fronts(str(fronts), str(wrapper))
    return python, fronts / "nvcontainer-hook", log


def _start_through_the_front(machine, tmp_path, front: Path, log: Path) -> set[str]:
    def edit(spec):
        entry = spec["hooks"]["prestart"][1]
        entry["path"] = str(front)
        entry["args"] = ["nvcontainer-hook", *entry["args"][4:-1], "--socket", str(tmp_path / "down.sock"),
                         "prestart"]   # a node whose server is down

    log.write_text("")
    bundle = rt.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=0"], 'ls /dev/nvidia0 && echo "DONE:ok"',
                            extra_spec=edit)
    assert json.loads((bundle / "config.json").read_text())["hooks"]["prestart"][1]["path"] == str(front)
    for _ in range(2):   # the second reads the inventory cache, as most starts do
        log.write_text("")
        res = rt.run_container(machine, bundle)
        assert res.returncode == 0 and "DONE:ok" in res.stdout, (res.stderr, log.read_text())
    return {line.split("|")[-1].strip() for line in log.read_text().splitlines() if line.startswith("import time:")}


def test_a_start_through_the_front_runs_no_site_and_finds_every_module(fake_machine, tmp_path, fast_install):
    from tests.test_hook_start import NOT_ON_THE_START

    python, front, log = fast_install
    imported = _start_through_the_front(fake_machine, tmp_path, front, log)
    assert {"nvcontainer.hook.main", "nvcontainer.apply.execute", "nvcontainer.cgroups.v1"} <= imported
    assert "sitecustomize" not in imported and "usercustomize" not in imported   # site.main() never ran
    assert not imported & NOT_ON_THE_START, sorted(imported & NOT_ON_THE_START)


def test_an_import_line_in_the_install_sends_the_start_to_site(fake_machine, tmp_path, fast_install):
    python, front, log = fast_install
    purelib = Path(_run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    added = purelib / "zz-import.pth"
    added.write_text("import sys\n")
    try:
        imported = _start_through_the_front(fake_machine, tmp_path, front, log)
    finally:
        added.unlink()
    assert "sitecustomize" in imported, sorted(imported)   # site's own start looked for it
    assert "nvcontainer.apply.execute" in imported


def test_the_client_loads_no_socket_module_without_a_socket_and_still_tries_one_that_is_there(tmp_path):
    """A node whose server is down: nothing at the path, no ``_socket`` import; a file there (a
    stale socket, nobody listening) is still tried, and refused, as before."""
    import socket

    stale = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(str(stale))
    dead.close()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from nvcontainer.hook import client; "
            "print(client.forward(['--socket', sys.argv[2], 'prestart']), '_socket' in sys.modules)")
    for path, loaded in ((tmp_path / "absent.sock", "False"), (stale, "True")):
        assert _run([sys.executable, "-I", "-S", "-c", code, str(REPO), str(path)]).split() == ["None", loaded]


def test_a_fronts_program_runs_without_the_cyclic_collector(tmp_path):
    """One short run each: the collector would only walk the imports' objects again and again."""
    python = _venv(tmp_path / "venv", pth=PLAIN)
    assert _run([python, "-I", "-S", "-c", build.boot_line() + "import gc; print(gc.isenabled())"]).strip() == "False"
