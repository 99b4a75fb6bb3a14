"""The inventory as a cache entry stores it, and the checks that a stored value has exactly the
shape the code expects.

Why strict: an entry is read on every container start and turned back into the model the plan
is built from. Anything that is not what ``to_dict`` would have written (a missing field, a
wrong type, one more key) fails closed: the entry is rebuilt, never half-trusted. The checks
are derived from the model's own field types, so a model change is followed.
"""

from __future__ import annotations

from ..records import fields, replace
from .model import DeviceNode, DriverFile, Gpu, Inventory, MigControl, MigDevice


def inventory_to_json(inventory: Inventory) -> tuple[dict, list]:
    """The inventory as stored: ``mig_minors`` (thousands of pairs on every machine, most of the
    file) apart as two flat lists, which are checked and turned back into pairs at C speed."""
    data = replace(inventory, mig_minors=()).to_dict()
    del data["mig_minors"]
    return data, [[name for name, _ in inventory.mig_minors], [minor for _, minor in inventory.mig_minors]]


def minors_from_json(value) -> tuple[tuple[str, int], ...] | None:
    if not (type(value) is list and len(value) == 2 and type(value[0]) is list and type(value[1]) is list):
        return None
    names, minors = value
    if len(names) != len(minors) or not set(map(type, names)) <= {str} or not set(map(type, minors)) <= {int}:
        return None
    return tuple(zip(names, minors))


_MODEL = {c.__name__: c for c in (Inventory, Gpu, MigDevice, DeviceNode, DriverFile, MigControl)}
_SCALARS = {"str": str, "int": int, "bool": bool}
_CHECKERS: dict = {}


def checker(annotation: str):
    """A predicate: is a JSON value what ``to_dict`` makes of a value of this (model) type?
    Built once per annotation string from the model's own field types, so a model change is
    followed, and an unknown type fails closed (the entry is rebuilt, never half-trusted)."""
    ann = annotation.replace(" ", "")
    check = _CHECKERS.get(ann)
    if check is None:
        check = _CHECKERS[ann] = _makechecker(ann)
    return check


def _makechecker(ann: str):
    if ann.endswith("|None"):
        inner = checker(ann[:-5])
        return lambda v: v is None or inner(v)
    if ann in _SCALARS:
        t = _SCALARS[ann]
        return lambda v: type(v) is t
    if ann.startswith("tuple[") and ann.endswith(",...]"):
        inner = checker(ann[6:-5])
        return lambda v: type(v) is list and all(map(inner, v))
    if ann.startswith("tuple["):
        parts = tuple(checker(p) for p in ann[6:-1].split(","))
        return lambda v: type(v) is list and len(v) == len(parts) and all(c(x) for c, x in zip(parts, v))
    cls = _MODEL.get(ann)
    if cls is None:
        return lambda v: False
    checks = [(f.name, checker(f.type)) for f in fields(cls) if not (cls is Inventory and f.name == "mig_minors")]
    names = {name for name, _ in checks}
    return lambda v: type(v) is dict and v.keys() == names and all(c(v[name]) for name, c in checks)


_GPU_FACTS = {"index": int, "minor": int, "name": str, "brand": int, "uuid": str, "bus": list, "cc": list,
              "mig_capable": bool, "mig_enabled": bool, "migs": list}
_MIG_FACTS = {"index": int, "uuid": str, "name": str, "gi": int, "ci": int}


def _attributes_ok(mig: dict) -> bool:
    attributes = mig.get("attributes", [])
    return type(attributes) is list and all(
        type(a) is list and len(a) == 2 and type(a[0]) is str and type(a[1]) is int for a in attributes)


def facts_ok(facts) -> bool:
    def typed(d, spec) -> bool:
        return isinstance(d, dict) and all(type(d.get(k)) is t for k, t in spec.items())

    if not typed(facts, {"driver_version": str, "cuda_version": int, "gpus": list}):
        return False
    for gpu in facts["gpus"]:
        if not typed(gpu, _GPU_FACTS) or len(gpu["bus"]) != 3 or len(gpu["cc"]) != 2:
            return False
        if not all(type(v) is int for v in (*gpu["bus"], *gpu["cc"])):
            return False
        if not all(typed(m, _MIG_FACTS) for m in gpu["migs"]):
            return False
        if type(gpu.get("memory_mib", 0)) is not int or not all(map(_attributes_ok, gpu["migs"])):
            return False
    return True
