"""The mount worker's body alone: how long :func:`nvcontainer.apply.mounter.place` takes for a
plan of the usual shape, without runc, the server, the fork or the disk.

Run, as root, from the repository root::

    .venv/bin/python -m benchmarks.mountplace [RUNS]     # default 30

Why a separate measurement: in a full start the placement is a few milliseconds among
runc's, and its own costs (resolving targets, reading the mount table, checks) drown in the
noise of a shared machine. Here a forked child with a private mount namespace (nothing reaches
the host) runs ``place`` RUNS times on a fresh tmpfs rootfs, with the actions a 2-GPU
``compute,utility`` plan has (one tmpfs and one directory mount below it, 27 file, socket and
directory mounts, 4 devices, 15 library links), and prints the median and minimum wall and CPU
milliseconds of the call. The rootfs is on tmpfs so that the filesystem's own costs (an ext4
mkdir can take 0.4 ms) do not hide ours.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time

from nvcontainer.apply import mounter
from nvcontainer.fs import mounts, syscalls

LIB = "/usr/lib/x86_64-linux-gnu"
BINS = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nv-fabricmanager", "nvidia-cuda-mps-control",
        "nvidia-cuda-mps-server")
LIBS = ("nvidia-ml", "nvidia-cfg", "nvidia-nscq", "cuda", "cudadebugger", "nvidia-opencl", "nvidia-gpucomp",
        "nvidia-ptxjitcompiler", "nvidia-fatbinaryloader", "nvidia-allocator", "nvidia-compiler", "nvidia-pkcs11",
        "nvidia-pkcs11-openssl3", "nvidia-nvvm", "nvidia-tileiras")
DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0")
VERSION = "550.54.14"


def plan_shape() -> list[tuple[str, str, str]]:
    """(op or step, target, kind or link target) in the order prepare() emits them."""
    shape = [("tmpfs", "/proc/driver/nvidia", "dir"), ("mount", "/proc/driver/nvidia/gpus/0000:07:00.0", "dir")]
    shape += [("mount", f"/usr/bin/{b}", "file") for b in BINS]
    shape += [("mount", f"{LIB}/lib{name}.so.{VERSION}", "file") for name in LIBS]
    shape += [("mount", f"/usr/lib/firmware/nvidia/{VERSION}/gsp_{g}.bin", "file") for g in ("ga10x", "tu10x")]
    shape += [("mount", f"/run/{d}/socket", "socket") for d in ("nvidia-persistenced", "nvidia-fabricmanager")]
    shape += [("mount", "/tmp/nvidia-mps", "dir")]
    shape += [("device", f"/dev/{d}", "file") for d in DEVICES]
    for name in LIBS:
        shape.append(("symlink", f"{LIB}/lib{name}.so.1", f"lib{name}.so.{VERSION}"))
    return shape


def actions_for(shape, sources: dict[str, str]) -> list[dict]:
    actions = []
    for step, target, arg in shape:
        if step == "symlink":
            actions.append({"op": "symlink", "target": target, "link": arg})
            continue
        if step == "tmpfs":
            fd = mounts.tmpfs_detached({"mode": "0555", "size": "1m"}, 0)
            os.makedirs(f"/proc/self/fd/{fd}/gpus/0000:07:00.0")
        else:
            fd = mounts.clone_mount(sources[arg], syscalls.MOUNT_ATTR_RDONLY | syscalls.MOUNT_ATTR_NOSUID)
        actions.append({"op": "mount", "fd": fd, "target": target, "kind": arg, "step": step})
    return actions


def measure(runs: int, top: str) -> tuple[list[float], list[float]]:
    sources = {"file": f"{top}/src/file", "dir": f"{top}/src/dir", "socket": f"{top}/src/socket"}
    os.makedirs(sources["dir"])
    with open(sources["file"], "w") as fh:
        fh.write("payload")
    socket.socket(socket.AF_UNIX).bind(sources["socket"])
    syscalls.unshare(syscalls.CLONE_NEWNS)
    syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)
    ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    shape, wall, cpu = plan_shape(), [], []
    for i in range(runs + 1):   # the first run warms caches and is not counted
        scratch = f"{top}/run{i}"
        os.mkdir(scratch)
        syscalls.mount("tmpfs", scratch, "tmpfs", 0)
        for d in ("usr/lib/x86_64-linux-gnu", "usr/bin", "proc/driver", "dev", "run", "tmp", "etc"):
            os.makedirs(f"{scratch}/rootfs/{d}")
        actions = actions_for(shape, sources)
        here = os.getcwd()
        w, c = time.perf_counter(), time.process_time()
        reply = mounter.place(ns, f"{scratch}/rootfs", actions)
        w, c = time.perf_counter() - w, time.process_time() - c
        os.chdir(here)
        if reply["done"] != len(actions) or reply["warnings"]:
            raise SystemExit(f"mountplace: unexpected reply {reply}")
        if i:
            wall.append(w * 1000)
            cpu.append(c * 1000)
        for a in actions:
            if "fd" in a:
                os.close(a["fd"])
        syscalls.umount2(scratch, syscalls.MNT_DETACH)
    return wall, cpu


def main(argv: list[str]) -> int:
    runs = int(argv[0]) if argv and argv[0].isascii() and argv[0].isdigit() else 30
    if os.geteuid() != 0:
        print("mountplace: needs root (mount namespaces)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="nvc-mountplace-") as top:
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:   # the namespace and its mounts go away with this child
            status = 1
            try:
                os.close(rfd)
                wall, cpu = measure(runs, top)
                os.write(wfd, (f"place() over {runs} runs, {len(plan_shape())} actions: "
                               f"wall median {statistics.median(wall):.2f} ms (min {min(wall):.2f}), "
                               f"cpu median {statistics.median(cpu):.2f} ms (min {min(cpu):.2f})\n").encode())
                status = 0
            except BaseException as exc:
                os.write(wfd, f"mountplace: {type(exc).__name__}: {exc}\n".encode())
            finally:
                os._exit(status)
        os.close(wfd)
        with os.fdopen(rfd, "rb") as fh:
            report = fh.read().decode(errors="replace")
        _, status = os.waitpid(pid, 0)
    print(report, end="", file=sys.stdout if os.waitstatus_to_exitcode(status) == 0 else sys.stderr)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
