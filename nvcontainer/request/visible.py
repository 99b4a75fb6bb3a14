"""One reading of ``NVIDIA_VISIBLE_DEVICES`` for every program that reads or writes it.

The hook (:mod:`.decide`), the runtime shim's cdi and auto modes (``runtime/cdinames.py``), the
device plugin (which writes the value the others read) and the DRA driver all ask the same
value the same question: is this a GPU container, and which devices does it name? Each used to
answer with a reading of its own, and they drifted: the hook took ``ALL`` as ``all``, as
NVIDIA's hook and cli together do, while the shim made ``nvidia.com/gpu=ALL`` of it, a CDI
device that resolves to nothing. So there is one reading, here, and no other module splits the
value or looks for ``all``, ``none`` or ``void`` in it.

The reading is upstream's (REFERENCE §6.3): split on commas, entries trimmed, empties dropped;
unset, empty or with ``void`` anywhere is not a GPU container (unset is ``all`` for a legacy
CUDA image); otherwise the first entry that is exactly ``all`` or ``none`` decides, and an
``all`` in any case among ids is ``all`` (the hook passes it on and nvidia-container-cli
compares it without case). What is left are ids, in request order, once each; what an id may
look like is for the reader to check (the hook: :func:`.decide.device_kind`; the shim: CDI
names).
"""

from __future__ import annotations


from ..errors import NvcError, escape
from ..records import record

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:   # annotations only: collections.abc imports collections, a start's 1 ms
    from collections.abc import Iterable, Mapping

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
MAX_VALUE = 64 * 1024
ALL = "all"
NONE = "none"
VOID = "void"


@record
class Visible:
    """``devices``: None (not a GPU container), ``"all"``, ``"none"`` (the driver, no GPU) or
    the ids in request order; ``source``: the variable(s) read, for messages."""

    devices: str | tuple[str, ...] | None
    source: str = VISIBLE_DEVICES


def split(value: str) -> list[str]:
    """A comma list: entries trimmed, empty ones dropped."""
    return [t.strip() for t in value.split(",") if t.strip()]


def read(tokens: Iterable[str]) -> str | tuple[str, ...] | None:
    """A device list as upstream reads it: None, ``"all"``, ``"none"`` or the ids (once each)."""
    tokens = list(tokens)
    if not tokens or VOID in tokens:
        return None
    for token in tokens:   # the hook compares exactly: the first "all" or "none" decides
        if token in (ALL, NONE):
            return token
    if any(token.lower() == ALL for token in tokens):
        return ALL   # the hook passes "ALL" on and nvidia-container-cli compares it without case
    return tuple(dict.fromkeys(tokens))


def legacy_image(env: Mapping[str, str]) -> bool:
    """A CUDA image from before NVIDIA_VISIBLE_DEVICES existed: CUDA_VERSION set and
    NVIDIA_REQUIRE_CUDA empty. Its unset device list means all GPUs."""
    return bool(env.get("CUDA_VERSION")) and not env.get("NVIDIA_REQUIRE_CUDA")


def from_env(env: Mapping[str, str], swarm_resource: Iterable[str] = ()) -> Visible:
    """What a container's environment asks for. The swarm variables (``swarm-resource``) that
    are set and name something replace NVIDIA_VISIBLE_DEVICES; one set to nothing (empty, or
    only commas and blanks) counts as unset, where upstream would let it take the GPUs away
    from a container that asked for ``all``. Every value read is bounded (``MAX_VALUE``)."""
    def get(name: str) -> str | None:
        value = env.get(name)
        if value is not None and len(value) > MAX_VALUE:
            raise NvcError("input", f"{escape(name, 80)}: value longer than {MAX_VALUE} characters")
        return value

    names = [n for n in swarm_resource if split(get(n) or "")] or [VISIBLE_DEVICES]
    tokens: list[str] = []
    for name in names:
        tokens += split(get(name) or "")
    if legacy_image(env) and not any(n in env for n in names):
        tokens = [ALL]
    return Visible(read(tokens), ",".join(names))


def value(ids: Iterable[str]) -> str:
    """The NVIDIA_VISIBLE_DEVICES value that names exactly ``ids``, for a program that writes
    one (the device plugin): refused (ValueError) for an id :func:`read` would not read back
    as itself, a word (all, none, void), a comma, blanks around it, or none at all."""
    ids = tuple(ids)
    text = ",".join(ids)
    if not ids or any("," in i or i != i.strip() for i in ids) or read(split(text)) != tuple(dict.fromkeys(ids)):
        raise ValueError(f"{VISIBLE_DEVICES}: {escape(text, 80)} does not name exactly those devices")
    return text
