"""``nvcontainer device-plugin``: the kubelet's Device Plugin API for this node's GPUs.

Only the options live here; :mod:`nvcontainer.deviceplugin.command` turns them and the
``[device-plugin]`` table into a running agent (gRPC is imported there, never on other commands).
"""

from __future__ import annotations

import click

from .context import Context


@click.command("device-plugin")
@click.option("--socket-dir", metavar="DIR",
              help="The kubelet's device plugin directory. [default: /var/lib/kubelet/device-plugins]")
@click.option("--mig-strategy", type=click.Choice(["none", "single", "mixed"]),
              help="How MIG devices are advertised. [default: none]")
@click.option("--device-id-strategy", type=click.Choice(["uuid", "index"]),
              help="Device IDs by UUID or index. [default: uuid]")
@click.option("--device-list-strategy", multiple=True,
              type=click.Choice(["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]),
              help="How Allocate names the devices to the runtime (repeatable). [default: envvar]")
@click.option("--replicas", type=int, metavar="N", help="Time-slicing: advertise each device N times. [default: 1]")
@click.option("--sysfs", metavar="DIR", help="Where the GPUs' NUMA nodes are read. [default: /sys]")
@click.pass_obj
def device_plugin(obj: Context, socket_dir, mig_strategy, device_id_strategy, device_list_strategy, replicas,
                  sysfs) -> None:
    """Serve the kubelet's Device Plugin API for this node's GPUs."""
    from ..deviceplugin import command

    command.run(obj.config, socket_dir=socket_dir, mig_strategy=mig_strategy, device_id_strategy=device_id_strategy,
                device_list_strategy=device_list_strategy or None, replicas=replicas, sysfs=sysfs)
