"""``nvcontainer``: the operator's command line (the imperative shell).

Global options come before the command word, as with nvidia-container-cli. Every failure is
one line on stderr and exit status 1; click's multi-line usage errors are folded into that
shape so scripts and log scrapers see one format.
"""

from __future__ import annotations

import sys

import click

from . import __version__, log
from .errors import NvcError, escape

PROG = "nvcontainer"


class _Context:
    def __init__(self, root: str, ldcache: str, user: str | None):
        self.root = root
        self.ldcache = ldcache
        self.user = user

    def inventory(self):
        from .identity import parse_user
        from .inventory.build import build

        return build(self.root, self.ldcache, parse_user(self.user))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-r", "--root", default="/", show_default=True, metavar="PATH", help="Driver root: where the driver's files, ld cache and device nodes are looked up.")
@click.option("-l", "--ldcache", default="/etc/ld.so.cache", show_default=True, metavar="FILE", help="The ld cache, relative to --root.")
@click.option("-d", "--debug", metavar="FILE", help="Append a full trace to FILE (quiet otherwise).")
@click.option("-u", "--user", is_flag=False, flag_value="", default=None, metavar="UID[:GID]",
              help="Identity that loads NVML; without a value, the caller's. Default: the kernel's overflow ids.")
@click.version_option(__version__, "-V", "--version", prog_name=PROG, message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, root: str, ldcache: str, debug: str | None, user: str | None) -> None:
    """Inject a host's NVIDIA driver and GPUs into containers."""
    if debug:
        log.open_debug(debug)
        log.info(f"running {PROG} {__version__}: {' '.join(sys.argv[1:])}")
    ctx.obj = _Context(root, ldcache, user)


@cli.command()
@click.option("--csv", "as_csv", is_flag=True, help="Comma-separated output, as nvidia-container-cli.")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.pass_obj
def info(obj: _Context, as_csv: bool, as_json: bool) -> None:
    """Driver and GPU facts."""
    from . import views

    if as_csv and as_json:
        raise click.UsageError("--csv and --json are exclusive")
    inv = obj.inventory()
    render = views.info_json if as_json else views.info_csv if as_csv else views.info_text
    sys.stdout.write(render(inv))


@cli.command("list")
@click.option("-d", "--device", "devices", multiple=True, metavar="ID", help="GPUs to list (repeatable, comma lists).")
@click.option("-l", "--libraries", is_flag=True, help="Driver libraries (64-bit).")
@click.option("-b", "--binaries", is_flag=True, help="Driver binaries.")
@click.option("-i", "--ipcs", is_flag=True, help="IPC sockets and directories.")
@click.option("-f", "--firmwares", is_flag=True, help="GSP firmware files.")
@click.option("--compat32", is_flag=True, help="Also the 32-bit libraries (with --libraries).")
@click.option("--mig-config", metavar="ID", help="MIG config capability (only 'all').")
@click.option("--mig-monitor", metavar="ID", help="MIG monitor capability (only 'all').")
@click.option("--imex-channel", "imex", multiple=True, metavar="CHANNEL", help="IMEX channel ids.")
@click.option("--no-persistenced", is_flag=True)
@click.option("--no-fabricmanager", is_flag=True)
@click.option("--no-gsp-firmware", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="JSON output, by section.")
@click.pass_obj
def list_(obj: _Context, devices, libraries, binaries, ipcs, firmwares, compat32, mig_config, mig_monitor,
          imex, no_persistenced, no_fabricmanager, no_gsp_firmware, as_json) -> None:
    """What a container would be given: device nodes, binaries, libraries, IPCs, firmware."""
    from . import views
    from .selection import select, split_tokens

    channels = parse_imex_channels(imex)
    with_config = views.check_mig_option("mig-config", mig_config)
    with_monitor = views.check_mig_option("mig-monitor", mig_monitor)
    if not (devices or libraries or binaries or ipcs or firmwares or compat32 or with_config or with_monitor):
        devices, libraries, binaries, ipcs, firmwares, compat32 = ("all",), True, True, True, True, True
    opts = views.ListOptions(
        devices=bool(devices), libraries=libraries, binaries=binaries, ipcs=ipcs, firmwares=firmwares,
        compat32=compat32, mig_config=with_config, mig_monitor=with_monitor, imex_channels=channels,
        no_persistenced=no_persistenced, no_fabricmanager=no_fabricmanager, no_gsp_firmware=no_gsp_firmware,
    )
    tokens = split_tokens(devices)
    inv = obj.inventory()
    sel = select(inv, tokens)
    sections = views.list_sections(inv, sel, opts)
    sys.stdout.write(views.list_json(sections) if as_json else views.list_text(sections))


def parse_imex_channels(values) -> tuple[int, ...]:
    out: dict[int, None] = {}
    for value in values:
        for token in value.split(","):
            token = token.strip()
            if not token:
                continue
            if not token.isdigit() or len(token) > 7 or int(token) >= 1 << 20:
                raise NvcError("input", f"unsupported IMEX channel value: {escape(token)}")
            out[int(token)] = None
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name=PROG, standalone_mode=False)
    except NvcError as exc:
        log.error(exc.line(PROG))
        sys.stderr.write(exc.line(PROG) + "\n")
        return 1
    except click.exceptions.Abort:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 1
    except click.ClickException as exc:
        sys.stderr.write(f"{PROG}: input error: {escape(exc.format_message())}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
