"""What the hook programs share on their command line: the program name in their messages and
one shape for a usage error.

Why a module of its own: the prestart hook and the CDI hooks are separate entry points of one
program (``nvcontainer-hook``); each parses its own options, and neither should import the
other just to say "usage" the same way.
"""

from __future__ import annotations

import sys

PROG = "nvcontainer-hook"


class Usage(Exception):
    """A usage error of the hook or one of its CDI sub-hooks; an empty message asks for the
    usage text (``--help``)."""


def usage_status(exc: Usage, usage: str) -> int:
    """What a usage error becomes: one line and exit status 2, or the usage text and 0."""
    if str(exc):
        sys.stderr.write(f"{PROG}: input error: {exc}\n")
        return 2
    sys.stdout.write(usage)
    return 0
