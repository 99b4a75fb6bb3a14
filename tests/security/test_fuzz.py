"""Property tests for every parser of untrusted input not already fuzzed next to its module,
and a short bounded run of the atheris harnesses in ``fuzz/``.

Already covered elsewhere with hypothesis: the ld cache and ELF readers (``test_ldcache``,
``test_elfinfo``), the OCI state and spec (``test_oci``), the image's environment
(``test_request``), requirement expressions (``test_require``) and in-root resolution
(``test_inroot``). Here: the kernel files a container can shape (mountinfo with its mount
points, ``/proc/PID/cgroup`` with cgroup names, ``uid_map``, ``/proc/PID/stat`` with its comm),
file names from the image (compat libraries), device rules, device programs read back from the
kernel, a worker's reply, ldconfig's output and the host ldconfig binary, the config file,
``--user``, ``--imex-channel`` and the hook's argv, and the escaping every message relies on.

The contract is the same everywhere: a value, or ``NvcError`` with one printable line; never
another exception. ``NVC_LONG_TESTS=1`` multiplies the example counts.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvcontainer.config import load as config
from nvcontainer.config.model import Config
from nvcontainer import errors
from nvcontainer.hook import prestart as hook
from nvcontainer.apply import ldconfig, pin, worker
from nvcontainer.cgroups import bpf, rules, v2
from nvcontainer.errors import NvcError
from nvcontainer.fs import mounts
from nvcontainer.inventory.identity import parse_user
from nvcontainer.plan.container import parse_compat_name
from tests.security import _support as s

locate = importlib.import_module("nvcontainer.cgroups.locate")  # the package re-exports a function of that name

EXAMPLES = s.scale(150, 3000)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
REPO = Path(__file__).resolve().parents[2]


# What makes a message lie: line breaks of any kind, terminal controls, bidi reordering.
_FORGING = set(map(chr, range(0x20))) | {chr(0x7F)} | set(map(chr, range(0x80, 0xA0))) | set(
    "\u2028\u2029\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def one_line(exc: NvcError | str) -> None:
    """One line without anything that could forge or reorder text. (Characters that are merely
    invisible, which ``str.isprintable`` also rejects, are the subject of
    ``test_escape_leaves_only_printable_characters``.)"""
    line = str(exc)
    bad = sorted({c for c in line if c in _FORGING or 0xD800 <= ord(c) <= 0xDFFF})
    assert not bad, f"{[hex(ord(c)) for c in bad]} in {line!r}"


def only_nvc_error(call, *args):
    try:
        return call(*args)
    except NvcError as exc:
        one_line(exc)
        return None


# --- the kernel's octal escaping in mountinfo ---------------------------------------------------

def kernel_escape(path: str) -> str:
    """What the kernel writes for a mount point: space, tab, newline and backslash as \\ooo."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


# Characters str.splitlines() breaks on besides "\n" (which the kernel escapes): a mountinfo
# line keeps them raw. See test_line_breaks_in_mount_points_cannot_forge_entries.
LINE_BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
path_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0" + LINE_BREAKS),
                    min_size=1, max_size=40)
mount_points = path_text.map(lambda t: "/" + t)
propagation = st.lists(st.sampled_from(["shared:1", "master:2", "propagate_from:3", "unbindable"]),
                       unique=True, max_size=3)


@FUZZ
@given(st.text(max_size=400))
def test_parse_mountinfo_never_raises(text):
    entries = mounts.parse_mountinfo(text)
    for entry in entries.values():
        assert isinstance(entry.mount_point, str)


@FUZZ
@given(mount_points, mount_points, propagation, st.sampled_from(["ext4", "tmpfs", "proc", "cgroup2"]))
def test_mount_point_names_round_trip(root, point, tags, fstype):
    """A directory name chosen by the container (spaces, newlines, backslashes, lookalike
    ``shared:`` text) cannot change what a line says about propagation or where it is."""
    line = f"36 35 98:0 {kernel_escape(root)} {kernel_escape(point)} rw,noatime {' '.join(tags)} - {fstype} src rw"
    line = line.replace("  ", " ")
    entry = mounts.parse_mountinfo(line)[36]
    assert entry.mount_point == point
    assert entry.shared == ("shared:1" in tags)
    assert entry.fstype == fstype
    parsed = locate.parse_mountinfo_line(line)
    assert parsed is not None and parsed[:3] == (root, point, fstype)


