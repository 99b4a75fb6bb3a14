"""``nvcontainer configure``: inject the driver and the selected GPUs into a created container's
rootfs (or, with ``--dry-run``, print the plan), with ``nvidia-container-cli``'s options."""

from __future__ import annotations

import sys
import time

import click

from ..errors import NvcError, escape
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
def configure(obj: Context, pid, devices, requirements, ldconfig, compute, utility, video, graphics, display, ngx,
              compat32, mig_config, mig_monitor, imex, no_cgroups, no_devbind, no_persistenced, no_fabricmanager,
              no_gsp_firmware, cuda_compat_mode, no_cntlibs, dry_run, as_json, rootfs) -> None:
    """Inject the driver and the selected GPUs into ROOTFS of container PID."""
    started = time.monotonic()  # one deadline for the whole run: NVML, mounts, cgroup, ldconfig
    from ..plan.gather import check_rootfs, options_from_config, plan_for
    from ..request.decide import request_from_options

    check_rootfs(rootfs)
    if pid is not None and not 1 < pid < (1 << 22):
        raise NvcError("input", f"invalid pid: {pid}")
    if ldconfig is not None and not (ldconfig.startswith("@/") and len(ldconfig) > 2):
        raise NvcError("input", f"--ldconfig: {escape(ldconfig)}: must be @ and an absolute host path "
                       "(an image's own ldconfig is never run)")
    flags = {"compute": compute, "utility": utility, "video": video, "graphics": graphics,
             "display": display, "ngx": ngx, "compat32": compat32}
    request = request_from_options(
        devices=devices, capabilities=[name for name, on in flags.items() if on], requirements=requirements,
        mig_config=mig_config, mig_monitor=mig_monitor, imex_channels=imex,
    )
    options = options_from_config(
        obj.config, no_cgroups=no_cgroups, no_devbind=no_devbind, no_persistenced=no_persistenced,
        no_fabricmanager=no_fabricmanager, no_gsp_firmware=no_gsp_firmware, ldconfig=ldconfig,
        cuda_compat_mode="disabled" if no_cntlibs else cuda_compat_mode,
    )
    plan = plan_for(request, obj.config, rootfs, pid, options, inventory=obj.inventory())
    if dry_run:
        sys.stdout.write(plan.dumps() if as_json else plan.text())
        return
    if pid is None:
        raise NvcError("input", "configure needs --pid PID of the container (or --dry-run)")
    from ..apply.execute import apply

    apply(plan, deadline=obj.config.deadline - (time.monotonic() - started))
