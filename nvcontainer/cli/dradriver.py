"""``nvcontainer dra-driver``: the kubelet's DRA plugin for this node's GPUs, under NVIDIA's
driver name and with its kubelet plugin's flags and environment variables, so a DaemonSet
written for NVIDIA's ``gpu-kubelet-plugin`` needs only its image and command changed.

Only the options live here; :mod:`nvcontainer.dra.command` runs the plugin (gRPC and the API
client are imported there, never on other commands).
"""

from __future__ import annotations

import click

from .context import Context

@click.command("dra-driver")
@click.option("--node-name", envvar="NODE_NAME", metavar="NAME", help="This node's name: its devices' pool. [env NODE_NAME]")
@click.option("--cdi-root", envvar="CDI_ROOT", metavar="DIR", default="/var/run/cdi", show_default=True,
              help="Where each prepared claim's CDI spec is written. [env CDI_ROOT]")
@click.option("--nvidia-driver-root", envvar=["NVIDIA_DRIVER_ROOT", "HOST_DRIVER_ROOT"], metavar="DIR",
              help="The driver's root as the HOST has it: what the claims' CDI specs name. "
                   "[env NVIDIA_DRIVER_ROOT, HOST_DRIVER_ROOT; default: /]")
@click.option("--container-driver-root", envvar="DRIVER_ROOT_CTR_PATH", metavar="DIR",
              help="Where the driver root is mounted in this container: where it is read. "
                   "[env DRIVER_ROOT_CTR_PATH; default: /driver-root when it exists, else the driver root]")
@click.option("--kubelet-registrar-directory-path", "registrar", envvar="KUBELET_REGISTRAR_DIRECTORY_PATH",
              metavar="DIR", default="/var/lib/kubelet/plugins_registry", show_default=True,
              help="The kubelet's plugin watcher directory. [env KUBELET_REGISTRAR_DIRECTORY_PATH]")
@click.option("--kubelet-plugins-directory-path", "plugins", envvar="KUBELET_PLUGINS_DIRECTORY_PATH", metavar="DIR",
              default="/var/lib/kubelet/plugins", show_default=True,
              help="The kubelet's plugins directory: the DRA socket and checkpoint go to DIR/gpu.nvidia.com. "
                   "[env KUBELET_PLUGINS_DIRECTORY_PATH]")
@click.option("--kubeconfig", envvar="KUBECONFIG", metavar="FILE",
              help="The API server's kubeconfig. [env KUBECONFIG; default: in-cluster]")
@click.option("--hook-path", metavar="PATH", help="nvcontainer-hook as the runtime will run it. [default: the installed one]")
@click.option("--taint-unhealthy", is_flag=True, help="Keep unhealthy devices in the slices, tainted, instead of withdrawing them.")
@click.option("--remove-slices", is_flag=True, help="Delete this node's gpu.nvidia.com ResourceSlices and exit (uninstall).")
@click.option("--sysfs", metavar="DIR", default="/sys", hidden=True, help="Where the GPUs' PCI roots are read (tests).")
@click.pass_obj
def dra_driver(obj: Context, node_name, cdi_root, nvidia_driver_root, container_driver_root, registrar, plugins, kubeconfig, hook_path,
               taint_unhealthy, remove_slices, sysfs) -> None:
    """Serve the kubelet's DRA plugin API (gpu.nvidia.com) for this node's GPUs."""
    import sys

    from ..dra import command

    if remove_slices:
        sys.stdout.write(command.remove_slices(kubeconfig, node_name or "") + "\n")
        return
    from ..dra.driverroot import roots

    view, host = roots(nvidia_driver_root, container_driver_root, obj.config.root)
    config = obj.config.with_overrides(root=view)
    command.run(config, node_name=node_name or "", cdi_root=cdi_root, registrar_dir=registrar, plugins_dir=plugins,
                host_root=host,
                kubeconfig=kubeconfig, hook_path=hook_path, taint=taint_unhealthy, sysfs=sysfs)
