"""``nvcontainer cdi generate|list|check``: Container Device Interface specs from the one inventory."""

from __future__ import annotations

import sys

import click

from .. import log
from ..errors import NvcError, escape
from .context import CDI_DIRS_HELP, PROG, Context


@click.group()
def cdi() -> None:
    """Container Device Interface specs: generate, list, check."""


@cdi.command("generate")
@click.option("-o", "--output", metavar="FILE", help="Write the spec to FILE, atomically. [default: standard output]")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]),
              help="Spec format. [default: from FILE's extension, else yaml]")
@click.option("--device-name-strategy", "strategies", multiple=True, type=click.Choice(["index", "uuid", "type-index"]),
              help="How devices are named: 0 and 0:1, GPU-/MIG-<uuid>, gpu0 and mig0:1 (repeatable). [default: index, uuid]")
@click.option("--vendor", default="nvidia.com", show_default=True, help="Vendor part of the device names.")
@click.option("--class", "cls", default="gpu", show_default=True, help="Class part of the device names.")
@click.option("--no-all-device", is_flag=True, help="No 'all' device.")
@click.option("--hook-path", metavar="PATH", help="nvcontainer-hook as the runtime will run it. [default: the installed one]")
@click.option("--host-driver-root", metavar="DIR",
              help="The driver root (--root) as the HOST has it: the spec's paths are named under it, for a "
                   "spec generated in a container that sees the host's driver at a mount. [default: --root]")
@click.pass_obj
def cdi_generate(obj: Context, output, fmt, strategies, vendor, cls, no_all_device, hook_path, host_driver_root) -> None:
    """A CDI spec for the driver and every GPU and MIG device."""
    from ..cdi import commands, generate, store

    hook = hook_path or commands.default_hook_path()
    inv = obj.inventory()
    opts = generate.options_for(
        obj.config, hook_path=hook, vendor=vendor, cls=cls,
        strategies=tuple(dict.fromkeys(strategies)) or generate.DEFAULT_STRATEGIES, all_device=not no_all_device,
        allow=obj.allow_list(inv), host_root=_absolute(host_driver_root),
    )
    text = commands.generate_spec(inv, opts, store.format_for(output, fmt), output)
    if text is not None:
        sys.stdout.write(text)


def _absolute(path: str | None) -> str | None:
    from ..errors import NvcError, escape

    if path is not None and not path.startswith("/"):
        raise NvcError("input", f"--host-driver-root {escape(path)}: must be an absolute path")
    return path


@cdi.command("list")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR", help=CDI_DIRS_HELP)
def cdi_list(spec_dirs) -> None:
    """The device names the spec directories offer."""
    from ..cdi import commands, store

    lines, problems = commands.list_names(spec_dirs or store.DEFAULT_DIRS)
    for problem in problems:
        log.warning(problem)
        sys.stderr.write(f"{PROG}: warning: {problem}\n")
    sys.stdout.write("".join(line + "\n" for line in lines))


@cdi.command("check")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR", help=CDI_DIRS_HELP)
@click.argument("files", nargs=-1, metavar="[FILE]...")
def cdi_check(spec_dirs, files) -> None:
    """Whether specs are stale for the running driver (exit status 1 if any is)."""
    from ..cdi import commands, store

    dirs = spec_dirs or store.DEFAULT_DIRS
    verdicts, problems = commands.check_specs(dirs, files)
    if not verdicts and not problems:
        sys.stdout.write(f"no CDI specs in {', '.join(escape(d) for d in dirs)}\n")
    sys.stdout.write("".join(line + "\n" for v in verdicts for line in v.lines()))
    stale = [v for v in verdicts if v.stale]
    if problems or stale:
        raise NvcError("cdi", "; ".join([*problems, *(f"{escape(v.path)} is stale" for v in stale)]))
