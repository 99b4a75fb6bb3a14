"""``nvcontainer``: the operator's command line (the imperative shell).

Global options come before the command word, as with nvidia-container-cli. Every failure is
one line on stderr and exit status 1; click's multi-line usage errors are folded into that
shape so scripts and log scrapers see one format. Each subcommand lives in a module of its own
beside this one (libnvidia-container's ``src/cli/`` has one file per subcommand too) and only
parses its options and calls the core.
"""

from __future__ import annotations

import sys

import click

from .. import __version__, log
from ..errors import NvcError, escape
from . import (cdi, config, configure, deviceplugin, doctor, dradriver, info, install, labels, mpsdaemon, ps, serve,
               setup, volume)
from .context import PROG, open_run
from .list import list_


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-r", "--root", metavar="PATH", help="Driver root: where the driver's files, ld cache and device nodes are looked up. [default: /]")
@click.option("-l", "--ldcache", metavar="FILE", help="The ld cache, relative to --root. [default: /etc/ld.so.cache]")
@click.option("-d", "--debug", metavar="FILE", help="Append a full trace to FILE (quiet otherwise).")
@click.option("-u", "--user", is_flag=False, flag_value="", default=None, metavar="UID[:GID]",
              help="Identity that loads NVML; without a value (attached only: --user=UID, -uUID, as argp reads it), the caller's. Default: the kernel's overflow ids.")
@click.option("--config", "config_path", metavar="FILE", help="Configuration file. [default: /etc/nvcontainer/config.toml if present]")
@click.option("-k", "--load-kmods", is_flag=True, hidden=True, help="Accepted for nvidia-container-cli compatibility; modules are not loaded.")
@click.option("-n", "--no-pivot", is_flag=True, hidden=True, help="Accepted for nvidia-container-cli compatibility; the ldconfig sandbox needs no pivot choice.")
@click.version_option(__version__, "-V", "--version", prog_name=PROG, message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, root, ldcache, debug, user, config_path, load_kmods, no_pivot) -> None:
    """Inject a host's NVIDIA driver and GPUs into containers."""
    ctx.obj = open_run(root=root, ldcache=ldcache, debug=debug, user=user, config_path=config_path,
                       load_kmods=load_kmods, no_pivot=no_pivot)


for command in (info.info, list_, configure.configure, cdi.cdi, doctor.doctor, serve.serve,
                deviceplugin.device_plugin, dradriver.dra_driver, labels.labels, mpsdaemon.mps_daemon,
                volume.volume, setup.setup, config.config, ps.ps, install.install):
    cli.add_command(command)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    try:
        from .argp import attached_only   # argp's optional arguments: a value only when attached

        args = attached_only(cli, sys.argv[1:] if argv is None else argv)
        cli.main(args=args, prog_name=prog, standalone_mode=False)
    except NvcError as exc:
        return log.fail(exc, prog)
    except click.exceptions.Abort:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 1
    except click.ClickException as exc:
        sys.stderr.write(f"{prog}: input error: {escape(exc.format_message())}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        log.close()
    return 0


def main_nvidia_container_cli() -> int:
    """The ``nvidia-container-cli`` drop-in: the same program under upstream's name, for engines
    that run that name with upstream's argv (containerd's ``ctr --gpus``). The installed program
    starts at :func:`.nvcli.main_nvidia_container_cli`, which spares an engine's ``configure``
    click's import; this entry, importing click already, reads every argv with it."""
    return main(prog="nvidia-container-cli")


if __name__ == "__main__":
    sys.exit(main())
