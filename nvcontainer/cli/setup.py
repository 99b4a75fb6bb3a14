"""``nvcontainer setup ENGINE``: what an engine needs to run the hook or use CDI devices."""

from __future__ import annotations

import os
import sys
import time

import click

from .context import Context


@click.command()
@click.argument("engine", type=click.Choice(["runc", "docker", "containerd", "podman", "crio"]))
@click.option("--dry-run", is_flag=True, help="Show what would change, as unified diffs; change nothing.")
@click.option("--prefix", metavar="DIR", default="/", show_default=True, help="Install under DIR instead of /.")
@click.option("--cdi", "with_cdi", is_flag=True, help="Also generate the CDI spec (/var/run/cdi/nvidia.yaml).")
@click.option("--hook-path", metavar="PATH", help="nvcontainer-hook as engines will run it. [default: the installed one]")
@click.option("--serve", "served", is_flag=True,
              help="Also install the nvcontainer serve service, and register its fast client as the hook "
                   "(native, built with the node's C compiler, when there is one).")
@click.option("--python-client", is_flag=True, help="With --serve: register the Python client, build nothing.")
@click.pass_obj
def setup(obj: Context, engine, dry_run, prefix, with_cdi, hook_path, served, python_client) -> None:
    """Install (or show) what ENGINE needs to run the hook or use CDI devices."""
    from ..cdi import commands
    from ..setup import engines

    hook = hook_path or commands.default_hook_path()
    serve = None
    if served:
        from ..hook import client as hookclient
        from ..native import build as nativeclient

        native = None if python_client or nativeclient.compiler() is None else \
            os.path.join(os.path.dirname(hook), nativeclient.NAME)
        serve = engines.Served(python=sys.executable, client=os.path.abspath(hookclient.__file__),
                               cli=os.path.join(os.path.dirname(hook), "nvcontainer"), native=native)
    spec = None
    if with_cdi:
        from ..cdi import generate

        inv = obj.inventory()
        opts = generate.Options(hook_path=hook, ldconfig=obj.config.ldconfig_program(),
                                allow=obj.allow_list(inv))
        spec = commands.generate_spec(inv, opts, "yaml", None)
    steps = engines.steps(engine, hook, os.path.dirname(hook), spec, serve)
    sys.stdout.write(engines.perform(steps, prefix=prefix, dry_run=dry_run,
                                     stamp=time.strftime("%Y%m%dT%H%M%S")))
