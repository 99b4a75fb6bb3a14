"""The documentation must describe the code as it is.

Each check takes its list of names from the code (the live ``--help`` output, the config key
table, the plan's JSON form, the request module's variable names) and looks for every one in the
page that documents it, so adding an option, a key or a field without documenting it fails here.
Names are looked for in the roff source written the way a man page must write them (``\\-`` for
every hyphen, so they render as copy-pasteable ASCII), not in rendered text, which hyphenates.
"""

from __future__ import annotations

from nvcontainer import records
import json
import re
import shutil
from pathlib import Path

import pytest

from nvcontainer.config import load as config
from nvcontainer.config import toolkit
from nvcontainer.config.model import Config
from nvcontainer.hook import prestart as hook
from nvcontainer.request import decide as request
from nvcontainer.request import visible
from nvcontainer.inventory import catalog
from nvcontainer.plan import model
from tests.fixtures.docs import assert_documented, help_options, man_warnings, mentions, roff, section

ROOT = Path(__file__).resolve().parent.parent
CLI_PAGE = ROOT / "man" / "nvcontainer.1"
HOOK_PAGE = ROOT / "man" / "nvcontainer-hook.1"
CONFIG_PAGE = ROOT / "man" / "nvcontainer.toml.5"
RUNTIME_PAGE = ROOT / "man" / "nvidia-container-runtime.1"
PLAN_DOC = ROOT / "docs" / "plan.md"
PAGES = (CLI_PAGE, HOOK_PAGE, CONFIG_PAGE, RUNTIME_PAGE)


def test_every_configure_option_is_in_the_configure_section():
    text = section(CLI_PAGE.read_text(), ".SS configure")
    assert_documented(help_options("configure"), text, "man/nvcontainer.1 (configure)")


def test_every_global_option_is_in_the_global_options_section():
    options = help_options()
    assert (None, "--config") in options
    text = section(CLI_PAGE.read_text(), ".SH GLOBAL OPTIONS")
    assert_documented(options, text, "man/nvcontainer.1 (GLOBAL OPTIONS)")


def test_every_hook_option_and_stage_is_documented():
    text = HOOK_PAGE.read_text()
    options = set(re.findall(r"--[a-z][a-z-]*", hook.USAGE))
    assert {"--root", "--config", "--dry-run"} <= options
    for name in sorted(options | {"prestart", "poststart", "poststop"}):
        assert mentions(text, name), f"{name} is not documented in man/nvcontainer-hook.1"


def test_every_config_key_is_documented_and_nothing_else():
    """Every key of every table (KEYS, under its ``.SS [table]``), every Config setting has a key,
    and every upstream key without an effect is named in KEYS WITHOUT EFFECT with its table."""
    keys = {toolkit.where(t, k): name for t, table in toolkit.TABLES.items() for k, (name, _) in table.items()}
    meta = {"source", "origins", "inert", "note"}
    fields = [f.name for f in records.fields(Config) if f.name not in meta]
    assert sorted(fields) == sorted([*keys.values(), *toolkit.RAW.values()]), "Config fields and TOML keys differ"
    for table in toolkit.RAW:   # kept raw, checked by the command that owns it: a section of its own
        assert f".SH THE DEVICE PLUGIN TABLE\n\\fB[{roff(table)}]\\fR" in CONFIG_PAGE.read_text()
    lines = CONFIG_PAGE.read_text().splitlines()
    documented, table = set(), ""
    for line in lines[lines.index(".SH KEYS") + 1:]:
        if line.startswith(".SH "):
            break
        if line.startswith(".SS ["):
            table = line[5:-1].replace("\\-", "-")
        m = re.match(r"^\\fB([a-z\\-]+)\\fR = ", line)
        if m:
            documented.add(toolkit.where(table, m.group(1).replace("\\-", "-")))
    assert documented == set(keys), (f"undocumented: {sorted(set(keys) - documented)}; "
                                     f"documented but not keys: {sorted(documented - set(keys))}")
    inert = section(CONFIG_PAGE.read_text(), ".SH KEYS WITHOUT EFFECT")
    for table, names in toolkit.INERT.items():
        line = next((x for x in inert.splitlines() if x.startswith(f"\\fB[{roff(table)}]\\fR ")), "")
        for name in names:
            assert mentions(line, name), f"{table}.{name} is not in KEYS WITHOUT EFFECT"


def test_the_runtime_page_names_every_option_it_reads_and_its_keys():
    from nvcontainer.runtime import argv

    text = RUNTIME_PAGE.read_text()
    for name in (*argv.GLOBAL_VALUED, *argv.CREATE_VALUED, *argv.ALIASES):
        assert mentions(text, name), f"{name} is not in man/nvidia-container-runtime.1"
    for key in (*toolkit.TABLES[toolkit.RUNTIME], *toolkit.TABLES[toolkit.CDI_MODE]):
        assert mentions(text, key), f"{key} is not in man/nvidia-container-runtime.1"


def test_config_example_is_a_valid_config():
    text = section(CONFIG_PAGE.read_text(), ".SH EXAMPLE")
    block = text.split(".nf\n", 1)[1].split("\n.fi", 1)[0]
    cfg = config.parse(block.replace("\\-", "-"), "example")
    assert cfg != Config()
    assert cfg.accept_envvar_unprivileged is False and cfg.accept_volume_mounts is True


