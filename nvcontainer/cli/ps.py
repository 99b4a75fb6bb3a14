"""``nvcontainer ps``: per GPU, the containers using it (by lease or by request), their GPU
processes and memory, and the GPU's utilisation."""

from __future__ import annotations

import sys

import click

from ..errors import NvcError, escape
from .context import Context


@click.command()
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.option("--gpu", "gpu", metavar="INDEX|UUID", help="Show this GPU only.")
@click.pass_obj
def ps(obj: Context, as_json: bool, gpu: str | None) -> None:
    """Which containers use which GPU, with their GPU processes and memory."""
    from ..ps import gather, render
    from ..ps.assemble import select_gpu

    inv = obj.inventory()
    if gpu is not None and not select_gpu([{"index": g.index, "uuid": g.uuid} for g in inv.gpus], gpu):
        raise NvcError("input", f"--gpu: no GPU {escape(gpu)} on this node (an index or a UUID)")
    leases, problem = gather.lease_facts(obj.config)
    if problem:
        sys.stderr.write(f"nvcontainer: warning: {problem}\n")
    view = gather.snapshot(obj.config, inv, leases)
    if gpu is not None:
        view = select_gpu(view, gpu)
    sys.stdout.write(render.as_json(view) if as_json else render.text(view))

