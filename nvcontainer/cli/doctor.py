"""``nvcontainer doctor``: this host's driver, devices and engine set-up, a verdict and a fix each."""

from __future__ import annotations

import sys

import click

from ..errors import NvcError
from .context import CDI_DIRS_HELP, Context


@click.command()
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR", help=CDI_DIRS_HELP)
@click.pass_obj
def doctor(obj: Context, as_json: bool, spec_dirs) -> None:
    """Check this host's driver, devices and engine set-up; a verdict and a fix for each."""
    from ..doctor import checks, gather
    from ..cdi import store

    report = gather.examine(obj.config, spec_dirs or store.DEFAULT_DIRS)
    sys.stdout.write(checks.render_json(report) if as_json else checks.render_text(report))
    failed = [c for c in report if c.verdict == checks.FAIL]
    if failed:
        raise NvcError("doctor", f"{len(failed)} check(s) failed: {', '.join(c.name for c in failed)}")
