"""``nvcontainer config``: the effective settings, and where each came from (as ``nvidia-ctk config``)."""

from __future__ import annotations

import sys

import click

from .context import Context


@click.command("config")
@click.pass_obj
def config(obj: Context) -> None:
    """Show the effective settings and where each came from (a file, an option, the default)."""
    from ..config import toolkit

    sys.stdout.write(toolkit.render(obj.config))
