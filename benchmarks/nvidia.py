"""NVIDIA's own hook as an arm of the same interleaved run: the yardstick of issues 17's and 27's
targets (``benchmarks/targets.py`` judges them).

Why an arm and not a remembered figure: absolute times on these shared 2-vCPU machines drift
from run to run, so every target is a ratio of overheads over the run's own no-hook arm, with
NVIDIA's hook 1.17.9 + nvidia-container-cli 1.17.0 timed beside ours in the very same rounds.
The binaries come from ``../shared/anchors/nvidia-anchors.tar.xz`` (built from NVIDIA's public
sources; see its README) and are unpacked into the run's temporary workspace, never into the
repository; without the tarball the arm is left out and the report says so.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from . import workspace

TARBALL = workspace.REPO.parent / "shared" / "anchors" / "nvidia-anchors.tar.xz"
CAPABILITIES = "compat32,compute,display,graphics,ngx,utility,video"

# The 1.17.9 hook always passes --cuda-compat-mode (whatever [modes.legacy] says), which the
# 1.17.0 cli does not know: this static program drops that one argument and executes the cli.
# It adds one exec of a tiny static program (about 0.2 ms) to NVIDIA's arm, in NVIDIA's favour
# of nothing: the figure is, if anything, that much worse for them.
CLI_SHIM_C = r"""
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char *args[argc + 1];
    int n = 0;
    for (int i = 0; i < argc; i++)
        if (strncmp(argv[i], "--cuda-compat-mode", 18)) args[n++] = argv[i];
    args[n] = 0;
    execv(REAL_CLI, args);
    return 127;
}
"""


def hook_entry(base: Path, machine, tarball: Path = TARBALL) -> dict | None:
    """The prestart entry that runs NVIDIA's hook against the fake ``machine``, as the anchors'
    README registers it; None without the tarball."""
    if not tarball.is_file():
        return None
    root = machine.root
    # NVIDIA's cli loads NVML chrooted into the driver root; the mock NVML reads its config at
    # the absolute path it was built with, so that path must exist inside the root too (a hard
    # link: the knobs a run turns in the config are seen there as well)
    inside = root / machine.nvml_config.relative_to("/")
    inside.parent.mkdir(parents=True, exist_ok=True)
    if not inside.exists():
        try:
            inside.hardlink_to(machine.nvml_config)
        except OSError:
            shutil.copy2(machine.nvml_config, inside)
    # and it reads the GPUs' procfs files under the driver root too: there, the world's own
    # /proc/driver/nvidia (the fake machine's, bound over it) is what it must find
    proc_driver = root / "proc" / "driver"
    proc_driver.mkdir(parents=True, exist_ok=True)
    if not (proc_driver / "nvidia").is_symlink():
        (proc_driver / "nvidia").symlink_to("/proc/driver/nvidia")
    dest = base / "nvidia"
    dest.mkdir(exist_ok=True)
    subprocess.run(["tar", "-xJf", str(tarball), "-C", str(dest)], check=True)
    top = dest / "nvidia-anchors"
    cli = build_cli_shim(dest, top / "bin" / "nvidia-container-cli")
    config = write_config(dest / "config.toml", cli, f"{top}/lib", root=str(root))
    hook = top / "bin" / "nvidia-container-runtime-hook"
    return {"path": str(hook), "args": ["nvidia-container-runtime-hook", "-config", str(config), "prestart"],
            "env": workspace.HOOK_ENV, "timeout": 60}


def build_cli_shim(dest: Path, real_cli: Path) -> Path:
    """``dest/nvidia-container-cli``: :data:`CLI_SHIM_C` built to execute ``real_cli``; static
    where the C library allows it, as the benchmarks' other helper programs."""
    source = dest / "cli-shim.c"
    source.write_text(CLI_SHIM_C)
    program = dest / "nvidia-container-cli"
    cc = shutil.which("musl-gcc") or "gcc"
    argv = [cc, "-O2", f'-DREAL_CLI="{real_cli}"', "-o", str(program), str(source)]
    if subprocess.run([*argv, "-static"], stderr=subprocess.DEVNULL).returncode != 0:
        subprocess.run(argv, check=True)   # a node without a static C library
    return program


def write_config(path: Path, cli: Path, library_path: str, *, root: str | None = None, legacy: bool = False) -> Path:
    """The ``config.toml`` NVIDIA's hook is registered with (the anchors' README): its cli (the
    shim), the driver ``root`` (default ``/``), the cli's ``LD_LIBRARY_PATH``, host ldconfig, no
    module loading; mode ``auto``, or ``legacy`` with the compat mode the 1.17.0 cli knows."""
    lines = [f'supported-driver-capabilities = "{CAPABILITIES}"',
             "[nvidia-container-cli]",
             f'path = "{cli}"',
             *([f'root = "{root}"'] if root else []),
             f'environment = ["LD_LIBRARY_PATH={library_path}"]',
             'ldconfig = "@/sbin/ldconfig"',
             "load-kmods = false",
             "[nvidia-container-runtime]",
             'mode = "legacy"' if legacy else 'mode = "auto"']
    if legacy:
        lines += ["[nvidia-container-runtime.modes.legacy]", 'cuda-compat-mode = ""']
    path.write_text("\n".join(lines) + "\n")
    return path
