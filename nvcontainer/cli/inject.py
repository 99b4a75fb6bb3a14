"""``configure``'s work: the options read (by click in :mod:`.configure`, or without it in
:mod:`.nvcli` for an engine's argv) turned into a request, a plan, and the plan applied.

Why apart from the click command: ``nvidia-container-cli configure`` runs on every container
start of an engine that calls it (containerd's ``ctr --gpus``), and this module imports no click.
"""

from __future__ import annotations

import sys
import time

from ..errors import NvcError, escape


def configure(obj, *, pid, devices, requirements, ldconfig, compute, utility, video, graphics, display, ngx,
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
