"""The in-process hook's start (issue 27, target 2): what it imports, and the hand-written
shortcuts that spare it ``re`` and ``json`` giving exactly what those would.

A node runs the in-process hook whenever ``nvcontainer serve`` is down, and
``nvidia-container-cli configure`` and ``ctr --gpus`` always do: every module it imports is paid
on every container start. ``import json`` brings ``re``, and ``re`` brings ``enum``,
``functools`` and ``collections``; the start's path uses neither module's Python half.
"""

from __future__ import annotations

import fnmatch
import json
import re
import site
import sys
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.fixtures import runtime as rt

REPO = Path(__file__).resolve().parent.parent

# Modules the in-process hook must not import on a plain GPU start (no config file, an index):
# each costs a start milliseconds, or belongs to another program (click: the operator's CLI).
NOT_ON_THE_START = {
    "re", "json", "enum", "functools", "collections", "contextlib", "threading", "signal", "typing",
    "dataclasses", "inspect", "tomllib", "fnmatch", "socket", "subprocess", "pickle", "secrets",
    "click", "pynvml", "elftools", "nvcontainer.cdi", "nvcontainer.cli", "nvcontainer.inventory.build",
    "nvcontainer.inventory.nvml", "nvcontainer.cgroups.v2", "nvcontainer.cgroups.bpf", "nvcontainer.config.toolkit",
    "_socket",   # no server's socket there (--socket ""; tests/test_front_boot.py: a path with nothing at it)
    "distutils", "pip", "_distutils_hack",   # what the fronts' boot may leave setuptools' shim out for
}

# The hook as the static front starts it (-I), but without ``site``: this development venv's
# .pth files (the editable install's finder, setuptools' distutils hack) import re before the
# hook's first line. The paths are the ones a production install has: the tree and its deps.
HOOK = ("import sys; sys.path[:0] = sys.argv.pop(1).split(':'); "
        "from nvcontainer.hook.main import main; sys.exit(main())")


def _importing_hook(log: Path, config: Path | None = None):
    paths = f"{REPO}:{':'.join(site.getsitepackages())}"
    options = ["--config", str(config)] if config else []

    def edit(spec):
        entry = spec["hooks"]["prestart"][1]
        argv = [sys.executable, "-I", "-S", "-X", "importtime", "-c", HOOK, paths, *entry["args"][4:-1],
                "--socket", "", *options, "prestart"]
        entry["path"] = "/bin/sh"
        entry["args"] = ["sh", "-c", f'exec "$@" 2>"{log}"', "sh", *argv]
    return edit


def _imported(log: Path) -> set[str]:
    return {line.split("|")[-1].strip() for line in log.read_text().splitlines() if line.startswith("import time:")}


def test_the_in_process_hook_imports_only_what_a_start_needs(fake_machine, tmp_path):
    log = tmp_path / "imports.log"
    bundle = rt.make_bundle(tmp_path, fake_machine, ["NVIDIA_VISIBLE_DEVICES=0"], 'ls /dev/nvidia0 && echo "DONE:ok"',
                            extra_spec=_importing_hook(log))
    for _ in range(2):   # the first may build the inventory cache (NVML): the second reads it, as most starts do
        res = rt.run_container(fake_machine, bundle)
        assert res.returncode == 0 and "DONE:ok" in res.stdout, (res.stderr, log.read_text())
    imported = _imported(log)
    assert {"nvcontainer.apply.execute", "nvcontainer.cgroups.v1", "nvcontainer.jsontext"} <= imported
    assert not imported & NOT_ON_THE_START, sorted(imported & NOT_ON_THE_START)


def test_tomllib_and_the_files_layout_are_imported_where_a_config_file_is_read(fake_machine, tmp_path):
    log = tmp_path / "imports.log"
    config = tmp_path / "config.toml"
    config.write_text('[nvidia-container-cli]\nldconfig = "@/sbin/ldconfig"\n')
    bundle = rt.make_bundle(tmp_path, fake_machine, ["NVIDIA_VISIBLE_DEVICES=0"], 'echo "DONE:ok"',
                            extra_spec=_importing_hook(log, config))
    res = rt.run_container(fake_machine, bundle)
    assert res.returncode == 0 and "DONE:ok" in res.stdout, (res.stderr, log.read_text())
    assert {"tomllib", "nvcontainer.config.toolkit"} <= _imported(log)


# --- jsontext is json -------------------------------------------------------------------------

def _outcome(fn, *args, **kwargs):
    try:
        return "value", repr(fn(*args, **kwargs))
    except BaseException as exc:   # noqa: BLE001 - the very exception is compared
        return type(exc).__name__, str(exc)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_json_values, st.booleans(), st.sampled_from([None, (",", ":")]), st.booleans())
