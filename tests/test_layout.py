"""The package layout as docs/architecture.md describes it: rooms by role, small modules, and a
client that can run without the package. The import arrows themselves are `lint-imports`'s
(contracts in pyproject.toml, run by .ci/run); here, what it cannot see."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nvcontainer"
MAX_LINES = 500
TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "errors.py", "log.py", "records.py", "jsontext.py",
                     "documents.py"}


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_top_level_holds_packages_and_a_handful_of_modules():
    files = {p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix == ".py"}
    assert files <= TOP_LEVEL_MODULES
    for directory in (p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert (directory / "__init__.py").is_file(), f"{directory.name} is not a package"


def test_every_room_says_what_it_holds():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.parent.name}/__init__.py has no docstring saying what the room holds"


def test_every_module_says_why():
    missing = [str(p.relative_to(ROOT)) for p in modules()
               if p.name not in ("__init__.py", "__main__.py") and not ast.get_docstring(ast.parse(p.read_text()))]
    assert missing == []


def test_architecture_doc_matches_the_tree():
    """Every room and every module is named in docs/architecture.md, and nothing it names is
    gone."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rooms = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    table = {m.group(1) for m in re.finditer(r"^\| `([a-z_]+)/`", doc, re.M)}
    assert set(rooms) <= table, f"rooms missing from the table: {sorted(set(rooms) - table)}"
    assert table <= set(rooms), f"the table names rooms that do not exist: {sorted(table - set(rooms))}"
    for room in rooms:
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{room}/`"))
        for module in sorted((PACKAGE / room).glob("*.py")):
            if module.name in ("__init__.py", "__main__.py"):
                continue
            assert f"`{module.name}`" in row or f"`{module.stem}`" in row, \
                f"{room}/{module.name} is not in its row of docs/architecture.md"
    for name in re.findall(r"`((?!tests/)[a-z_]+/[a-z_]+\.py)`", doc):
        assert (PACKAGE / name).is_file(), f"docs/architecture.md names {name}, which does not exist"


def test_the_python_client_imports_only_the_standard_library():
    """``hook/client.py`` runs as ``python -I -S`` from its own path: no site, no package, and
    only the three modules it needs (each import is start-up time on every container start)."""
    tree = ast.parse((PACKAGE / "hook" / "client.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import needs the package"
            imported.add(node.module.split(".")[0])
    assert imported <= sys.stdlib_module_names and imported == {"_socket", "os", "sys"}, imported


def test_lint_imports_fails_on_an_upward_import(tmp_path):
    """The contracts bite: a copy of the package where ``apply`` imports ``serve`` is refused,
    naming both modules."""
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed")
    copy = tmp_path / "src"
    copy.mkdir()
    # the package and benchmarks/, the contracts' other root
    subprocess.run(["cp", "-a", str(PACKAGE), str(ROOT / "benchmarks"), str(copy)], check=True)
    (copy / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    execute = copy / "nvcontainer" / "apply" / "execute.py"
    execute.write_text(execute.read_text() + "\nfrom ..serve import listen  # noqa: E402,F401\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(copy)}
    res = subprocess.run([str(lint), "--no-cache"], cwd=copy, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "nvcontainer.apply is not allowed to import nvcontainer.serve" in res.stdout
    assert "nvcontainer.apply.execute -> nvcontainer.serve.listen" in res.stdout
    clean = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                           capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout


def test_every_native_program_has_a_build_target():
    """Each C source under native/ is compiled by build.py for an installation; none is left to
    be built some other way (or not at all)."""
    from nvcontainer.native import build

    sources = sorted(p.name for p in (PACKAGE / "native").glob("*.c"))
    targets = sorted(Path(s).name for s in (build.SOURCE, build.RUNTIME_SOURCE, build.FRONT_SOURCE))
    assert sources == targets
