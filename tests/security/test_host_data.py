"""Malformed host data: the driver root is trusted, but fragile, and sometimes wrong.

Each case damages a private copy of the fake machine's driver root: its ``ld.so.cache``
(truncated, absurd counts and offsets, entries pointing out of the root, at directories, at
device nodes, or carrying newlines and terminal escapes), a driver library's ELF header
(absurd table counts and offsets, truncation, wrong class or machine), or a device node (the
wrong ``st_rdev``, a FIFO, a regular file, a symlink). Whatever the damage, a run must either
succeed without using the damaged piece or fail with one clean line; it must never mount or
allow anything that is not the real driver's: every mount source lies inside the driver root,
no device beyond the requested ones is allowed, and a device node in the container has the
``st_rdev`` its name promises.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess

import pytest

from nvcontainer.inventory import ldcache
from tests.fixtures.fakegpu.runner import fake_proc_command
from tests.security import _support as s
from tests.security.conftest import RUN_SECONDS, fresh_image

LIB = s.LIB_DIR


def _real_cache(root) -> tuple[bytes, list]:
    data = (root / "etc/ld.so.cache").read_bytes()
    return data, [(e.flags, e.key.encode(), e.value.encode()) for e in ldcache.parse(data)]


def _retarget(entries, soname: bytes, value: bytes) -> list:
    return [(f, k, value if k == soname else v) for f, k, v in entries]


def _caches(sentinel) -> dict:
    """name -> function(real cache bytes, entries) -> hostile cache bytes."""
    victim = str(sentinel.victim).encode()
    return {
        "empty": lambda data, e: b"",
        "truncated-header": lambda data, e: data[:24],
        "truncated-entries": lambda data, e: data[: len(data) // 3],
        "truncated-strings": lambda data, e: data[:-7],
        "huge-nlibs": lambda data, e: s.ld_cache(e, nlibs=0x7FFFFFFF),
        "offsets-out-of-range": lambda data, e: s.ld_cache(e, raw_offsets={0: (1 << 31, 1 << 31)}),
        "offsets-into-the-header": lambda data, e: s.ld_cache(e, raw_offsets={i: (3, 5) for i in range(len(e))}),
        "outside-root-absolute": lambda data, e: s.ld_cache(_retarget(e, b"libcuda.so.1", victim)),
        "outside-root-dotdot": lambda data, e: s.ld_cache(
            _retarget(e, b"libcuda.so.1", b"/usr/lib/../../../../../../../../.." + victim)),
        "outside-root-proc": lambda data, e: s.ld_cache(
            _retarget(e, b"libcuda.so.1", b"/proc/self/root" + victim)),
        "nvml-outside-root": lambda data, e: s.ld_cache(_retarget(e, b"libnvidia-ml.so.1", victim)),
        "directory": lambda data, e: s.ld_cache(_retarget(e, b"libcuda.so.1", b"/usr/lib/x86_64-linux-gnu")),
        "device-node": lambda data, e: s.ld_cache(_retarget(e, b"libcuda.so.1", b"/dev/nvidia0")),
        "hostile-text": lambda data, e: s.ld_cache(
            _retarget(e, b"libcuda.so.1", b"/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14\n\x1b[2J\xe2\x80\xae")),
        "every-entry-twice": lambda data, e: s.ld_cache(e + list(reversed(e))),
    }


_CACHE_NAMES = list(_caches(type("S", (), {"victim": "/v"})()).keys())
# the default run takes one case of each kind of damage; the long run all of them
_CI_CACHES = ("empty", "truncated-entries", "huge-nlibs", "offsets-out-of-range", "outside-root-dotdot",
              "nvml-outside-root", "device-node", "hostile-text")


def _plan_sources(machine, root, rootfs, variant) -> list[str]:
    """Mount and device sources of the plan configure would carry out (``--dry-run --json``)."""
    argv = fake_proc_command(machine, [*s.nvc_argv("cli", no_openat2=variant.no_openat2), "--root", str(root),
                                       "configure", "--dry-run", "--json",
                                       "-d", "0", "-c", "-u", str(rootfs)])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_SECONDS)
    if res.returncode:
        s.one_line(res.stderr, "nvcontainer: ")
        return []
    plan = json.loads(res.stdout)
    return [m["source"] for m in plan["mounts"]] + [d["source"] for d in plan["devices"]]


def _mount_roots(pid: int) -> list[str]:
    """The 'root' field of each mountinfo line of ``pid``: for a bind mount, where its source
    lies within its filesystem."""
    with open(f"/proc/{pid}/mountinfo") as fh:
        return [line.split(" ")[3] for line in fh]


JUDGES = s.variants((s.DIRECT_V1,), s.DIRECT)


def _judge(machine, root, rootfs, workdir, variant=s.DIRECT_V1) -> None:
    # (a source may still be a symlink here: the apply step opens sources without following
    # them, and what it mounted is checked below)
    for source in _plan_sources(machine, root, rootfs, variant):
        assert os.path.normpath(source).startswith(str(root) + "/") or source.startswith("/proc/driver/"), source
    probe = s.Probe(machine, workdir / "probe")
    with s.Container(rootfs, cgroup_version=2 if variant.cgroup2 else 1) as c:
        before = set(_mount_roots(c.pid))
        res = subprocess.run(s.configure_command(machine, variant, c.pid, rootfs), capture_output=True,
                             text=True, timeout=RUN_SECONDS)
        out = s.Outcome(variant.name, res.returncode, stderr=res.stderr, new_mounts=c.new_mounts(),
                        host_mounts_in_rootfs=s.mounts_under(s.mounts_of(), rootfs))
        granted = probe.granted(c.cgroup)
        # a damaged node may be left out of an otherwise working container: only "nothing more"
        s.check_run(out, rootfs, machine, granted, "nvcontainer: ", exact=False)
        for source in set(_mount_roots(c.pid)) - before:
            assert source == "/" or source.startswith((str(root) + "/", str(machine.proc) + "/")), \
                f"mounted from outside the driver: {source}"
        node = f"/proc/{c.pid}/root{rootfs}/dev/nvidia0"
        if os.path.lexists(node):
            st = os.lstat(node)
            if stat.S_ISCHR(st.st_mode):
                assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 0), "/dev/nvidia0 is another device"


@pytest.mark.parametrize("variant", JUDGES, ids=str)
@pytest.mark.parametrize("case", _CACHE_NAMES if s.LONG else _CI_CACHES)
def test_hostile_ld_cache(sec_machine, host_sentinel, workdir, case, variant):
    root = workdir / "root"
    machine = s.copy_machine(sec_machine, root)
    data, entries = _real_cache(root)
    (root / "etc/ld.so.cache").write_bytes(_caches(host_sentinel)[case](data, entries))
    rootfs = fresh_image(workdir / "rootfs", machine)
    _judge(machine, root, rootfs, workdir, variant)


def _elf(field: str, value: int):
    offsets = {"e_phoff": (32, "<Q"), "e_shoff": (40, "<Q"), "e_phentsize": (54, "<H"), "e_phnum": (56, "<H"),
               "e_shentsize": (58, "<H"), "e_shnum": (60, "<H"), "e_shstrndx": (62, "<H"), "e_machine": (18, "<H"),
               "ei_class": (4, "<B"), "ei_data": (5, "<B")}
    offset, fmt = offsets[field]

    def damage(data: bytes) -> bytes:
        out = bytearray(data)
        struct.pack_into(fmt, out, offset, value)
        return bytes(out)
    return damage


def _dynamic_strtab_out_of_file(data: bytes) -> bytes:
    """Point DT_STRTAB (and so DT_SONAME) far beyond the end of the file."""
    out = bytearray(data)
    phoff, = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 2:  # PT_DYNAMIC
            for at in range(p_offset, p_offset + p_filesz, 16):
                tag, _ = struct.unpack_from("<qQ", data, at)
                if tag in (5, 10):  # DT_STRTAB, DT_STRSZ
                    struct.pack_into("<Q", out, at + 8, 1 << 40)
    return bytes(out)


ELF_CASES = {
    "phnum-max": _elf("e_phnum", 0xFFFF),
    "phoff-beyond-eof": _elf("e_phoff", 1 << 40),
    "phentsize-tiny": _elf("e_phentsize", 1),
    "shoff-beyond-eof": _elf("e_shoff", 1 << 62),
    "shnum-max": _elf("e_shnum", 0xFFFF),
    "shstrndx-out-of-range": _elf("e_shstrndx", 0xFFFE),
    "shentsize-zero": _elf("e_shentsize", 0),
    "class-invalid": _elf("ei_class", 7),
    "class-32": _elf("ei_class", 1),
    "byte-order-invalid": _elf("ei_data", 9),
    "machine-aarch64": _elf("e_machine", 183),
    "truncated-64": lambda data: data[:64],
    "truncated-20": lambda data: data[:20],
    "strtab-out-of-file": _dynamic_strtab_out_of_file,
    "not-elf": lambda data: b"#!/bin/sh\necho not a library\n" * 100,
}


@pytest.mark.parametrize("variant", JUDGES, ids=str)
@pytest.mark.parametrize("library", ["libcuda.so.550.54.14"] + (["libnvidia-ml.so.550.54.14"] if s.LONG else []))
@pytest.mark.parametrize("case", list(ELF_CASES) if s.LONG else
                         ["phnum-max", "phoff-beyond-eof", "shoff-beyond-eof", "shstrndx-out-of-range", "class-32",
                          "machine-aarch64", "truncated-64", "strtab-out-of-file"])
def test_absurd_elf_headers(sec_machine, host_sentinel, workdir, case, library, variant):
    root = workdir / "root"
    machine = s.copy_machine(sec_machine, root)
    path = root / LIB / library
    path.write_bytes(ELF_CASES[case](path.read_bytes()))
    rootfs = fresh_image(workdir / "rootfs", machine)
    _judge(machine, root, rootfs, workdir, variant)


def _node(kind: str):
    def make(path) -> None:
        os.unlink(path)
        if kind == "null":
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        elif kind == "other-gpu":
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(195, 1))
        elif kind == "block":
            os.mknod(path, 0o666 | stat.S_IFBLK, os.makedev(195, 0))
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "file":
            path.write_text("not a device\n")
        elif kind == "link-null":
            os.symlink("/dev/null", path)
        elif kind == "link-sibling":
            os.symlink("nvidia1", path)
        elif kind == "missing":
            pass
    return make


@pytest.mark.parametrize("variant", JUDGES, ids=str)
@pytest.mark.parametrize("node", ["nvidia0", "nvidiactl"] if s.LONG else ["nvidia0"])
@pytest.mark.parametrize("kind", ["null", "other-gpu", "block", "fifo", "file", "link-null", "link-sibling", "missing"])
def test_device_node_with_the_wrong_identity(sec_machine, host_sentinel, workdir, node, kind, variant):
    root = workdir / "root"
    machine = s.copy_machine(sec_machine, root)
    _node(kind)(root / "dev" / node)
    rootfs = fresh_image(workdir / "rootfs", machine)
    _judge(machine, root, rootfs, workdir, variant)


@pytest.mark.parametrize("variant", s.variants((s.RUNC_V1, s.CRUN_V1, s.RUNC_FALLBACK), s.RUNTIMES), ids=str)
@pytest.mark.parametrize("damage", ["cache-outside-root", "elf-phnum", "node-other-gpu"] if s.LONG else ["node-other-gpu"])
def test_hostile_host_data_under_a_runtime(sec_machine, host_sentinel, workdir, variant, damage):
    s.need_runtime(variant, sec_machine)
    root = workdir / "root"
    machine = s.copy_machine(sec_machine, root)
    if damage == "cache-outside-root":
        data, entries = _real_cache(root)
        (root / "etc/ld.so.cache").write_bytes(_caches(host_sentinel)["outside-root-dotdot"](data, entries))
    elif damage == "elf-phnum":
        path = root / LIB / "libcuda.so.550.54.14"
        path.write_bytes(ELF_CASES["phnum-max"](path.read_bytes()))
    else:
        _node("other-gpu")(root / "dev/nvidia0")
    run = s.run_runtime(machine, workdir, variant,
                        script='echo "NODE0:$(stat -c %t:%T /dev/nvidia0 2>&1)"')
    out = run.outcome
    ok = s.check_run(out, run.rootfs, machine, run.granted if "DONE" in out.facts else None, "nvcontainer-hook: ",
                     exact=False)
    node0 = out.facts.get("NODE0", [""])[0]
    if ok and not node0.startswith("stat:"):
        assert node0 == "c3:0", f"/dev/nvidia0 in the container is {node0} (hex major:minor), not 195:0"
    assert not host_sentinel.damage()
