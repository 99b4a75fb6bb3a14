"""The runtime shim's native front (``nvcontainer/native/runtime.c``): it must read the
configuration and argv as the Python half does, never pass a spec the Python decision would edit
straight to runc (fuzzed), run the low-level runtime with the engine's argv and environment, and
run the Python half with nothing of the engine's environment or working directory.

A scan-test build of the same source (``NVC_SCAN_TEST``) exposes the scanners to the tests; the
real program is tested with a stand-in low-level runtime that records what it was given."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvcontainer.config.load import parse as parse_config
from nvcontainer.errors import NvcError
from nvcontainer.native import build as native
from nvcontainer.runtime import argv as runtime_argv
from nvcontainer.runtime import edit
from tests.test_config import TOOLKIT_FILE
from tests.test_runtime_shim import Untouchable, spec_bytes

PY = sys.executable


def build_front(dest: Path, config: Path | None = None, scan_test: bool = False) -> Path:
    native.build_runtime(str(dest), PY, str(config) if config else None,
                         defines=("NVC_SCAN_TEST",) if scan_test else ())
    return dest


@pytest.fixture(scope="module")
def scanner(tmp_path_factory):
    """``scanner(config_text) -> path`` of a scan-test front built to read that configuration."""
    base = tmp_path_factory.mktemp("scan")
    built: dict[str | None, Path] = {}

    def make(text: str | None) -> Path:
        if text not in built:
            n = len(built)
            config = None
            if text is not None:
                config = base / f"config{n}.toml"
                config.write_text(text)
            built[text] = build_front(base / f"scan{n}", config, scan_test=True)
        return built[text]

    return make


def front_config(front: Path) -> dict:
    out = subprocess.run([str(front), "config"], capture_output=True, text=True, check=True).stdout
    fields = {}
    for line in out.splitlines():
        name, *rest = line.split()
        fields[name] = rest
    return fields


# --- the configuration, read as Python reads it -------------------------------------------------------

CONFIGS = [
    (None, True),
    ("", True),
    (TOOLKIT_FILE, True),
    ('[nvidia-container-runtime]\nruntimes = ["crun", \'runc\'] # comment\n', True),
    ('# runtimes = ["x"]\n[nvidia-container-runtime]\n  runtimes=["crun"]\n', True),
    ('swarm-resource = "A, B"\n[nvidia-container-runtime.modes.cdi]\nannotation-prefixes = ["x.io/"]\n', True),
    ('swarm-resource = ["A", "B,C"]\n', True),
    ('[ nvidia-container-runtime ]\nruntimes = ["crun"]\n', True),
    ('nvidia-container-runtime.runtimes = ["crun"]\n', False),                   # a dotted key
    ('nvidia-container-runtime = { runtimes = ["crun"] }\n', False),             # an inline table
    ('[nvidia-container-runtime]\nruntimes = [\n  "crun",\n]\n', False),         # over several lines
    ('[nvidia-container-runtime]\n"runtimes" = ["crun"]\n', False),              # a quoted key
    ('[nvidia-container-runtime]\nruntimes = ["cr\\u0075n"]\n', False),          # an escape
    ('["nvidia-container-runtime"]\nruntimes = ["crun"]\n', False),              # a quoted table name
    ('x = """\n[nvidia-container-runtime]\nruntimes = ["evil"]\n"""\n', False),  # inside a string
    ('[[nvidia-container-runtime]]\nruntimes = ["crun"]\n', False),
    ('[nvidia-container-runtime]\ndebug = "/var/log/runtimes.log"\n', False),    # a mention: unsure, ask Python
    ('[nvidia-container-runtime.modes.cdi]\nswarm-resource = "X"\n', False),     # in the wrong table
]


@pytest.mark.parametrize("text, certain", CONFIGS)
def test_the_front_reads_the_configuration_as_python_does(scanner, text, certain):
    fields = front_config(scanner(text))
    assert fields["readable"] == ["1"]
    flags = {k: fields[k][0] == "1" for k in ("runtimes", "swarm", "prefixes")}
    assert all(flags.values()) is certain
    try:
        cfg = parse_config(text or "")
    except NvcError:
        return   # Python refuses the file: only a GPU create reaches Python, and fails there
    expected = {"runtimes": list(cfg.runtimes), "swarm": list(cfg.swarm_resource),
                "prefixes": list(cfg.cdi_annotation_prefixes)}
    for key, ok in flags.items():
        if ok:
            got = fields[key][1:] or {"runtimes": ["runc", "crun"], "swarm": [], "prefixes": ["cdi.k8s.io/"]}[key]
            assert got == expected[key], key


def test_a_config_file_that_cannot_be_read_is_pythons(tmp_path):
    config = tmp_path / "config.toml"
    front = build_front(tmp_path / "scan", config, scan_test=True)
    assert front_config(front)["readable"] == ["0"]    # named, and missing
    config.mkdir()
    assert front_config(front)["readable"] == ["0"]    # not a regular file
    config.rmdir()
    config.write_text("")
    assert front_config(front)["readable"] == ["1"]


# --- argv, read as Python reads it ------------------------------------------------------------------

ARGVS = [
    ["--root", "/r", "--log", "/l", "--log-format", "json", "create", "--bundle", "/b", "--pid-file", "/p", "id"],
    ["--systemd-cgroup", "create", "-b", "/b", "id"],
    ["-root=/r", "run", "--bundle=/b", "-d", "id"],
    ["create", "id"],
    ["--cgroup-manager", "systemd", "create", "--config", "s.json", "-b", "/b", "id"],
    ["create", "-f", "s.json", "--console-socket", "/s", "--preserve-fds", "2", "id"],
    ["--root", "/r", "start", "id"],
    ["--log-level", "debug", "delete", "--force", "id"],
    ["--unknown-switch", "create", "--bundle", "/b", "id"],
    ["--root", "create", "start", "id"],
    ["--", "create", "--bundle", "/b", "id"],
    ["--version"],
    [],
]


@pytest.mark.parametrize("args", ARGVS)
def test_the_front_reads_argv_as_python_does(scanner, args):
    out = subprocess.run([str(scanner(None)), "argv", *args], capture_output=True, text=True, check=True).stdout
    command, bundle, config, _ = out.split()
    inv = runtime_argv.parse(args, "/cwd")
    assert command == (inv.command or "-")
    if inv.edits_spec:
        want_bundle = inv.bundle if inv.bundle != "/cwd" else "-"
        assert os.path.normpath(os.path.join("/cwd", bundle if bundle != "-" else ".")) == inv.bundle, want_bundle
        assert (config if config != "-" else "config.json") == inv.spec_name


# --- the spec scan, fuzzed against the Python decision ---------------------------------------------

FUZZ_CONFIGS = [
    "",
    'swarm-resource = "DOCKER_RESOURCE_GPU,X_GPU"\n',
    'accept-nvidia-visible-devices-as-volume-mounts = true\n[nvidia-container-runtime]\nmode = "cdi"\n'
    '[nvidia-container-runtime.modes.cdi]\nannotation-prefixes = ["cdi.k8s.io/", "example.com/devs/"]\n',
    'accept-nvidia-visible-devices-envvar-when-unprivileged = false\n'
    'accept-nvidia-visible-devices-as-volume-mounts = true\n',
]

_NAMES = ["NVIDIA_VISIBLE_DEVICES", "CUDA_VERSION", "NVIDIA_REQUIRE_CUDA", "DOCKER_RESOURCE_GPU", "X_GPU",
          "NVIDIA_DRIVER_CAPABILITIES", "PATH", "HOME", "NVIDIA_IMEX_CHANNELS"]
_VALUES = ["0", "1", "all", "none", "void", "", "nvidia.com/gpu=0", "GPU-1234", "12.4", "0,1", "x"]
_KEYS = ["cdi.k8s.io/a", "cdi.k8s.io", "example.com/devs/x", "com.nvidia.volumes.needed", "io.kubernetes.x", "a"]
_DESTS = ["/var/run/nvidia-container-devices/0", "/var/run/nvidia-container-devices/cdi/nvidia.com/gpu/0",
          "/run/nvidia-container-devices/1", "/var/run//nvidia-container-devices/./all", "/data", "/proc"]

env_entry = st.builds(lambda n, v: f"{n}={v}", st.sampled_from(_NAMES) | st.text("ABCDEFGHIJ_", min_size=1, max_size=8),
                      st.sampled_from(_VALUES) | st.text(max_size=6))
mount = st.builds(lambda s, d: {"source": s, "destination": d, "type": "bind"},
                  st.sampled_from(["/dev/null", "/dev/../dev/null", "/tmp/x"]), st.sampled_from(_DESTS))
spec_dict = st.builds(
    lambda env, ann, mounts, priv: json.loads(spec_bytes(env, ann, mounts,
                                                          caps=("CAP_SYS_ADMIN",) if priv else ("CAP_CHOWN",))),
    st.lists(env_entry, max_size=4), st.none() | st.dictionaries(st.sampled_from(_KEYS), st.sampled_from(
        ["nvidia.com/gpu=0", "nvidia_driver", "x", "nvidia.com/gpu=0,nvidia.com/gpu=1"]), max_size=2),
    st.lists(mount, max_size=2), st.booleans())


def _escape_some(text: str, rng: random.Random) -> str:
    """JSON with some characters written as \\u escapes, as a hostile or unusual writer might."""
    out = []
    for ch in text:
        if ch.isalnum() and rng.random() < 0.08:
            out.append(f"\\u{ord(ch):04x}" if rng.random() < 0.5 else f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return "".join(out)


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op, at = rng.random(), rng.randrange(len(b) + 1)
        if op < 0.3 and b:
            del b[min(at, len(b) - 1)]
        elif op < 0.6:
            b[at:at] = rng.choice([b"\\", b'"', b"\\u00", b"N", b"=", b",", b"{", bytes([rng.randrange(256)])])
        elif b:
            b[min(at, len(b) - 1)] = rng.randrange(256)
    return bytes(b)


def verdicts(front: Path, specs: list[bytes]) -> str:
    payload = b"".join(struct.pack("<I", len(s)) + s for s in specs)
    return subprocess.run([str(front), "scan"], input=payload, capture_output=True, check=True, timeout=120).stdout.decode()


def python_edits(spec: bytes, config) -> bool:
    """Whether the Python decision would do anything with this spec (consult the inventory or the
    CDI specs, or edit it)."""
    try:
        return edit.edit(spec, "/b", config, Untouchable()).data is not None
    except AssertionError:
        return True
    except NvcError:
        return False


def check_property(front: Path, config, specs: list[bytes]) -> int:
    said = verdicts(front, specs)
    assert len(said) == len(specs)
    maybe = 0
    for spec, verdict in zip(specs, said):
        edits = python_edits(spec, config)   # for every spec: one line or an answer, never a traceback
        if verdict == "n":
            assert not edits, f"the front passed a GPU request to runc: {spec[:400]!r}"
        else:
            maybe += 1
    return maybe


@pytest.mark.parametrize("config_text", FUZZ_CONFIGS, ids=range(len(FUZZ_CONFIGS)))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(spec_dict, min_size=40, max_size=40), st.integers(0, 2**32))
def test_the_scan_never_passes_a_gpu_request_to_runc(scanner, config_text, specs, seed):
    front, config, rng = scanner(config_text), parse_config(config_text), random.Random(seed)
    data = []
    for spec in specs:
        text = json.dumps(spec, ensure_ascii=rng.random() < 0.5)
        data.append(text.encode())
        data.append(_escape_some(text, rng).encode())
        data.append(_mutate(text.encode(), rng))
    check_property(front, config, data)


def test_the_scan_is_not_trivially_conservative(scanner):
    """The property above holds for a scan that says "maybe" to everything: make sure the scan
    lets ordinary containers through, and catches escaped names."""
    front = scanner("")
    plain = [spec_bytes(["HOME=/root"]), spec_bytes(annotations={"io.kubernetes.pod": "x"}),
             spec_bytes(["NVIDIA_DRIVER_CAPABILITIES=all"])]
    gpu = [spec_bytes(["NVIDIA_VISIBLE_DEVICES=0"]),
           spec_bytes(["NVIDIA_VISIBLE_DEVICES=0"]).replace(b"NVIDIA_VISIBLE", b"\\u004eVIDIA_VISIBLE"),
           spec_bytes(["NVIDIA_VISIBLE_DEVICES=0"]).replace(b"VISIBLE_", b"VISIBLE\\u005f"),
           spec_bytes(["CUDA_VERSION=12.4"]), spec_bytes(annotations={"cdi.k8s.io/x": "nvidia.com/gpu=0"}),
           spec_bytes(annotations={"com.nvidia.volumes.needed": "nvidia_driver"}),
           spec_bytes(mounts=[{"source": "/dev/null", "destination": "/var/run/nvidia-container-devices/0"}])]
    assert verdicts(front, plain + gpu) == "nnn" + "m" * len(gpu)


def test_corpus_mutations(scanner):
    """Many mutations of a few real specs (runc's, podman's shape) under each configuration."""
    rng = random.Random(1234)
    corpus = [spec_bytes(e) for e in (["NVIDIA_VISIBLE_DEVICES=0"], ["CUDA_VERSION=11.0"], ["A=1"],
                                      ["DOCKER_RESOURCE_GPU=0"])]
    corpus.append(spec_bytes(annotations={"example.com/devs/a": "nvidia.com/gpu=1"}))
    for config_text in FUZZ_CONFIGS:
        specs = [_mutate(rng.choice(corpus), rng) for _ in range(1500)]
        check_property(scanner(config_text), parse_config(config_text), specs)


# --- the program: what it runs, with what --------------------------------------------------------------

RECORDER = """#!/bin/sh
{{ printf '%s\\n' "$0" "$@"; echo ---; env; echo ---; pwd; }} > {out}
"""

PLANTED_LIB = r"""
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void)
{
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = 0;
    int fd = open(MARKERS "/preload", O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    dprintf(fd, "%s\n", exe);
    close(fd);
}
"""
PLANTED_PY = "import os\nwith open({marker!r}, 'a') as f: f.write('{what}\\n')\n"


class Front:
    """The real front, built to read ``config.toml`` in ``base``, with a recording low-level runtime."""

    def __init__(self, base: Path, runtimes: str | None = None):
        self.base = base
        self.out = base / "recorded"
        self.log = base / "runtime.log"
        self.recorder = base / "recorder"
        self.recorder.write_text(RECORDER.format(out=self.out))
        self.recorder.chmod(0o755)
        self.config = base / "config.toml"
        self.config.write_text(f'[nvidia-container-runtime]\nruntimes = ["{runtimes or self.recorder}"]\n'
                               f'debug = "{self.log}"\n')
        self.program = build_front(base / "nvidia-container-runtime", self.config)

    def run(self, *args, env=None, cwd=None):
        return subprocess.run([str(self.program), *args], capture_output=True, text=True, timeout=60,
                              env=env if env is not None else {"PATH": "/usr/bin:/bin"}, cwd=cwd or self.base)

    def recorded(self) -> tuple[list[str], dict, str]:
        argv, env, cwd = self.out.read_text().split("---\n")
        return argv.splitlines(), dict(line.split("=", 1) for line in env.splitlines() if "=" in line), cwd.strip()

    def python_ran(self) -> bool:
        return self.log.exists() and "prepare.py" in self.log.read_text()


@pytest.fixture
def front(tmp_path):
    return Front(tmp_path)


def make_bundle(base: Path, spec: bytes) -> Path:
    b = base / "bundle"
    b.mkdir()
    (b / "config.json").write_bytes(spec)
    return b


def test_commands_go_to_the_runtime_unchanged(front):
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": "/run/user/1000", "ODD": "a b\tc"}
    res = front.run("--root", "/r", "--log-format=json", "kill", "id", "KILL", env=env, cwd="/tmp")
    assert res.returncode == 0, res.stderr
    argv, got_env, cwd = front.recorded()
    assert argv == [str(front.recorder), "--root", "/r", "--log-format=json", "kill", "id", "KILL"]
    assert {k: got_env[k] for k in env} == env and cwd == "/tmp"
    assert not front.python_ran()


def test_a_create_that_asks_for_nothing_is_not_even_read_twice(front):
    b = make_bundle(front.base, spec_bytes(["HOME=/root"]))
    before = os.stat(b / "config.json")
    data = (b / "config.json").read_bytes()
    res = front.run("--root", "/r", "create", "--bundle", str(b), "--pid-file", "/p", "id")
    assert res.returncode == 0, res.stderr
    after = os.stat(b / "config.json")
    assert (b / "config.json").read_bytes() == data
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert front.recorded()[0][1:] == ["--root", "/r", "create", "--bundle", str(b), "--pid-file", "/p", "id"]
    assert not front.python_ran()


def test_a_create_that_may_ask_goes_to_python_first(front):
    b = make_bundle(front.base, spec_bytes(["NVIDIA_VISIBLE_DEVICES=void"]))
    data = (b / "config.json").read_bytes()
    res = front.run("create", "id", cwd=b, env={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": "/run/user/7"})
    assert res.returncode == 0, res.stderr
    assert front.python_ran() and "left as it is" in front.log.read_text()
    assert (b / "config.json").read_bytes() == data
    argv, env, cwd = front.recorded()
    assert argv[1:] == ["create", "id"] and env["XDG_RUNTIME_DIR"] == "/run/user/7" and cwd == str(b)


def test_nothing_of_the_callers_environment_or_directory_runs(front, tmp_path):
    """LD_PRELOAD, PYTHONPATH, PYTHONHOME, PYTHONSTARTUP and a working directory holding a
    package of our name: none of it runs in the front or the Python half. The low-level runtime
    gets the environment as the engine gave it (runc needs it): the stand-in here is a shell
    script, so the planted library runs there, and only there."""
    markers = tmp_path / "markers"
    markers.mkdir()
    plant = tmp_path / "plant"
    (plant / "nvcontainer" / "runtime").mkdir(parents=True)
    for name in ("sitecustomize.py", "usercustomize.py", "runpy.py", "nvcontainer/__init__.py",
                 "nvcontainer/runtime/__init__.py", "nvcontainer/runtime/__main__.py", "startup.py"):
        (plant / name).write_text(PLANTED_PY.format(marker=str(markers / "python"), what=name))
    (plant / "planted.c").write_text(PLANTED_LIB)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARKERS="{markers}"', "-o", str(plant / "planted.so"),
                    str(plant / "planted.c")], check=True)
    b = make_bundle(front.base, spec_bytes(["NVIDIA_VISIBLE_DEVICES=void"]))
    hostile = {"PATH": f"{plant}:/usr/bin:/bin", "LD_PRELOAD": str(plant / "planted.so"), "PYTHONPATH": str(plant),
               "PYTHONHOME": str(plant), "PYTHONSTARTUP": str(plant / "startup.py"), "PYTHONINSPECT": "1"}
    res = front.run("create", "--bundle", str(b), "id", env=hostile, cwd=plant)
    assert res.returncode == 0, res.stderr
    assert front.python_ran()                                  # the Python half ran, untouched by all this
    assert not (markers / "python").exists()
    ran = set((markers / "preload").read_text().split())
    assert ran and all(os.path.basename(exe) in ("dash", "bash", "sh", "env") for exe in ran), ran
    assert front.recorded()[1]["LD_PRELOAD"] == str(plant / "planted.so")


@pytest.mark.parametrize("args", [["state", "id"], ["create", "--bundle", "{b}", "id"]])
def test_a_missing_runtime_is_one_line(tmp_path, args):
    front = Front(tmp_path, runtimes="/nonexistent/runc")
    b = make_bundle(tmp_path, spec_bytes(["HOME=/"]))
    res = front.run(*[a.format(b=b) for a in args])
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr == ("nvidia-container-runtime: runtime error: no low-level runtime found: none of "
                          "/nonexistent/runc is an executable file (names are looked up in "
                          "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin; set runtimes in "
                          "[nvidia-container-runtime])\n")


def test_the_front_never_runs_itself(tmp_path):
    os.symlink(tmp_path / "nvidia-container-runtime", tmp_path / "runc")
    front = Front(tmp_path, runtimes=str(tmp_path / "runc"))
    res = front.run("state", "id")
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert "is this program" in res.stderr


@pytest.mark.parametrize("kind", ["symlink", "fifo", "huge", "not-json", "duplicate-keys", "wrong-type"])
def test_a_hostile_spec_stops_the_create(front, kind):
    b = front.base / "bundle"
    b.mkdir()
    path = b / "config.json"
    gpu = spec_bytes(["NVIDIA_VISIBLE_DEVICES=0"])
    if kind == "symlink":
        (b / "real.json").write_bytes(gpu)
        path.symlink_to("real.json")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        path.write_bytes(gpu[:-2] + b" " * (16 << 20) + b"}\n")
    elif kind == "not-json":
        path.write_bytes(gpu[:-10])
    elif kind == "duplicate-keys":
        path.write_bytes(gpu[:-2] + b', "process": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}')
    else:
        path.write_bytes(gpu.replace(b'"linux": {', b'"hooks": [], "linux": {'))
    listing = sorted(os.listdir(b))
    kept = None if kind == "fifo" else os.lstat(path)
    res = front.run("create", "--bundle", str(b), "id")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("nvidia-container-runtime: input error:") and "config.json" in res.stderr
    assert not front.out.exists()                      # the low-level runtime never ran
    assert sorted(os.listdir(b)) == listing
    if kept is not None:
        assert os.lstat(path).st_ino == kept.st_ino and os.lstat(path).st_mtime_ns == kept.st_mtime_ns


def test_a_node_without_musl_builds_it_with_its_c_library(tmp_path):
    """musl-gcc is preferred (a faster start); the node's cc builds the same program."""
    front = tmp_path / "front"
    native.build_runtime(str(front), PY, None, cc=native.compiler(), defines=("NVC_SCAN_TEST",))
    assert front_config(front)["runtimes"][0] == "1"
    assert verdicts(front, [spec_bytes(["A=1"]), spec_bytes(["NVIDIA_VISIBLE_DEVICES=0"])]) == "nm"
