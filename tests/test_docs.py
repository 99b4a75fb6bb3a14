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
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvcontainer.config import load as config
from nvcontainer.config import toolkit
from nvcontainer.config.model import Config
from nvcontainer.hook import prestart as hook
from nvcontainer.request import decide as request
from nvcontainer.inventory import catalog
from nvcontainer.plan import model

ROOT = Path(__file__).resolve().parent.parent
CLI_PAGE = ROOT / "man" / "nvcontainer.1"
HOOK_PAGE = ROOT / "man" / "nvcontainer-hook.1"
CONFIG_PAGE = ROOT / "man" / "nvcontainer.toml.5"
RUNTIME_PAGE = ROOT / "man" / "nvidia-container-runtime.1"
PLAN_DOC = ROOT / "docs" / "plan.md"
PAGES = (CLI_PAGE, HOOK_PAGE, CONFIG_PAGE, RUNTIME_PAGE)


def roff(name: str) -> str:
    return name.replace("-", "\\-")


def mentions(text: str, name: str) -> bool:
    """``name`` (roff-escaped) occurs as a whole word: ``--json`` must not match ``--json-x``."""
    text = re.sub(r"\\f[BIRP]", "", text)   # font changes: \fBprestart\fR is "prestart"
    return re.search(r"(?<![\w\\-])" + re.escape(roff(name)) + r"(?![\w]|\\-)", text) is not None


def section(text: str, start: str) -> str:
    """From the line ``start`` to the next ``.SS`` or ``.SH`` line."""
    lines = text.splitlines()
    begin = lines.index(start)
    end = next((i for i in range(begin + 1, len(lines)) if lines[i].startswith((".SS ", ".SH "))), len(lines))
    return "\n".join(lines[begin:end])


def help_options(*args: str) -> list[tuple[str | None, str]]:
    """(short, long) of every option in ``nvcontainer ARGS --help``, help itself excepted."""
    out = subprocess.run([sys.executable, "-m", "nvcontainer", *args, "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=60).stdout
    found = re.findall(r"^ {2}(?:(-[A-Za-z]), )?(--[a-z0-9][a-z0-9-]*)", out, re.M)
    options = [(short or None, long) for short, long in found if long != "--help"]
    assert len(options) >= 5, out   # the parse itself must not silently find nothing
    return options


def man_warnings(page: Path) -> str:
    """What ``man --warnings`` says of ``page`` at 80 columns ("" when it renders cleanly)."""
    env = dict(os.environ, MANWIDTH="80")
    result = subprocess.run(["man", "--warnings", "-l", str(page)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    return result.stderr or ("" if result.returncode == 0 else f"exit status {result.returncode}")


def assert_documented(options, text: str, where: str) -> None:
    for short, long in options:
        lines = [line for line in text.splitlines() if mentions(line, long)]
        assert lines, f"{long} is not documented in {where}"
        if short:
            assert any(mentions(line, short) for line in lines), \
                f"{short} is not documented next to {long} in {where}"


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
    source = Path(request.__file__).read_text()
    names = {v for k, v in vars(request).items() if k.isupper() and isinstance(v, str) and v.startswith("NVIDIA_")}
    names |= set(re.findall(r"[\"'](NVIDIA_[A-Z_]+|CUDA_[A-Z_]+)[\"']", source))
    assert {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DISABLE_REQUIRE", "CUDA_VERSION"} <= names
    text = HOOK_PAGE.read_text()
    for name in sorted(names):
        assert name in text, f"{name} is not documented in man/nvcontainer-hook.1"
    assert roff(request.DEVICES_ROOT) in text


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_renders_without_warnings(page):
    env = dict(os.environ, MANWIDTH="80")
    result = subprocess.run(["man", "--warnings", "-l", str(page)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    assert result.returncode == 0
    assert result.stderr == ""
