"""Everything the benchmarks run against, laid out in one temporary directory.

* Fake GPU machines (``tests/fixtures/fakegpu``): a fast one, and one whose mock NVML takes
  ``init_delay_ms`` to initialise, as a real driver without persistence mode does.
* A production-like interpreter: a virtual environment of the same Python binary whose
  ``site-packages`` holds one ``.pth`` with plain directory lines (this checkout, and the
  development environment's ``site-packages`` for the dependencies), and console scripts written
  the way pip writes them. That is what a regular (non-editable) install looks like at start-up:
  an editable install instead runs setuptools' import finder on every interpreter start.
* A socket directory per world for the resident ``nvcontainer serve`` (root-owned, 0700, as the
  server demands), and the registrations that reach it: the ones ``nvcontainer setup --serve``
  writes (the native client it builds with the node's C compiler, and without a compiler the
  bare Python client ``python -I -S <package>/nvcontainer/hook/client.py --socket ...``) and the
  console script with ``--socket``.
* OCI bundles: one per container run, each with a fresh copy (hard links) of a busybox rootfs,
  as an engine gives every container a fresh rootfs; ``/proc/driver`` is a tmpfs from the spec,
  standing in for the real driver's procfs directory that the containers' procfs lacks here.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from nvcontainer.native import build as nativeclient
from tests.fixtures.fakegpu import FakeSpec, build
from tests.fixtures.fakegpu.build import FakeMachine
from tests.fixtures.runtime import BUSYBOX, busybox_rootfs

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "benchmarks" / "probe.py"
HOOK_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
# The server's environment, as a service manager gives it: the hook's PATH, so that the inventory
# it builds at start-up is the very cache entry the hooks' requests look up (PATH is one of its keys).
SERVER_ENV = {"PATH": HOOK_ENV[0].split("=", 1)[1]}
CONTAINER_ENV = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]

# What pip writes for a console_scripts entry point (the interpreter path goes on line one).
CONSOLE_SCRIPT = """\
# -*- coding: utf-8 -*-
import re
import sys
from {module} import {function}
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit({function}())
"""


# Reads the OCI state on stdin and makes <bundle>/rootfs/proc/driver/nvidia in the container's
# mount namespace (the bundles' root is always "rootfs"; the state is ours, not hostile).
PROC_DRIVER_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
static char state[65536];
int main(void) {
    ssize_t n, used = 0;
    while ((n = read(0, state + used, sizeof state - 1 - used)) > 0) used += n;
    state[used] = 0;
    char *pid = strstr(state, "\"pid\":"), *bundle = strstr(state, "\"bundle\":\"");
    if (!pid || !bundle) return 2;
    bundle += 10;
    char *end = strchr(bundle, '"');
    if (!end) return 2;
    *end = 0;
    char ns[64], dir[4096];
    snprintf(ns, sizeof ns, "/proc/%ld/ns/mnt", strtol(pid + 6, NULL, 10));
    int fd = open(ns, O_RDONLY);
    if (fd < 0 || setns(fd, CLONE_NEWNS) < 0) return 3;
    snprintf(dir, sizeof dir, "%s/rootfs/proc/driver/nvidia", bundle);
    return mkdir(dir, 0555) == 0 ? 0 : 4;
}
"""


