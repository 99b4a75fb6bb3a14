"""``free`` and ``free:N``: a request for any N GPUs no other container holds (issue 26).

Why a word of its own: on a shared node nobody can know which index is free, and dockerd turns
``--gpus 2`` into the same ``0,1`` for everyone. ``free:N`` leaves the choice to the node, which
records it as a lease (:mod:`nvcontainer.leases`). Only the form is checked here, before anything
else sees it; whether N GPUs exist and are free needs the inventory and the leases. NVIDIA's hook
refuses ``free`` as an unknown device, so an image that uses it fails closed elsewhere.
"""

from __future__ import annotations

from ..errors import NvcError, escape

WORD = "free"
MAX_COUNT = 1024


def is_free(token: str) -> bool:
    return token == WORD or token.startswith(WORD + ":")


def parse(tokens: list[str] | tuple[str, ...], source: str) -> tuple[str, ...] | None:
    """``("free:N",)`` when ``tokens`` ask for free GPUs, None when none of them does; one line
    naming the value when the ask is malformed or mixed with other devices."""
    asks = [t for t in tokens if is_free(t)]
    if not asks:
        return None
    value = ",".join(tokens)
    if len(tokens) > 1:
        raise NvcError("device", f"{source}: '{escape(value, 80)}': '{WORD}' cannot be mixed with other devices")
    count = count_of(asks[0], source)
    return (f"{WORD}:{count}",)


def count_of(token: str, source: str = "NVIDIA_VISIBLE_DEVICES") -> int:
    """N of ``free:N`` (1 for ``free``)."""
    if token == WORD:
        return 1
    text = token[len(WORD) + 1:]
    if text.lower().startswith("mig-"):
        raise NvcError("device", f"{source}: '{escape(token, 80)}': MIG devices cannot be leased yet "
                                 "(ask for whole GPUs with free:N, or name the MIG device)")
    if not (text.isascii() and text.isdigit() and len(text) <= 4) or not 0 < int(text) <= MAX_COUNT:
        raise NvcError("device", f"{source}: '{escape(token, 80)}': expected free or free:N "
                                 f"with N from 1 to {MAX_COUNT}")
    return int(text)


def asked(devices: tuple[str, ...] | str) -> int | None:
    """How many free GPUs a request's ``devices`` ask for; None when it names its devices."""
    if isinstance(devices, tuple) and len(devices) == 1 and is_free(devices[0]):
        return count_of(devices[0])
    return None
