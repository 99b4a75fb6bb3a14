"""``nvcontainer serve``: the resident helper that hooks hand their runs to."""

from __future__ import annotations

import sys

import click

from ..errors import escape
from .context import PROG, Context


@click.command()
@click.option("--socket", "socket_path", metavar="PATH", default="/run/nvcontainer/hook.sock", show_default=True,
              help="Where to listen (in a directory only root may enter; the socket is 0600).")
@click.option("--spare/--no-spare", default=True, show_default=True,
              help="Fork each request's child ahead, while idle, and warm its memory.")
@click.pass_obj
def serve(obj: Context, socket_path: str, spare: bool) -> None:
    """Run hooks warm: a resident helper that nvcontainer-hook hands its runs to."""
    from ..serve import server

    def ready(status: str) -> None:
        sys.stderr.write(f"{PROG} serve: listening on {escape(socket_path)}; {status}\n")
        sys.stderr.flush()

    server.serve(socket_path, obj.config, ready=ready, spare=spare)
