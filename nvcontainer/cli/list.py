"""``nvcontainer list``: what a container would be given, one host path per line, in upstream's order."""

from __future__ import annotations

import sys

import click

from .context import Context, parse_imex_channels


@click.command("list")
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
@click.option("-g", "--graphics", is_flag=True,
              help="Also what graphics brings beyond libraries: the selected GPUs' DRI nodes, Vulkan and EGL files.")
@click.option("-D", "--display", is_flag=True, help="As --graphics, and the Xorg modules.")
@click.option("--json", "as_json", is_flag=True, help="JSON output, by section.")
@click.pass_obj
def list_(obj: Context, devices, libraries, binaries, ipcs, firmwares, compat32, mig_config, mig_monitor,
          imex, no_persistenced, no_fabricmanager, no_gsp_firmware, graphics, display, as_json) -> None:
    """What a container would be given: device nodes, binaries, libraries, IPCs, firmware (and, asked, graphics files)."""
    from . import views
    from ..request.selection import held_back, select, split_tokens

    channels = parse_imex_channels(imex)
    with_config = views.check_mig_option("mig-config", mig_config)
    with_monitor = views.check_mig_option("mig-monitor", mig_monitor)
    if _lists_everything(click.get_current_context(), imex):
        devices, libraries, binaries, ipcs, firmwares, compat32 = ("all",), True, True, True, True, True
        with_config = with_monitor = False
    opts = views.ListOptions(
        devices=bool(devices), libraries=libraries, binaries=binaries, ipcs=ipcs, firmwares=firmwares,
        compat32=compat32, mig_config=with_config, mig_monitor=with_monitor, imex_channels=channels,
        no_persistenced=no_persistenced, no_fabricmanager=no_fabricmanager, no_gsp_firmware=no_gsp_firmware,
        graphics=graphics, display=display,
    )
    tokens = split_tokens(devices)
    inv = obj.inventory()
    allow = obj.allow_list(inv)
    sel = select(inv, tokens, allow)
    sections = views.list_sections(inv, sel, opts)
    if as_json:
        sys.stdout.write(views.list_json(sections, views.held_back_paths(held_back(inv, allow))))
        return
    sys.stdout.write(views.list_text(sections))


def _lists_everything(ctx: click.Context, imex) -> bool:
    """Upstream's default (``-d all -l -b -i -f --compat32``) holds only with no option at all,
    or with one ``--imex-channel`` and nothing else; ``--json`` is ours and only changes the form.
    Any other option, ``--no-persistenced`` included, turns it off."""
    given = [name for name, value in ctx.params.items()
             if name not in ("as_json", "imex") and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    return not given and len(imex) <= 1