@pytest.mark.parametrize("brk", list(LINE_BREAKS), ids=lambda c: f"U+{ord(c):04X}")
def test_line_breaks_in_mount_points(brk):
    text = (f"36 35 98:0 / /rootfs rw shared:7 - ext4 /dev/vda rw\n"
            f"40 36 98:0 /lib /rootfs/evil{brk}36 ro,nosuid shared:7 - ext4 /dev/vda rw\n")
    entries = mounts.parse_mountinfo(text)
    assert sorted(entries) == [36, 40]
    assert entries[40].mount_point == f"/rootfs/evil{brk}36" and entries[40].shared


cgroup_names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0/"), min_size=1, max_size=12)
cgroup_paths = st.lists(cgroup_names, min_size=0, max_size=4).map(lambda parts: "/" + "/".join(parts))


@FUZZ
@given(st.text(max_size=300))
def test_proc_cgroup_arbitrary_text(text):
    result = only_nvc_error(locate.parse_proc_cgroup, text)
    if result is not None:
        version, path = result
        assert version in (1, 2) and path.startswith("/")
        assert not any(part in (".", "..") for part in path.split("/"))


@FUZZ
@given(cgroup_paths, cgroup_names, st.booleans())
def test_cgroup_names_cannot_forge_lines(path, name, v1):
    """A container names its cgroups: a name carrying a newline and a fake ``devices`` line
    either is refused or leaves the real answer alone, never redirects the rules."""
    forged = f"{name}\n12:devices:/../../escape\n0::/../escape"
    real = f"12:devices:{path}/{forged}" if v1 else f"0::{path}/{forged}"
    text = f"1:name=systemd:/x\n{real}\n"
    result = only_nvc_error(locate.parse_proc_cgroup, text)
    if result is not None:
        assert "escape" not in result[1] or result[1].startswith(path), result


@FUZZ
@given(cgroup_paths, st.sampled_from(["/", "/kubepods", "/kubepods/pod1"]), st.sampled_from([1, 2]))
def test_cgroup_dir_stays_below_the_mount(path, root, version):
    fstype, opts = ("cgroup", "rw,devices") if version == 1 else ("cgroup2", "rw")
    line = f"30 20 0:26 {kernel_escape(root)} /sys/fs/cgroup/x rw - {fstype} cgroup {opts}"
    try:
        checked = locate.parse_proc_cgroup(f"12:devices:{path}\n" if version == 1 else f"0::{path}\n")[1]
        mount = locate.find_cgroup_mount([line], version, checked)
    except NvcError as exc:
        one_line(exc)
        return
    directory = locate.cgroup_dir(checked, mount)
    assert directory == "/sys/fs/cgroup/x" or directory.startswith("/sys/fs/cgroup/x/")
    assert ".." not in directory.split("/")


@FUZZ
@given(st.text(max_size=120))
def test_uid_map(text):
    identity = locate.is_identity_map(text)
    if identity:
        assert text.split() == ["0", "0", "4294967295"]


comm = st.binary(min_size=0, max_size=40).filter(lambda b: b"\0" not in b)


@FUZZ
@given(comm, st.integers(0, 1 << 62), st.integers(2, 1 << 22))
def test_stat_start_time_with_a_hostile_comm(name, start, pid):
    """The process names itself: spaces, parentheses and newlines in comm must not shift the
    fields pin() compares."""
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "0", "0", "0", "0", "0", "0", "0", "0", "20", "0",
              "1", "0", str(start), "1000", "10"]
    line = b"%d (%s) " % (pid, name) + " ".join(fields).encode() + b"\n"
    assert pin.parse_start_time(line) == start


@FUZZ
@given(st.binary(max_size=300))
def test_stat_arbitrary_bytes(data):
    value = pin.parse_start_time(data)
    assert value is None or value >= 0