@dataclass
class Workspace:
    base: Path
    python: Path          # the production-like interpreter
    native_client: Path   # the native hook client, built for that interpreter as setup does
    hook: Path            # its nvcontainer-hook console script
    cli: Path             # its nvcontainer console script
    package_dir: Path     # the tree that interpreter imports nvcontainer from
    editable_hook: Path | None   # the development environment's own nvcontainer-hook, if any
    others: dict          # label -> nvcontainer-hook of another tree (--compare)
    template: Path        # pristine busybox rootfs
    spec: dict            # `runc spec` output, the base of every bundle

    def machine(self, name: str, spec: FakeSpec) -> FakeMachine:
        dest = self.base / name
        dest.mkdir(mode=0o755)
        return build(dest, spec)

    def bundle(self, prestart: list[dict], *, env=CONTAINER_ENV) -> Path:
        """A bundle whose container runs busybox ``true`` after the given prestart hooks."""
        name = f"b-{uuid.uuid4().hex[:10]}"
        bundle = self.base / "bundles" / name
        bundle.mkdir(parents=True)
        subprocess.run(["cp", "-al", str(self.template), str(bundle / "rootfs")], check=True)
        spec = copy.deepcopy(self.spec)
        process = spec["process"]
        process.update(terminal=False, args=["/bin/true"], env=["PATH=/usr/sbin:/usr/bin:/sbin:/bin", *env],
                       noNewPrivileges=True)
        for key in ("bounding", "effective", "permitted", "ambient"):
            process["capabilities"][key] = ["CAP_CHOWN", "CAP_MKNOD", "CAP_KILL"]
        spec["root"] = {"path": "rootfs", "readonly": False}
        spec["mounts"].append({"destination": "/proc/driver", "type": "tmpfs", "source": "nvc-bench",
                               "options": ["nosuid", "nodev", "noexec", "mode=555"]})
        spec["hooks"] = {"prestart": [self.proc_driver_entry(), *prestart]}
        spec["linux"]["cgroupsPath"] = f"/nvc-bench/{name}"
        (bundle / "config.json").write_text(json.dumps(spec))
        return bundle

    def proc_driver_entry(self) -> dict:
        """A first prestart hook in every arm (no-hook included, so it cancels out): a real
        driver's procfs has ``driver/nvidia`` in every container, these containers' ``/proc/driver``
        is an empty tmpfs, and both our hook and NVIDIA's cli mount over ``/proc/driver/nvidia``.
        A tiny static program (a Python one would cost each arm 20 ms of noise)."""
        program = self.base / "mkdir-proc-driver"
        if not program.exists():
            source = self.base / "mkdir-proc-driver.c"
            source.write_text(PROC_DRIVER_C)
            cc = shutil.which("musl-gcc") or "gcc"
            subprocess.run([cc, "-static", "-O2", "-o", str(program), str(source)], check=True)
        return {"path": str(program), "args": ["mkdir-proc-driver"], "env": HOOK_ENV, "timeout": 60}

    # Hook registrations, as hooks/oci-hook-entry.json writes them.

    def hook_entry(self, machine: FakeMachine, script: Path | None = None, *extra: str) -> dict:
        return {"path": str(script or self.hook), "args": ["nvcontainer-hook", *extra, "--root", str(machine.root),
                                                           "prestart"], "env": HOOK_ENV, "timeout": 60}

    def served_entry(self, machine: FakeMachine, socket: Path, *, native: bool = True) -> dict:
        """The registration ``nvcontainer setup --serve`` writes: the native client it builds
        where a C compiler is found; ``native=False``: the one it writes without a compiler, the
        Python client run without ``site`` (it imports only built-in modules)."""
        argv = self.client_argv(machine, socket, native=native)
        return {"path": argv[0], "args": argv, "env": HOOK_ENV, "timeout": 60}

    def client_argv(self, machine: FakeMachine, socket: Path, *, native: bool = True) -> list[str]:
        program = [str(self.native_client)] if native else \
            [str(self.python), "-I", "-S", str(self.package_dir / "nvcontainer" / "hook" / "client.py")]
        return [*program, "--socket", str(socket), "--root", str(machine.root), "prestart"]

    def socket(self, world: str) -> Path:
        """Where a world's server listens: a fresh root-owned 0700 directory per world, so that
        no server of one world (mount namespace) is ever asked by the hooks of another."""
        directory = self.base / f"serve-{world}"
        directory.mkdir(mode=0o700)
        directory.chmod(0o700)
        return directory / "hook.sock"

    def server_argv(self, machine: FakeMachine, socket: Path) -> list[str]:
        """``nvcontainer serve`` as a service manager would start it, from the production-like
        interpreter (never the editable development one: its import finder costs every child)."""
        return [str(self.python), "-m", "nvcontainer", "--root", str(machine.root), "serve", "--socket", str(socket)]

    def probe_entry(self, out: Path, argv: list[str], stderr: Path | None = None) -> dict:
        """``argv`` run under the probe, which records its wall time and peak RSS in ``out``."""
        tail = ["--stderr", str(stderr)] if stderr else []
        return {"path": str(self.python), "args": [str(self.python), "-I", "-S", str(PROBE), str(out), *tail, "--",
                                                    *argv], "env": HOOK_ENV, "timeout": 60}


def empty_hook_entry() -> dict:
    """A prestart hook that does nothing: the static busybox's ``true`` (runc's own cost of
    running any hook, the floor under "a container that asks for no GPU")."""
    return {"path": str(BUSYBOX), "args": ["true"], "env": HOOK_ENV, "timeout": 60}