def test_jsontext_writes_what_json_writes(value, sort_keys, separators, allow_nan):
    from nvcontainer import jsontext

    kwargs = {"sort_keys": sort_keys, "separators": separators, "allow_nan": allow_nan}
    assert _outcome(jsontext.dumps, value, **kwargs) == _outcome(json.dumps, value, **kwargs)


def _reject(name):
    raise ValueError(f"{name} is not valid JSON")


def _pairs(pairs):
    return ("pairs", pairs)


@settings(max_examples=400, deadline=None)
@given(st.one_of(
    _json_values.map(json.dumps),
    st.text(alphabet='{}[]",:. \t\r\n0123456789-+eEtrufalsnNIy\\u\x00\ud800é', max_size=24),
    st.binary(max_size=12),
    _json_values.map(lambda v: json.dumps(v).encode("utf-8")),
    _json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-16")),
), st.sampled_from([None, _pairs]), st.sampled_from([None, _reject]))
@example('"a\x01b"', None, None)
@example('{"a": 1, "a": [NaN]}', _pairs, None)
@example('{"a": 1, "a": [NaN]}', None, _reject)
@example(b"\xef\xbb\xbf[1]", None, None)
@example(b'"\xff"', None, None)
def test_jsontext_reads_what_json_reads_and_fails_as_it_fails(text, pairs_hook, constant):
    from nvcontainer import jsontext

    kwargs = {"object_pairs_hook": pairs_hook, "parse_constant": constant}
    assert _outcome(jsontext.loads, text, **kwargs) == _outcome(json.loads, text, **kwargs)
    if isinstance(text, str):
        for index in (0, 1):
            assert _outcome(jsontext.raw_decode, text, index) == _outcome(json.JSONDecoder().raw_decode, text, index)


def test_jsontext_parses_without_json_or_re(tmp_path):
    """The shortcut is taken (a valid document never reaches json), in an interpreter that has
    imported neither."""
    code = ("import sys; from nvcontainer import jsontext; "
            "v = jsontext.loads(b' {\"a\": [1, 2.5, null, true, NaN, \"\\\\u00e9\"]} '); "
            "assert jsontext.dumps(v, sort_keys=True, allow_nan=True) == '{\"a\": [1, 2.5, null, true, NaN, \"\\\\u00e9\"]}'; "
            "assert jsontext.raw_decode('{} x') == ({}, 2); "
            "print(sorted(m for m in ('json', 're', 'json.decoder') if m in sys.modules))")
    import subprocess

    out = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); {code}"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- the patterns' shortcuts match as the patterns do ------------------------------------------

_digits = st.text(alphabet="0123456789\u0661", max_size=9)


@settings(max_examples=500, deadline=None)
@given(st.one_of(
    st.text(alphabet="cbarwm 0123456789:\u0661x\n", max_size=16),
    st.tuples(st.sampled_from(["c", "b", "a", "", "cb"]), _digits, st.sampled_from([":", "", "::"]), _digits,
              st.text(alphabet="rwmx", max_size=4), st.sampled_from([" ", "  ", "\n"])).map(
        lambda t: f"{t[0]} {t[1]}{t[2]}{t[3]}{t[5]}{t[4]}")))
@example("c 12345678:1 rw")
@example("b 1:12345678 m")
@example("c 1:2 rwmr")
def test_device_rules_are_split_as_the_pattern_splits_them(text):
    from nvcontainer.cgroups.rules import _split

    m = re.fullmatch(r"([cb]) ([0-9]{1,7}):([0-9]{1,7}) ([rwm]{1,3})", text)
    assert _split(text) == (m.groups() if m else None)


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.sampled_from(["ModifyDeviceFiles:", "ModifyDeviceFiles: ", "1", "0", "12", " ", "\t", "\n",
                                 "\r", "x", "A: 1", "\u0661", "\x0b", "\xa0", "\x1c", "Modify"]), max_size=10))
@example(["ModifyDeviceFiles: 1", "\n", "\t", "x"])
@example(["ModifyDeviceFiles: 1", "\n", " ", "x"])
@example(["ModifyDeviceFiles: 1", "\n"])
@example(["ModifyDeviceFiles: 1", "\n", "\n", "x"])
@example(["ModifyDeviceFiles:", "\n", "1", "\n", "x"])
def test_the_params_copy_is_the_patterns_substitution(parts):
    from nvcontainer.plan.build import _MODIFY, _no_device_files

    text = "".join(parts)
    assert _no_device_files(text) == re.sub(_MODIFY, r"\g<1>0", text)


