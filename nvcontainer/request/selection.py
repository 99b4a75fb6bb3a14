"""Device tokens → the GPUs and MIG devices they name, checked against the real inventory.

Tokens are matched in upstream's order (REFERENCE §1.4): ``GPU-`` UUID prefix, PCI bus id,
index, ``MIG-`` UUID, ``i:j``, ``all``. We also accept the old ``MIG-GPU-<uuid>/<gi>/<ci>``
form that newer drivers stopped reporting (toolkit#203), by mapping it to the MIG device with
those instance ids. Selecting a MIG device selects its parent GPU too.

A node's ``allowed-devices`` (an orchestrator agent restricted to some GPUs) is written in the
same tokens and resolved by the same matcher, so "GPU 1" means the same thing in the config as
in a request. It is checked here, where tokens meet devices, so no front end can bypass it.
"""

from __future__ import annotations

from ..errors import NvcError, escape
from ..inventory.model import Gpu, Inventory, MigDevice
from ..records import record

MAX_TOKENS = 1024

# Strings, compiled by re on first use (and cached there): most starts match none of them.
_BUS_RE = r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?"
_MIG_PAIR_RE = r"([0-9]{1,4}):([0-9]{1,4})"
_LEGACY_MIG_RE = r"MIG-(GPU-[0-9a-fA-F-]+)/([0-9]{1,4})/([0-9]{1,4})"
# what nvcontainer serve compiles before it forks (serve/server.py preload), so no request does
PATTERNS = (_BUS_RE, _MIG_PAIR_RE, _LEGACY_MIG_RE)


@record
class Selection:
    gpus: tuple[Gpu, ...] = ()
    migs: tuple[MigDevice, ...] = ()
    all: bool = False
    whole: tuple[int, ...] = ()   # indexes of the GPUs named themselves (or by all), not only as a MIG parent

    def whole_gpus(self) -> tuple[Gpu, ...]:
        return tuple(g for g in self.gpus if g.index in self.whole)


@record
class AllowList:
    """The devices this node may hand out: whole GPUs (with all their MIG devices) by index, and
    single MIG devices by (parent, index). ``unknown``: entries that name nothing on this host;
    they only narrow the list, so they are reported, not fatal."""

    gpus: frozenset[int] = frozenset()
    migs: frozenset[tuple[int, int]] = frozenset()
    unknown: tuple[str, ...] = ()

    def permits(self, gpu: Gpu, mig: MigDevice | None = None) -> bool:
        if mig is None:
            return gpu.index in self.gpus
        return (mig.parent, mig.index) in self.migs

    def touches(self, gpu: Gpu) -> bool:
        """The GPU is allowed whole or through one of its MIG devices."""
        return self.permits(gpu) or any(self.permits(gpu, m) for m in gpu.migs)


def allow_list(inventory: Inventory, tokens: tuple[str, ...] | None) -> AllowList | None:
    """``None`` (no key, or ``all`` among the entries): everything is allowed."""
    if tokens is None or "all" in tokens:
        return None
    gpus: set[int] = set()
    migs: set[tuple[int, int]] = set()
    unknown: list[str] = []
    for token in tokens:
        try:
            gpu, mig = _match(inventory, token)
        except NvcError:
            unknown.append(token)
            continue
        if mig is None:
            gpus.add(gpu.index)
            migs.update((gpu.index, m.index) for m in gpu.migs)
        else:
            migs.add((mig.parent, mig.index))
    return AllowList(frozenset(gpus), frozenset(migs), tuple(unknown))


def held_back(inventory: Inventory, allow: AllowList | None) -> Selection:
    """What ``allow`` keeps from containers: GPUs it does not touch at all, and the MIG devices
    it leaves out on GPUs it does touch (a held-back GPU's MIG devices go without saying)."""
    if allow is None:
        return Selection()
    return Selection(
        gpus=tuple(g for g in inventory.gpus if not allow.touches(g)),
        migs=tuple(m for g in inventory.gpus if allow.touches(g) for m in g.migs if not allow.permits(g, m)),
    )


