"""Node labels as text: ``name=value`` lines, and Node Feature Discovery's local feature file.

Why a feature file and not the API server: NFD's worker already reads
``/etc/kubernetes/node-feature-discovery/features.d/`` on every node and labels the node from
it, so the labeller needs no credentials and no RBAC (GPU Feature Discovery does the same).
NFD's rules shape the writer: a file is read whole whenever NFD looks (so it is replaced by a
rename, never rewritten in place: NFD never sees half a file), names starting with a dot are
skipped (the temporary file is one), files over 64 KiB are ignored, and a
``# +expiry-time=<RFC3339>`` line makes NFD drop the labels after that instant, so a node
whose labeller died or whose NFD stopped reading loses them rather than advertising a GPU
that is gone.
"""

from __future__ import annotations

import datetime
import os

from ..errors import NvcError, escape
from ..fs.replace import replace_at

DEFAULT_FEATURE_FILE = "/etc/kubernetes/node-feature-discovery/features.d/nvcontainer"
MAX_FEATURE_FILE = 64 << 10      # NFD ignores a larger file


def lines(labels: dict[str, str]) -> str:
    """``name=value`` lines, sorted by name."""
    return "".join(f"{name}={labels[name]}\n" for name in sorted(labels))


def feature_file(labels: dict[str, str], expires: float) -> str:
    """The feature file's text: the expiry directive, then the labels. ``expires``: seconds
    since the epoch."""
    when = datetime.datetime.fromtimestamp(int(expires), datetime.timezone.utc)
    text = f"# +expiry-time={when.strftime('%Y-%m-%dT%H:%M:%SZ')}\n" + lines(labels)
    if len(text.encode()) > MAX_FEATURE_FILE:
        raise NvcError("labels", f"{len(labels)} labels exceed NFD's {MAX_FEATURE_FILE} bytes")
    return text


def write(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` by a rename in its directory; the directory must exist
    (it is NFD's: created by the DaemonSet or NFD, never by us). Mode 0644: NFD's worker may
    run as another user. A failure leaves the old file as it was, and no temporary file."""
    directory, name = os.path.split(os.path.abspath(path))
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise NvcError("labels", f"cannot write {escape(path)}: {escape(directory)}: {exc.strerror.lower()}") from None
    try:
        replace_at(dfd, name, text.encode(), 0o644)
    except OSError as exc:
        raise NvcError("labels", f"cannot write {escape(path)}: {exc.strerror.lower()}") from None
    finally:
        os.close(dfd)