def _json_blocks(text: str) -> list:
    return [json.loads(b) for b in re.findall(r"```json\n(.*?)\n```", text, re.S)]


def _gpu_plan() -> model.Plan:
    f = model.File("/etc/x", "x\n")
    return model.Plan(
        gpu=True, rootfs="/r",
        tmpfs=(model.Tmpfs("/proc/driver/nvidia", (f,), ("gpus",)),),
        mounts=(model.Mount("/h/a", "/a", model.LIBRARY_OPTIONS),),
        devices=(model.Device("/dev/nvidia0", 195, 0, "/h/dev/nvidia0"),),
        symlinks=(model.Symlink("/a.1", "a"),),
        files=(f,), cgroup_rules=("c 195:0 rw",),
        ldconfig=model.Ldconfig("@/sbin/ldconfig", ("/usr/lib64",)),
    )


def test_every_plan_key_is_in_the_schema_table():
    text = PLAN_DOC.read_text()
    for key in _gpu_plan().to_json():
        assert f"| `{key}` |" in text, f"plan key {key!r} is not in the schema table of docs/plan.md"


def test_plan_doc_examples_have_the_real_shape():
    blocks = _json_blocks(PLAN_DOC.read_text())
    assert model.Plan(gpu=False).to_json() in blocks
    example = next(b for b in blocks if b.get("gpu") is True)
    real = _gpu_plan().to_json()
    assert list(example) == list(real)
    for key in ("tmpfs", "mounts", "devices", "symlinks", "files"):
        assert example[key], f"the example's {key} is empty: it cannot show the shape"
        for item in example[key]:
            assert set(item) == set(real[key][0]), f"an example {key} entry has keys {sorted(item)}"
    assert set(example["tmpfs"][0]["files"][0]) == set(real["tmpfs"][0]["files"][0])
    assert set(example["ldconfig"]) == set(real["ldconfig"])
    devices = [(d["major"], d["minor"]) for d in example["devices"]]
    assert example["cgroup_rules"] == [f"c {a}:{b} rw" for a, b in devices]


def test_capability_table_names_every_library_binary_and_mount_class():
    text = PLAN_DOC.read_text()
    names = [p for prefixes in catalog.LIBRARY_PREFIXES.values() for p in prefixes]
    names += [b for binaries in catalog.BINARIES.values() for b in binaries]
    for name in names:
        assert f"`{name}`" in text, f"{name} is not in docs/plan.md"
    for options in (model.LIBRARY_OPTIONS, model.DEVICE_OPTIONS, model.IPC_OPTIONS, model.PROC_OPTIONS,
                    model.TMPFS_OPTIONS):
        assert f"`{','.join(options)}`" in text, f"mount options {options} are not in docs/plan.md"


def test_every_environment_variable_is_in_the_hook_page():
    modules = (request, visible)   # visible: the one reading of NVIDIA_VISIBLE_DEVICES the hook uses
    source = "".join(Path(m.__file__).read_text() for m in modules)
    names = {v for m in modules for k, v in vars(m).items()
             if k.isupper() and isinstance(v, str) and v.startswith("NVIDIA_")}
    names |= set(re.findall(r"[\"'](NVIDIA_[A-Z_]+|CUDA_[A-Z_]+)[\"']", source))
    assert {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DISABLE_REQUIRE", "CUDA_VERSION", "NVIDIA_REQUIRE_CUDA"} <= names
    text = HOOK_PAGE.read_text()
    for name in sorted(names):
        assert name in text, f"{name} is not documented in man/nvcontainer-hook.1"
    assert roff(request.DEVICES_ROOT) in text


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_renders_without_warnings(page):
    assert man_warnings(page) == ""


README = ROOT / "README.md"
DOCS = ROOT / "docs"


def test_the_readme_is_a_front_door():
    """Short enough to read (issue 27: at most 250 lines), with the two set-up commands exactly
    as CI runs them, an install section, one example per engine, and the way to the rest."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "```sh\nscripts/install && scripts/demo\n.venv/bin/python -m pytest\n```" in text
    headings = re.findall(r"^#{2,3} (.+)$", text, re.M)
    assert headings.count("Install on a node") == 1
    for heading in ("Docker", "podman", "containerd and CRI-O", "Kubernetes", "Dependencies", "Documentation"):
        assert heading in headings, heading
    for example in ("docker run --rm --runtime=nvidia", "podman run --rm", "ctr run --rm",
                    "kubectl apply -k deploy/kubernetes/", "docs/engines/kubernetes.md"):
        assert example in text, example
    assert "docs/README.md" in text


def test_every_page_the_readme_names_exists():
    text = README.read_text()
    for path in sorted(set(re.findall(r"`((?:docs|man|hooks|fuzz)/[\w./-]+)`", text))):
        if not path.endswith("/"):
            assert (ROOT / path).exists(), f"README names {path}, which does not exist"


def test_the_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w./-]+\.md)\)", index))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")} - {"README.md"}
    assert pages <= listed, f"not in docs/README.md: {sorted(pages - listed)}"


def test_every_dependency_has_its_reason():
    """Each runtime and test dependency of pyproject.toml is named, with why, in the README's
    list and in docs/dependencies.md."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in requirements}
    readme = README.read_text().split("## Dependencies", 1)[1]
    full = (DOCS / "dependencies.md").read_text()
    for name in sorted(names):
        assert name in readme, f"{name} is not in the README's Dependencies"
        assert name in full, f"{name} is not in docs/dependencies.md"
