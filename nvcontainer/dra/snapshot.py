"""The inventory, as a child program sees it now: how the DRA driver notices a driver reload or a
MIG reconfiguration.

    python -I -m nvcontainer.dra.snapshot   (the configuration as JSON on stdin; the inventory
                                             as JSON on stdout, or {"error": line})

Why a child program: the inventory cache (``inventory/cache.py``) already knows when its entry
no longer describes the machine (the driver's version text, the GPUs in /proc, the MIG
capability tree, the driver's files), and then rebuilds it, which forks the NVML helper. The
DRA driver is a threaded gRPC server, where a fork without exec is not safe; ``subprocess``
(fork and exec at once) is. So :func:`current` runs this module every few seconds, bounded by
a deadline, and the driver compares what it gets with what it published from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..documents import json_value
from ..errors import NvcError, escape
from ..inventory.model import Inventory

MAX_REPLY = 16 << 20
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def config_to_json(config) -> dict:
    from ..records import asdict

    return {k: v for k, v in asdict(config).items() if k not in ("origins", "inert", "note", "source", "debug")}


def config_from_json(data: dict):
    from ..config.model import Config
    from ..records import fields

    kinds = {f.name: f.type for f in fields(Config)}
    values = {}
    for key, value in data.items():
        if key not in kinds:
            continue
        if isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        values[key] = value
    return Config(**values)


def current(config, *, proc: str = "/proc", timeout: float = 60.0, argv=None) -> Inventory:
    """The inventory now (from the cache when it still holds; rebuilt when not)."""
    argv = argv or [sys.executable, "-I", "-m", "nvcontainer.dra.snapshot"]
    request = {"config": config_to_json(config), "proc": proc}
    # the cache keys an entry by the PATH and MPS directory the files were searched in: the
    # child searches where this process did, so it reads (and checks) this process's entry
    env = dict(ENV, **{k: os.environ[k] for k in ("PATH", "CUDA_MPS_PIPE_DIRECTORY") if k in os.environ})
    try:
        done = subprocess.run(argv, input=json.dumps(request).encode(), capture_output=True,
                              env=env, timeout=timeout, close_fds=True)
    except subprocess.TimeoutExpired:
        raise NvcError("initialization", f"inventory: no answer in {timeout:g} s") from None
    except OSError as exc:
        raise NvcError("initialization", f"inventory: cannot start: {escape(exc)}") from None
    try:
        reply = json_value(done.stdout, "inventory's answer", cap=MAX_REPLY, category="initialization")
    except NvcError:
        raise NvcError("initialization", f"inventory: no answer (exit status {done.returncode})") from None
    try:
        if "error" in reply:
            category, detail = reply["error"]
            raise NvcError(escape(category, 40), escape(detail, 300))
        return Inventory.from_dict(reply["inventory"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise NvcError("initialization", f"inventory: no answer (exit status {done.returncode})") from None


def main() -> int:
    from ..inventory.cache import cached_inventory

    try:
        request = json.loads(sys.stdin.buffer.read(1 << 20))
        config = config_from_json(request["config"])
        reply = {"inventory": cached_inventory(config, proc=str(request["proc"])).to_dict()}
    except NvcError as exc:
        reply = {"error": [exc.category, exc.detail]}
    except Exception as exc:   # anything at all comes back as a line, never a traceback
        reply = {"error": ["initialization", f"inventory: {type(exc).__name__}: {exc}"]}
    sys.stdout.write(json.dumps(reply))
    return 0 if "inventory" in reply else 1


if __name__ == "__main__":
    sys.exit(main())
