"""argp's optional arguments (nvcontainer/cli/argp.py): a value only when attached.

NVIDIA's cli reads ``--user info`` as ``--user`` without a value and the command ``info``
(REFERENCE §1.1); click alone would take ``info`` as the user. The expectations below are
argp's rules written out by hand, not the module's output.
"""

from __future__ import annotations

import click
import pytest

from nvcontainer.cli.argp import attached_only, optional_valued
from nvcontainer.cli.main import cli


@pytest.mark.parametrize("args, expected", [
    (["--user", "info"], ["--user=", "info"]),
    (["-u", "info"], ["--user=", "info"]),
    (["-u", "-k", "info"], ["--user=", "-k", "info"]),
    (["-nu", "info"], ["-n", "--user=", "info"]),
    (["-kn", "-u", "list"], ["-kn", "--user=", "list"]),
    (["--user=0:0", "info"], ["--user=0:0", "info"]),        # attached: the value
    (["--user=", "info"], ["--user=", "info"]),
    (["-u0:0", "info"], ["-u0:0", "info"]),
    (["-nuroot", "info"], ["-nuroot", "info"]),              # the rest of the group is u's value
    (["-r", "-u", "-u", "info"], ["-r", "-u", "--user=", "info"]),   # -r's value is the word "-u"
    (["--root", "-u", "info"], ["--root", "-u", "info"]),
    (["-r/drv", "-u", "info"], ["-r/drv", "--user=", "info"]),
    (["-ru", "info"], ["-ru", "info"]),                      # -r takes "u"
    (["--debug", "--user", "--user", "info"], ["--debug", "--user", "--user=", "info"]),
    (["configure", "-u", "--user", "/rootfs"], ["configure", "-u", "--user", "/rootfs"]),  # configure's -u is --utility
    (["info", "--user"], ["info", "--user"]),                # after the command: info's options, not the global one
    (["--", "--user", "info"], ["--", "--user", "info"]),
    (["--bogus", "--user", "info"], ["--bogus", "--user=", "info"]),
])
def test_rewrites_only_bare_optional_values(args, expected):
    assert attached_only(cli, args) == expected


def _options(command, path=()):
    for p in command.params:
        if isinstance(p, click.Option):
            yield (*path, p.opts[0]), p
    for name, sub in getattr(command, "commands", {}).items():
        yield from _options(sub, (*path, name))


def test_every_optional_valued_option_is_known_and_has_a_long_name():
    """The only optional-valued option of the cli is ``--user`` (REFERENCE §1: every other
    option of NVIDIA's cli either takes no value or requires one); a new one must have a long
    name, the form the rewrite uses."""
    found = [(path, p) for path, p in _options(cli) if optional_valued(p)]
    assert [path for path, _ in found] == [("-u",)]
    assert all(any(o.startswith("--") for o in p.opts) for _, p in found)
