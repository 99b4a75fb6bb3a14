"""The pause between failed tries of a node agent: doubling from a first pause to a longest.

Why one: the device plugin's registration and health watcher, the DRA driver's slice publishing
and its API client each retry something that is down (the kubelet, NVML, the API server); each
must neither hammer it nor wait long once it is back, and each says its longest pause in its
messages, so the rule is the same everywhere and written once.
"""

from __future__ import annotations


class Backoff:
    """``next()``: the pause before the next try (then twice that, up to ``longest``);
    ``reset()`` after a success; ``pause``: what ``next()`` will give."""

    def __init__(self, first: float, longest: float):
        self.first, self.longest = first, longest
        self.pause = first

    def next(self) -> float:
        pause, self.pause = self.pause, min(self.pause * 2, self.longest)
        return pause

    def reset(self) -> None:
        self.pause = self.first