def test_the_drivers_params_take_the_shortcut(monkeypatch):
    from nvcontainer.plan import build

    params = "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 1\nDeviceFileUID: 0\n"
    monkeypatch.setattr(build, "_MODIFY", None)   # re.sub would fail: the shortcut answered
    assert build._no_device_files(params) == "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 0\nDeviceFileUID: 0\n"


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", ".", "conf", "\n", "*", "?", "[a]", "\\", "ab"]), max_size=6),
       st.lists(st.sampled_from(["a", "b", ".", "conf", "\n", "*", "?", "\\"]), max_size=7))
def test_ld_so_conf_globs_match_as_fnmatch(pattern, name):
    from nvcontainer.apply.ldsoconf import _matches

    pattern, name = "".join(pattern).encode(), "".join(name).encode()
    assert _matches(name, pattern) == fnmatch.fnmatchcase(name, pattern)


@settings(max_examples=500, deadline=None)
@given(st.one_of(
    st.text(alphabet="libcuda.so0123456789\u0661x", max_size=24),
    st.lists(st.text(alphabet="0123456789\u0661", max_size=7), max_size=5).map(lambda p: "libcuda.so." + ".".join(p))))
def test_compat_library_names_are_read_as_the_pattern_reads_them(name):
    from nvcontainer.plan.container import _COMPAT_NAME, parse_compat_name

    m = re.fullmatch(_COMPAT_NAME, name)
    assert parse_compat_name(name) == ((m.group(1) + m.group(2), int(m.group(1))) if m else None)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=8), st.text(alphabet="a\x00\ud800\udfff\ud7ff\ue000\xe9", max_size=8)))
def test_unusable_strings_are_the_patterns(value):
    from nvcontainer.request.oci import _unusable

    assert _unusable(value) == bool(re.search("[\x00\ud800-\udfff]", value))


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(alphabet="0123456789\u0661:.aAfGgPpUu-MmIi/", max_size=12), _digits))
def test_an_index_is_told_apart_as_by_the_patterns(token):
    from nvcontainer.request.decide import _DEVICE_FORMS, device_kind

    assert device_kind(token) == next((kind for kind, p in _DEVICE_FORMS if re.fullmatch(p, token)), None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["\\040", "\\134", "\\011", "\\", "\\8", "\\0", "\\01", "x", "7", "/"]), max_size=6))
def test_mountinfo_fields_are_unescaped_as_the_pattern_does(parts):
    from nvcontainer.cgroups.locate import _unescape

    field = "".join(parts)
    assert _unescape(field) == re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def test_the_cdi_hooks_modules_import_none_of_them():
    """The CDI hooks (create-symlinks, update-ldcache: every container in CDI mode runs them, in
    process) import the modules below at most; none brings what a start must not import."""
    import subprocess

    modules = ("nvcontainer.hook.main", "nvcontainer.hook.cdi", "nvcontainer.apply.execute", "nvcontainer.apply.ldconfig",
               "nvcontainer.apply.mounter", "nvcontainer.apply.worker", "nvcontainer.apply.pin",
               "nvcontainer.request.oci", "nvcontainer.fs.inroot", "nvcontainer.fs.mounts",
               "nvcontainer.inventory.procfs", "nvcontainer.config.model")
    code = (f"import sys; sys.path[:0] = {[str(REPO), *site.getsitepackages()]!r}; import {', '.join(modules)}; "
            f"print(sorted(set(sys.modules).intersection({sorted(NOT_ON_THE_START)!r})))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- nvidia-container-cli configure without click ---------------------------------------------

_GLOBAL_WORDS = ["--load-kmods", "--no-pivot", "--root=/r", "--ldcache=/etc/ld.so.cache", "--debug=/d.log", "--user=",
                 "--user=0:0", "--config=/c.toml", "-k", "--root", "/r", "--bogus", "--load-kmods=1", "info"]
_CONFIGURE_WORDS = ["--device=0", "--device=1,2", "--require=cuda>=11", "--pid=12", "--pid=+1", "--pid=x", "--pid=",
                    "--pid=0012", "--pid=\u0661", "--ldconfig=@/sbin/ldconfig", "--compute", "--utility", "--video",
                    "--graphics", "--display", "--ngx", "--compat32", "--mig-config=all", "--mig-monitor=all",
                    "--imex-channel=1", "--no-cgroups", "--no-devbind", "--no-persistenced", "--no-fabricmanager",
                    "--no-gsp-firmware", "--cuda-compat-mode=ldconfig", "--cuda-compat-mode=LDCONFIG", "--no-cntlibs",
                    "--dry-run", "--json", "/rootfs", "/other", "-c", "--compute=1", "--", "-", "--root=/x",
                    "--device", "0", "--device=a=b", ""]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_GLOBAL_WORDS), max_size=4), st.booleans(),
       st.lists(st.sampled_from(_CONFIGURE_WORDS), max_size=6))
