"""``python -m nvcontainer.hook``: a hook run in this process, never offered to a server (what
the hook clients execute when no server took the request)."""

import sys

from .main import run

sys.exit(run(sys.argv[1:]))