@FUZZ
@given(st.text(max_size=60) | st.from_regex(r"libcuda\.so\.[0-9]{1,4}(\.[0-9]{1,4}){0,3}", fullmatch=True))
def test_compat_names_from_the_image(name):
    parsed = parse_compat_name(name)
    if parsed is not None:
        version, major = parsed
        assert name == "libcuda.so." + version
        assert major == int(version.split(".")[0])


# --- device rules and programs --------------------------------------------------------------

@FUZZ
@given(st.text(max_size=40) | st.from_regex(r"[cb] [0-9]{1,8}:[0-9]{1,8} [rwm]{1,4}", fullmatch=True))
def test_parse_rule(text):
    rule = only_nvc_error(rules.parse_rule, text)
    if rule is not None:
        assert rules.parse_rule(rule.text) == rule
        assert "*" not in rule.text and rule.type in "cb"


rule_st = st.builds(rules.Rule, st.sampled_from(["c", "b"]), st.integers(0, rules.MAX_MAJOR),
                    st.integers(0, rules.MAX_MINOR), st.sampled_from(["r", "w", "m", "rw", "rm", "wm", "rwm"]))
plain_insns = st.lists(st.sampled_from([
    bpf.mov64_imm(0, 0), bpf.mov64_imm(0, 1), bpf.ldx_w(2, 1, 0), bpf.alu32_imm(bpf.AND, 2, 0xFFFF),
    bpf.jmp_imm(bpf.JNE, 4, 195, 0), bpf.mov32_reg(1, 3)]), max_size=12).map(lambda x: x + [bpf.exit_insn()])
