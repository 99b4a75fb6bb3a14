"""``nvcontainer configure``: inject the driver and the selected GPUs into a created container's
rootfs (or, with ``--dry-run``, print the plan), with ``nvidia-container-cli``'s options."""

from __future__ import annotations

import click

from .context import Context


@click.command()
@click.option("-p", "--pid", type=int, metavar="PID", help="Container init PID (supervised mode).")
@click.option("-d", "--device", "devices", multiple=True, metavar="ID", help="GPUs or MIG devices (repeatable, comma lists); none: the driver only.")
@click.option("-r", "--require", "requirements", multiple=True, metavar="EXPR", help="A requirement every selected GPU must meet (repeatable, ANDed).")
@click.option("-l", "--ldconfig", metavar="@PATH", help="Host ldconfig to run, as @/absolute/path. [default: @/sbin/ldconfig, i.e. /sbin/ldconfig.real where the host has it]")
@click.option("-c", "--compute", is_flag=True, help="Compute libraries and binaries.")
@click.option("-u", "--utility", is_flag=True, help="Utility libraries and binaries (NVML, nvidia-smi).")
@click.option("-v", "--video", is_flag=True, help="Video libraries (brings the compute libraries).")
@click.option("-g", "--graphics", is_flag=True, help="Graphics libraries.")
@click.option("-D", "--display", is_flag=True, help="Display: graphics plus the modeset device.")
@click.option("-n", "--ngx", is_flag=True, help="NGX library.")
@click.option("--compat32", is_flag=True, help="Also the 32-bit libraries.")
@click.option("--mig-config", metavar="ID", help="MIG config capability (only 'all').")
@click.option("--mig-monitor", metavar="ID", help="MIG monitor capability (only 'all').")
@click.option("--imex-channel", "imex", multiple=True, metavar="CHANNEL", help="IMEX channel ids.")
@click.option("--no-cgroups", is_flag=True, help="Leave the devices cgroup alone.")
@click.option("--no-devbind", is_flag=True, help="Do not bind-mount device nodes (cgroup rules are still added).")
@click.option("--no-persistenced", is_flag=True)
@click.option("--no-fabricmanager", is_flag=True)
@click.option("--no-gsp-firmware", is_flag=True)
@click.option("--cuda-compat-mode", type=click.Choice(["ldconfig", "disabled"]), help="CUDA forward compatibility from the image's /usr/local/cuda/compat.")
@click.option("--no-cntlibs", is_flag=True, help="Same as --cuda-compat-mode=disabled.")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: the plan as JSON (docs/plan.md).")
@click.argument("rootfs")
@click.pass_obj
def configure(obj: Context, **params) -> None:
    """Inject the driver and the selected GPUs into ROOTFS of container PID."""
    from .inject import configure as run   # the work itself, shared with nvidia-container-cli's click-free entry

    run(obj, **params)