def split_tokens(values: list[str] | tuple[str, ...]) -> list[str]:
    """``--device`` values are comma lists and may repeat; empty tokens are ignored."""
    tokens = [t.strip() for v in values for t in v.split(",")]
    tokens = [t for t in tokens if t]
    if len(tokens) > MAX_TOKENS:
        raise NvcError("input", f"too many devices requested: {len(tokens)} (at most {MAX_TOKENS})")
    return tokens


def select(inventory: Inventory, tokens: list[str], allow: AllowList | None = None) -> Selection:
    """``all`` is every device ``allow`` permits; any other token outside it is refused."""
    gpus: dict[int, Gpu] = {}
    migs: dict[tuple[int, int], MigDevice] = {}
    whole: set[int] = set()
    for token in tokens:
        if token.lower() == "all":   # upstream compares "all" without case
            gpus = tuple(g for g in inventory.gpus if allow is None or allow.touches(g))
            return Selection(
                gpus=gpus,
                migs=tuple(m for g in inventory.gpus for m in g.migs if allow is None or allow.permits(g, m)),
                all=True,
                whole=tuple(g.index for g in gpus if allow is None or allow.permits(g)),
            )
        gpu, mig = _match(inventory, token)
        if allow is not None and not allow.permits(gpu, mig):
            raise NvcError("device", f"{escape(token)}: not allowed on this node (allowed-devices)")
        if mig is not None:
            migs[(mig.parent, mig.index)] = mig
            gpu = inventory.gpus[mig.parent]
        else:
            whole.add(gpu.index)
        gpus[gpu.index] = gpu
    return Selection(
        gpus=tuple(gpus[i] for i in sorted(gpus)),
        migs=tuple(migs[k] for k in sorted(migs)),
        whole=tuple(sorted(whole)),
    )


def _match(inv: Inventory, token: str) -> tuple[Gpu, MigDevice | None]:
    low = token.lower()
    if low.startswith("gpu-"):
        for gpu in inv.gpus:
            if gpu.uuid.lower().startswith(low):
                return gpu, None
    if token.startswith("MIG-GPU-") or ":" in token:
        # only for a token that a pattern may match (each asks for what is tested before it): a
        # start that names its GPUs by index or UUID does not pay re's import
        import re
    legacy = token.startswith("MIG-GPU-") and re.fullmatch(_LEGACY_MIG_RE, token)
    if legacy:
        uuid, gi, ci = legacy.group(1).lower(), int(legacy.group(2)), int(legacy.group(3))
        for gpu in inv.gpus:
            if gpu.uuid.lower() == uuid:
                for mig in gpu.migs:
                    if (mig.gi, mig.ci) == (gi, ci):
                        return gpu, mig
    elif low.startswith("mig-"):
        for gpu in inv.gpus:
            for mig in gpu.migs:
                if mig.uuid == token:
                    return gpu, mig
    bus = ":" in token and re.fullmatch(_BUS_RE, token)
    if bus and ("." in token or token.count(":") == 2):
        domain, b, d = (int(x, 16) for x in (bus.group(1) or "0", bus.group(2), bus.group(3)))
        wanted = f"{domain:08x}:{b:02x}:{d:02x}.0"
        for gpu in inv.gpus:
            if gpu.bus_id.startswith(wanted):
                return gpu, None
    if token.isascii() and token.isdigit() and len(token) <= 4 and int(token) < len(inv.gpus):
        return inv.gpus[int(token)], None
    pair = ":" in token and re.fullmatch(_MIG_PAIR_RE, token)
    if pair:
        i, j = int(pair.group(1)), int(pair.group(2))
        if i < len(inv.gpus):
            for mig in inv.gpus[i].migs:
                if mig.index == j:
                    return inv.gpus[i], mig
    raise NvcError("device", f"{escape(token)}: unknown device")
