"""``nvcontainer volume create|list|remove``: consolidated driver volumes for legacy images."""

from __future__ import annotations

import sys

import click

from ..errors import NvcError, escape
from .context import Context


@click.group()
def volume() -> None:
    """Consolidated driver volumes (nvidia_<version>/ with bin, lib, lib64) for legacy images."""


@volume.command("create")
@click.argument("directory", required=False)
@click.option("--capabilities", metavar="LIST", default="all", show_default=True,
              help="Capability groups whose files go in (comma list of compute, utility, video, graphics, "
                   "display, ngx, compat32, or all).")
@click.pass_obj
def volume_create(obj: Context, directory, capabilities) -> None:
    """Build DIRECTORY/nvidia_<driver version> from the driver's files. [default DIRECTORY: driver-volume-dir]"""
    from ..apply import volume as volumes
    from ..request.decide import CAPABILITIES

    wanted = {c.strip() for c in capabilities.split(",") if c.strip()}
    if "all" in wanted:
        wanted = set(CAPABILITIES)
    unknown = sorted(wanted - set(CAPABILITIES))
    if unknown or not wanted:
        raise NvcError("input", f"--capabilities: unknown capability '{escape(unknown[0] if unknown else '', 40)}' "
                                f"(known: {','.join(CAPABILITIES)}, all)")
    groups = set(wanted) - {"compat32", "display"} | ({"graphics"} if "display" in wanted else set()) \
        | ({"compute"} if "video" in wanted else set())
    res = volumes.create(directory or obj.config.driver_volume_dir, obj.inventory(), frozenset(groups),
                         "compat32" in wanted)
    copied = f" ({res.copied} files copied: another filesystem than the driver's)" if res.copied else ""
    sys.stdout.write(f"{'created' if res.created else 'unchanged'} {res.path}{copied}\n")


@volume.command("list")
@click.argument("directory", required=False)
@click.pass_obj
def volume_list(obj: Context, directory) -> None:
    """The volumes in DIRECTORY: version, path, number of entries."""
    from ..apply import volume as volumes

    for v in volumes.list_volumes(directory or obj.config.driver_volume_dir):
        sys.stdout.write(f"{v.version} {v.path} {v.files}\n")


@volume.command("remove")
@click.argument("directory")
@click.argument("version")
def volume_remove(directory, version) -> None:
    """Remove DIRECTORY/nvidia_VERSION (running containers keep theirs)."""
    from ..apply import volume as volumes

    sys.stdout.write(f"removed {volumes.remove(directory, version)}\n")