@example(["--load-kmods", "--ldcache=/etc/ld.so.cache"], True, ["--device=0", "--compute", "--utility",
                                                                "--ldconfig=@/sbin/ldconfig", "--pid=12", "/rootfs"])
@example([], True, ["--cuda-compat-mode=LDCONFIG", "/rootfs"])
@example([], True, ["--cuda-compat-mode=disabled", "--pid=0012", "/rootfs"])
@example(["--no-pivot", "--user=", "-k"], True, ["--device=0", "--device=1,2", "--imex-channel=1", "/rootfs"])
def test_an_engines_configure_argv_is_read_as_click_reads_it(before, command, after):
    """Where the click-free reading takes an argv, click takes it too, with the same values."""
    import pytest

    from nvcontainer.cli import inject, main as cli_main, nvcli

    args = [*before, *(["configure"] if command else []), *after]
    read = nvcli.read_argv(list(args))
    if read is None:
        return
    seen: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli_main, "open_run", lambda **group: seen.setdefault("group", group) and "obj")
        mp.setattr(inject, "configure", lambda obj, **params: seen.setdefault("params", params))
        assert cli_main.main(list(args), prog=nvcli.PROG) == 0, args
    assert read == (seen["group"], seen["params"]), args


def test_the_click_free_reading_knows_every_option_as_click_declares_it():
    from nvcontainer.cli import nvcli
    from nvcontainer.cli.configure import configure
    from nvcontainer.cli.main import cli

    def longs(command, **kinds):
        out = {}
        for p in command.params:
            if p.param_type_name != "option" or p.name in ("help", "version"):
                continue
            name = next(o for o in p.opts if o.startswith("--"))
            out[name] = ("repeated" if p.multiple else "flag" if p.is_flag else "value", p.name)
        return out
    ours = {**{k: ("value", v) for k, v in nvcli.GLOBAL_VALUES.items()},
            **{k: ("flag", v) for k, v in nvcli.GLOBAL_FLAGS.items()}}
    assert longs(cli) == ours
    ours = {**{k: ("value", v) for k, v in nvcli.VALUES.items()}, **{k: ("repeated", v) for k, v in nvcli.REPEATED.items()},
            **{k: ("flag", v) for k, v in nvcli.FLAGS.items()}, "--dry-run": ("flag", "dry_run"), "--json": ("flag", "as_json")}
    assert longs(configure) == ours
    mode = next(p for p in configure.params if p.name == "cuda_compat_mode")
    assert tuple(mode.type.choices) == nvcli.COMPAT_MODES


# containerd's ``ctr --gpus`` hook, as a runc prestart hook: the state's pid and the bundle's
# rootfs filled in (containerd does it from templates), then nvidia-container-cli's argv.
CTR_HOOK = r"""
import json, os, sys
state = json.load(sys.stdin)
argv = sys.argv[1:]
argv = [a.replace("{{pid}}", str(state["pid"])).replace("{{rootfs}}", os.path.join(state["bundle"], "rootfs"))
        for a in argv]
os.execv(argv[0], argv)
"""
CLI = ("import sys; sys.path[:0] = sys.argv.pop(1).split(':'); "
       "from nvcontainer.cli.nvcli import main_nvidia_container_cli as m; sys.exit(m())")


def test_nvidia_container_cli_configure_as_ctr_runs_it_imports_no_click(fake_machine, tmp_path):
    log = tmp_path / "imports.log"
    paths = f"{REPO}:{':'.join(site.getsitepackages())}"
    cli = [sys.executable, "-I", "-S", "-X", "importtime", "-c", CLI, paths, "--load-kmods", f"--root={fake_machine.root}",
           "configure", "--device=0", "--compute", "--utility", "--pid={{pid}}", "{{rootfs}}"]

    def edit(spec):
        entry = spec["hooks"]["prestart"][1]
        entry["path"] = "/bin/sh"
        entry["args"] = ["sh", "-c", f'exec "$@" 2>"{log}"', "sh", sys.executable, "-I", "-c", CTR_HOOK, *cli]
    bundle = rt.make_bundle(tmp_path, fake_machine, [], 'ls /dev/nvidia0 && echo "DONE:ok"', extra_spec=edit)
    for _ in range(2):
        res = rt.run_container(fake_machine, bundle)
        assert res.returncode == 0 and "DONE:ok" in res.stdout, (res.stderr, log.read_text())
    imported = _imported(log)
    assert "nvcontainer.apply.execute" in imported
    assert not imported & (NOT_ON_THE_START - {"nvcontainer.cli"}), sorted(imported & NOT_ON_THE_START)
