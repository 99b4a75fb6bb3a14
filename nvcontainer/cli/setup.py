"""``nvcontainer setup ENGINE``: register GPU support in an engine's own configuration, or take it back."""

from __future__ import annotations

import os
import sys
import time

import click

from ..errors import NvcError, escape
from .context import Context

ENGINES = ["runc", "docker", "containerd", "podman", "crio", "all"]


def _version(text: str | None, engine: str):
    from ..setup import versions

    if text is None:
        return versions.of(engine)
    parsed = versions.parse(text)
    if parsed is None:
        raise NvcError("input", f"--engine-version: '{escape(text, 40)}' is not a version number")
    return parsed


@click.command()
@click.argument("engine", type=click.Choice(ENGINES))
@click.option("--dry-run", is_flag=True, help="Show what would change, as unified diffs; change nothing.")
@click.option("--undo", is_flag=True,
              help="Take back what setup did for ENGINE ('all': every engine it has a record of).")
@click.option("--prefix", metavar="DIR", default="/", show_default=True,
              help="Work on the files under DIR instead of /.")
@click.option("--cdi", "with_cdi", is_flag=True,
              help="Also enable CDI in the engine, write the CDI spec and enable its refresh at boot.")
@click.option("--set-as-default", is_flag=True, help="docker, containerd, crio: make 'nvidia' the default runtime.")
@click.option("--hook", "hook_route", is_flag=True, help="crio: the hooks.d file instead of the runtime 'nvidia'.")
@click.option("--in-process", is_flag=True,
              help="Register nvcontainer-hook itself, not the client of nvcontainer serve, and enable no server.")
@click.option("--serve", "served", is_flag=True, hidden=True)   # the default since 0.2; kept for scripts
@click.option("--python-client", is_flag=True, help="Register the Python client of nvcontainer serve; build nothing.")
@click.option("--hook-path", metavar="PATH",
              help="nvcontainer-hook of the installation to register. [default: the installed one]")
@click.option("--engine-version", metavar="VERSION", help="Take the engine's version as VERSION instead of asking it.")
@click.pass_obj
def setup(obj: Context, engine, dry_run, undo, prefix, with_cdi, set_as_default, hook_route, in_process, served,
          python_client, hook_path, engine_version) -> None:
    """Register GPU support in ENGINE's own configuration (or show it, or take it back)."""
    from ..cdi import commands
    from ..setup import engines, install, perform, record

    stamp = time.strftime("%Y%m%dT%H%M%S")
    world = engines.world(prefix)
    if undo:
        names = record.engines(prefix) if engine == "all" else [engine]
        reports = [perform.perform(engines.undo(name, record.load(prefix, name), world), prefix=prefix,
                                   dry_run=dry_run, stamp=stamp) for name in names]
        sys.stdout.write("\n".join(reports) or "nothing to undo: setup has no record of any engine\n")
        return
    if engine == "all":
        raise NvcError("input", "'all' is for --undo; name one engine to set up")
    if in_process and (served or python_client):
        raise NvcError("input", "--in-process registers the hook itself: not with --serve or --python-client")
    hook = hook_path or commands.default_hook_path()
    from ..hook import client as hookclient

    inst = install.locate(os.path.dirname(hook), sys.executable, os.path.abspath(hookclient.__file__), prefix)
    if python_client:
        inst = install.Install(inst.bin_dir, inst.python, inst.client_module, runtime_ready=inst.runtime_ready,
                               can_build_runtime=inst.can_build_runtime)
    options = engines.Options(engine=engine, served=not in_process, cdi=with_cdi, set_as_default=set_as_default,
                              hook=hook_route, deadline=obj.config.deadline, version=_version(engine_version, engine))
    engines.check(options)
    if with_cdi:
        from dataclasses import replace

        from ..cdi import generate

        inv = obj.inventory()
        opts = generate.options_for(obj.config, hook_path=hook, allow=obj.allow_list(inv))
        options = replace(options, cdi_spec=commands.generate_spec(inv, opts, "yaml", None))
    steps = engines.steps(options, inst, world)
    sys.stdout.write(perform.perform(steps, prefix=prefix, dry_run=dry_run, stamp=stamp))
