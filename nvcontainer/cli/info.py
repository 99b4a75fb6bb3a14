"""``nvcontainer info``: driver and GPU facts, in upstream's text and CSV formats or as JSON."""

from __future__ import annotations

import sys

import click

from .context import Context


@click.command()
@click.option("--csv", "as_csv", is_flag=True, help="Comma-separated output, as nvidia-container-cli.")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.option("--refresh", is_flag=True, help="Ask NVML and rescan the driver's files now, and rewrite the inventory cache.")
@click.pass_obj
def info(obj: Context, as_csv: bool, as_json: bool, refresh: bool) -> None:
    """Driver and GPU facts."""
    from . import views

    if as_csv and as_json:
        raise click.UsageError("--csv and --json are exclusive")
    inv = obj.inventory(refresh=refresh)
    allow = obj.allow_list(inv)
    if as_json:
        sys.stdout.write(views.info_json(inv, allow))
        return
    render = views.info_csv if as_csv else views.info_text
    sys.stdout.write(render(inv))
