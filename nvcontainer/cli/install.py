"""``nvcontainer install``: the node stack installed from the image, as the GPU Operator's toolkit
DaemonSet (``nvidia-ctk-installer``) does, with NVIDIA's environment variables."""

from __future__ import annotations

import os
import sys

import click


ONLY_ON = ("no_cleanup", "no_runtime_config", "no_daemon")


def _flag(name: str, help_: str):
    return click.option(f"--{name}/--no-{name}", default=None, help=help_)


@click.command()
@click.option("--runtime", type=click.Choice(["containerd", "crio", "docker"]), default=None,
              help="The node's engine (RUNTIME). [default: containerd]")
@click.option("--host-root", metavar="DIR", default=None,
              help="Where the host's / is mounted (HOST_ROOT_MOUNT). [default: /host]")
@click.option("--toolkit-install-dir", "install_dir", metavar="DIR", default=None,
              help="The host directory for the programs (TOOLKIT_INSTALL_DIR). [default: /usr/local/nvcontainer]")
@click.option("--socket", metavar="PATH", default=None,
              help="The engine's socket on the host (RUNTIME_SOCKET, CONTAINERD_SOCKET, DOCKER_SOCKET).")
@click.option("--restart-mode", type=click.Choice(["signal", "systemd", "none"]), default=None,
              help="How the engine rereads its configuration (RUNTIME_RESTART_MODE). "
                   "[default: signal; crio: systemd]")
@click.option("--restart-timeout", type=float, default=None, help="Seconds the engine has to answer again. [60]")
@_flag("set-as-default", "Make 'nvidia' the default runtime (NVIDIA_RUNTIME_SET_AS_DEFAULT). [default: on]")
@_flag("cdi", "Enable CDI in the engine (RUNTIME_ENABLE_CDI, CDI_ENABLED). [default: off]")
@click.option("--no-cleanup-on-exit", "no_cleanup", is_flag=True, default=None,
              help="Leave everything installed when stopped (NO_CLEANUP_ON_EXIT).")
@click.option("--no-runtime-config", is_flag=True, default=None,
              help="Install the programs and the CDI spec; leave the engine's files alone (NO_RUNTIME_CONFIG).")
@click.option("--no-daemon", is_flag=True, default=None, help="Exit once installed, leaving it in place (NO_DAEMON).")
@click.option("--driver-root", metavar="DIR", default=None,
              help="The driver's root on the host (NVIDIA_DRIVER_ROOT). [default: /]")
@click.option("--ready-file", metavar="PATH", default=None,
              help="The host file written once the node is ready (NVCONTAINER_READY_FILE). "
                   "[default: /run/nvcontainer/validations/toolkit-ready]")
@click.option("--source", metavar="DIR", default=None,
              help="The tree to install (NVCONTAINER_SOURCE). [default: this installation's]")
@_flag("serve", "Run the installed nvcontainer serve in the host's root (NVCONTAINER_SERVE). [default: off]")
@click.option("--cdi-refresh", type=float, default=None,
              help="Seconds between CDI spec refreshes (NVCONTAINER_CDI_REFRESH). [60]")
@click.option("--wait-ready", is_flag=True,
              help="Install nothing: wait until the ready file exists, then exit (the other DaemonSets' "
                   "init containers; the file as this container sees it).")
def install(wait_ready: bool, **options) -> None:
    """Install the node stack from this image onto the host, register it with the engine, keep
    the CDI spec fresh, and put the node back when stopped."""
    from ..errors import NvcError
    from ..installer import run, settings

    if wait_ready:
        sys.exit(run.wait_ready(options["ready_file"] or settings.READY_FILE))

    # a switch not given is None (the environment decides), not False
    given = {k: (None if v is False and k in ONLY_ON else v) for k, v in options.items()}
    try:
        s = settings.settings(dict(os.environ), given)
    except NvcError as exc:   # one line in the log and in the pod's status (its termination message)
        run.fail_line(exc.detail)
        sys.exit(2)
    sys.exit(run.run(s))
