"""What ``nvcontainer setup`` decides to do, as plain data: the changes, the notes, the hint of the
restart an engine needs.

Why values: the decision (:mod:`.engines`, from the files' current text and the engines'
versions) is pure and is what ``--dry-run`` shows; :mod:`.perform` is the only place that
touches the host, and only as these values say. Each change also says how it is undone, which
:mod:`.record` keeps for ``--undo``.
"""

from __future__ import annotations

from ..records import field, record

ABSENT = None   # a file that does not exist; a key that was not set (in an undo record: "absent")


@record
class WriteFile:
    """``path`` gets ``content``. ``old`` is the text it was decided from (None: absent): the write
    happens only if the file still holds that. ``own``: the whole file is ours (a drop-in, a
    hooks.d file, a unit); otherwise it is the operator's, edited (``daemon.json``,
    containerd's ``config.toml``), and ``keys`` says what was changed in it."""
    path: str
    content: str
    old: str | None = ABSENT
    mode: int = 0o644
    own: bool = True
    keys: tuple = ()        # JSON files: ((key, ...), value set, value before or the string "absent")
    imports: str = ""       # TOML files: the imports entry added


@record
class RemoveFile:
    """``path`` goes (an undo); ``restore``: a backup whose text goes back in its place."""
    path: str
    old: str
    restore: str | None = None


@record
class Link:
    path: str
    target: str


@record
class Unlink:
    """A link of ours removed (an undo); ``restore``: the backup moved back where it was."""
    path: str
    target: str
    restore: str | None = None


@record
class Build:
    """A native program compiled for this installation before anything names it."""
    kind: str          # "client" (the hook client) or "runtime" (the runtime shim's front)
    path: str
    python: str


@record
class Systemctl:
    """``systemctl ARGS``, run only on a live systemd and the real root; else a note says it."""
    args: tuple[str, ...]


@record
class Steps:
    engine: str
    changes: tuple = ()                       # WriteFile | RemoveFile | Link | Unlink, in order
    builds: tuple[Build, ...] = ()
    systemctl: tuple[Systemctl, ...] = ()
    fragments: tuple[tuple[str, str], ...] = ()   # (where, text): only runc's bundle entry
    notes: tuple[str, ...] = ()
    restart: str = ""                         # the one-line hint, when the engine reads its config at start
    undo: bool = False
    record: dict = field(default_factory=dict)   # what --undo needs, kept by perform (see record.py)