def create(base: Path, compare: dict[str, str] | None = None) -> Workspace:
    """``compare``: label -> a directory holding another ``nvcontainer`` package, or ``git:REV``
    for the tree of a commit (extracted with ``git archive``), to time beside this checkout."""
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)   # the unprivileged NVML helper must read the driver roots below
    installed = os.environ.get("NVC_BENCH_INSTALL")   # an installed tree (a package's /usr/lib/nvcontainer)
    if installed:                                      # timed as it is, its own prebuilt programs
        tree_bin = Path(installed) / "bin"
        python, hook, cli = tree_bin / "python3", tree_bin / "nvcontainer-hook", tree_bin / "nvcontainer"
        native_client = tree_bin / nativeclient.NAME
        package_dir = package_dir_of(python)
    else:
        python, hook, cli = production_venv(base / "venv")
        package_dir = package_dir_of(python)
        native_client = base / "venv" / "bin" / nativeclient.NAME
        nativeclient.build(str(native_client), str(python))
    others = {}
    for label, where in (compare or {}).items():
        tree = base / f"tree-{label}"
        if where.startswith("git:"):
            tree.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", where[4:], "nvcontainer"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        else:
            shutil.copytree(Path(where) / "nvcontainer", tree / "nvcontainer")
        others[label] = production_venv(base / f"venv-{label}", tree)[1]
    template = busybox_rootfs(base / "rootfs-template")
    editable = Path(sys.prefix) / "bin" / "nvcontainer-hook"
    spec_dir = base / "spec"
    spec_dir.mkdir()
    subprocess.run(["runc", "spec"], cwd=spec_dir, check=True)
    spec = json.loads((spec_dir / "config.json").read_text())
    return Workspace(base=base, python=python, native_client=native_client, hook=hook, cli=cli,
                     package_dir=package_dir,
                     editable_hook=editable if editable.exists() else None, others=others, template=template,
                     spec=spec)


def production_venv(dest: Path, tree: Path = REPO) -> tuple[Path, Path, Path]:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]   # where this (development) interpreter has click, pynvml, ...
    Path(purelib, "nvcontainer-bench.pth").write_text(f"{tree}\n{deps}\n")
    # the entry points of that tree's layout (4edd867 and before: flat modules hook.py, cli.py)
    package = tree / "nvcontainer"
    hook_module = "nvcontainer.hook.main" if (package / "hook" / "main.py").exists() else "nvcontainer.hook"
    cli_module = "nvcontainer.cli.main" if (package / "cli" / "main.py").exists() else "nvcontainer.cli"
    scripts = {}
    for name, module in (("nvcontainer-hook", hook_module), ("nvcontainer", cli_module)):
        path = dest / "bin" / name
        path.write_text(f"#!{python}\n" + CONSOLE_SCRIPT.format(module=module, function="main"))
        path.chmod(0o755)
        scripts[name] = path
    if (package / "native" / "front.c").exists():
        # as installed now: nvcontainer-hook is the static clean-environment front (native/front.c)
        subprocess.run([str(python), "-I", "-c", "import sys; from nvcontainer.native import build; "
                        "build.build_fronts(sys.argv[1], sys.argv[2])", str(dest / "bin"), str(python)], check=True)
    return python, scripts["nvcontainer-hook"], scripts["nvcontainer"]


def package_dir_of(python: Path) -> Path:
    """The directory holding the ``nvcontainer`` package that ``python`` imports, asked of the
    interpreter itself (outside this checkout's working directory and environment), so the
    served registration names the very tree the server runs."""
    out = subprocess.run([str(python), "-I", "-c", "import nvcontainer, os; print(os.path.dirname(nvcontainer.__path__[0]))"],
                         capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    return Path(out)


def remove(base: Path) -> None:
    shutil.rmtree(base, ignore_errors=True)


def world_python_env() -> dict:
    """Environment for the process that runs inside a fake machine's /proc view."""
    return dict(os.environ, PYTHONPATH=str(REPO))


def save(out: Path, name: str, record: dict) -> None:
    """A benchmark's record as ``out/<name>-<local time>.json`` and ``out/<name>-latest.json``."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=1)
    (out / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.json").write_text(text)
    (out / f"{name}-latest.json").write_text(text)


def with_machine(prefix: str) -> tuple[Workspace, FakeMachine]:
    """A workspace in a fresh temporary directory named ``prefix...`` (0755: the NVML helper
    reads below it) and the fast 2-GPU fake machine in it; ``ws.base.parent`` is for the
    caller's own files and is the one to remove."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    base.chmod(0o755)
    ws = create(base / "ws")
    return ws, ws.machine("fast", FakeSpec(gpus=2, decoys=False))
