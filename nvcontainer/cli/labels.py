"""``nvcontainer labels``: the node labels NVIDIA's GPU Feature Discovery publishes.

Only the options live here; :mod:`nvcontainer.labels.command` reads the inventory and the
``[device-plugin]`` table, decides and publishes.
"""

from __future__ import annotations

import click

from .context import Context


@click.command()
@click.option("-o", "--output-file", metavar="FILE",
              help="Write a Node Feature Discovery feature file (atomically, with an expiry) instead of printing.")
@click.option("--period", type=click.FloatRange(1, 86400), metavar="SECONDS",
              help="Keep running: publish again every SECONDS, and when the driver or GPUs change.")
@click.option("--machine-type-file", metavar="FILE", default="/sys/class/dmi/id/product_name", show_default=True,
              help="Where nvidia.com/gpu.machine is read.")
@click.option("--no-timestamp", is_flag=True, help="Leave out nvidia.com/gfd.timestamp.")
@click.option("--now", type=click.IntRange(0, 1 << 40), hidden=True,
              help="The time in seconds since the epoch, instead of the clock's (tests).")
@click.pass_obj
def labels(obj: Context, output_file, period, machine_type_file, no_timestamp, now) -> None:
    """Node labels for Kubernetes, as NVIDIA's GPU Feature Discovery names them."""
    from ..labels import command

    clock = (lambda: float(now)) if now is not None else None
    command.run(obj.config, output_file=output_file, period=period, machine_type_file=machine_type_file,
                timestamps=not no_timestamp, **({"clock": clock} if clock else {}))