raw_insns = st.binary(min_size=8, max_size=160).map(lambda b: b[: len(b) // 8 * 8]).map(bpf.decode)


@FUZZ
@given(st.lists(rule_st, min_size=1, max_size=6, unique=True), plain_insns)
def test_our_prefix_round_trips(rule_list, tail):
    program = v2.rules_prefix(rule_list) + tail
    assert v2.split_program(program) == (tuple(rule_list), tail)


@FUZZ
@given(raw_insns | plain_insns, st.lists(rule_st, min_size=1, max_size=4))
def test_merge_keeps_the_original_program(existing, new_rules):
    """Whatever the runtime attached, the merged program ends with it unchanged (so every
    verdict it gave still holds) and holds each rule once; or the merge is refused."""
    old_rules, original = v2.split_program(existing)
    assert existing[len(existing) - len(original):] == original
    try:
        merged = v2.merge_program(existing, new_rules)
    except ValueError:
        return
    if merged is None:
        assert set(new_rules) <= set(old_rules)
        return
    assert merged[len(merged) - len(original):] == original
    got, rest = v2.split_program(merged)
    assert rest == original and set(got) == set(old_rules) | set(new_rules) and len(got) == len(set(got))


@FUZZ
@given(st.binary(max_size=200))
def test_decode_and_reload_problem(data):
    try:
        insns = bpf.decode(data)
    except ValueError:
        assert len(data) % 8
        return
    problem = bpf.reload_problem(insns)
    assert problem is None or isinstance(problem, str)


# --- worker replies, ldconfig -----------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=300) | st.builds(lambda t: ('{"error": ["x", %s]}' % t).encode(), st.text(max_size=30)),
       st.integers(-64, 255))
def test_worker_reply(data, status):
    try:
        worker._decode(data, status, "w", "internal")
    except NvcError as exc:
        one_line(exc)
        assert len(str(exc)) < 4200


@FUZZ
@given(st.text(max_size=2000), st.integers(-64, 255), st.text(max_size=60))
def test_ldconfig_failure_is_one_line(output, status, setup_error):
    message = ldconfig.failure_message({"setup_error": setup_error, "status": status, "output": output},
                                       "/sbin/ldconfig")
    if message is not None:
        one_line(message)
        assert len(message) < 1400


@FUZZ
@given(st.binary(max_size=300))
def test_static_elf_check(data):
    problem = ldconfig.static_elf_problem(data)
    assert problem is None or isinstance(problem, str)


@FUZZ
@given(st.lists(st.text(max_size=20), max_size=5))
def test_ldconfig_argv(directories):
    argv = only_nvc_error(ldconfig.ldconfig_argv, directories)
    if argv is not None:
        assert all(not d.startswith("-") for d in argv[5:])


# --- operator inputs and messages -------------------------------------------------------------

@FUZZ
@given(st.text(max_size=200) | st.builds(lambda k, v: f"{k} = {v}\n", st.sampled_from(
    ["root", "ldcache", "debug", "user", "ldconfig", "deadline", "no-cgroups", "swarm-resource",
     "supported-driver-capabilities", "cuda-compat-mode", "x"]),
    st.sampled_from(['"/x"', '"@/sbin/ldconfig"', "1e400", "-1", "true", "[1, 2]", '"a\\nb"', "nan", '""'])))
def test_config_text(text):
    only_nvc_error(config.parse, text, "fuzz.toml")


@FUZZ
@given(st.text(max_size=40) | st.from_regex(r"[0-9a-z]{1,6}(:[0-9a-z]{1,6})?", fullmatch=True))
def test_user_option(text):
    """``--user`` / ``user =``: checked by the config first, then resolved."""
    cfg = only_nvc_error(lambda: Config().with_overrides(user=text))
    if cfg is None:
        return
    ids = only_nvc_error(parse_user, cfg.user)
    if ids is not None:
        assert all(0 <= i < 1 << 32 for i in ids)


@FUZZ
@given(st.lists(st.text(max_size=20), max_size=4))
def test_imex_channels(values):
    from nvcontainer.cli.context import parse_imex_channels

    channels = only_nvc_error(parse_imex_channels, values)
    if channels is not None:
        assert all(0 <= c < 1 << 20 for c in channels) and len(set(channels)) == len(channels)


@FUZZ
@given(st.lists(st.text(max_size=12) | st.sampled_from(["--root", "--debug", "prestart", "--dry-run", "-r"]),
                max_size=5))
def test_hook_argv(argv):
    try:
        opts, dry_run, stage = hook.parse_args(argv)
    except hook.Usage:
        return
    assert isinstance(stage, str) and isinstance(opts, dict) and isinstance(dry_run, bool)


@FUZZ
@given(st.text(max_size=300) | st.binary(max_size=300), st.integers(1, 500))
def test_escape_is_one_bounded_line(value, limit):
    text = errors.escape(value, limit)
    one_line(text)
    assert len(text) <= 10 * limit + 3


@pytest.mark.parametrize("ch", ["\u061c", "\u200b", "\ufeff", "\u00a0", "\u00ad", "\ue000"],
                         ids=lambda c: f"U+{ord(c):04X}")
def test_escape_leaves_only_printable_characters(ch):
    assert errors.escape(f"nvidia{ch}0").isprintable()


# --- atheris ----------------------------------------------------------------------------------

ATHERIS_RUNS = s.scale(2000, 2_000_000)
ATHERIS_SECONDS = s.scale(60, 300)


def _seeds(harness: str, directory: Path) -> None:
    directory.mkdir()
    if harness == "fuzz_ldcache.py":
        shutil.copy("/etc/ld.so.cache", directory / "host.cache")
        (directory / "tiny.cache").write_bytes(s.ld_cache([(0x303, b"libcuda.so.1", b"/usr/lib/libcuda.so.1")]))
    else:
        shutil.copy(sys.executable, directory / "python")
        for lib in ("libz.so.1", "libc.so.6"):
            path = Path("/usr/lib/x86_64-linux-gnu") / lib
            if path.exists():
                shutil.copy(path, directory / lib)


@pytest.mark.parametrize("harness", ["fuzz_ldcache.py", "fuzz_elf.py"])
def test_atheris_bounded_run(tmp_path, harness):
    pytest.importorskip("atheris")
    s.allow_seconds(ATHERIS_SECONDS + 120)
    corpus = tmp_path / "corpus"
    _seeds(harness, corpus)
    res = subprocess.run([sys.executable, str(REPO / "fuzz" / harness), f"-runs={ATHERIS_RUNS}",
                          f"-max_total_time={ATHERIS_SECONDS}", "-rss_limit_mb=1024", "-max_len=65536", str(corpus)],
                         capture_output=True, text=True, timeout=ATHERIS_SECONDS + 60, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Done" in res.stderr, res.stderr[-1000:]
