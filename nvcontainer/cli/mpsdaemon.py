"""``nvcontainer mps-daemon``: NVIDIA MPS control daemons for the GPUs the device plugin shares
with ``sharing = "mps"``.

Only the options live here; :mod:`nvcontainer.deviceplugin.mpsdaemon` runs the daemons from the
same ``[device-plugin]`` table the plugin reads, so the two agree on paths and limits.
"""

from __future__ import annotations

import click

from .context import Context


@click.command("mps-daemon")
@click.option("--interval", type=click.FloatRange(0.05, 3600), metavar="SECONDS",
              help="How often each daemon is asked whether it answers. [default: 5]")
@click.option("--mount-shm", is_flag=True,
              help="Only make <mps-root>/shm a tmpfs (the clients' and servers' /dev/shm), then exit.")
@click.pass_obj
def mps_daemon(obj: Context, interval, mount_shm) -> None:
    """Run an MPS control daemon per shared GPU until SIGTERM."""
    from ..deviceplugin import mpsdaemon

    mpsdaemon.run(obj.config, interval=interval, shm=mount_shm)
