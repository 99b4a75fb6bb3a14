"""Typed access to the parts of a config.json object the shim edits.

Why: the spec is the image's and the engine's, and an edit walks into ``hooks``, ``linux``,
``process`` and ``mounts`` that the strict reader (:mod:`..request.oci`) has not typed. A part of
the wrong type (``"hooks": []``) is one line naming it, never a traceback; a missing part is
created empty, as the OCI spec allows it to be absent.
"""

from __future__ import annotations

from ..errors import NvcError


def table(obj: dict, key: str, where: str = "config.json") -> dict:
    value = obj.get(key)
    if value is None:
        value = obj[key] = {}
    if not isinstance(value, dict):
        raise NvcError("input", f"{where}: {key}: expected an object")
    return value


def items(obj: dict, key: str, where: str = "config.json") -> list:
    value = obj.get(key)
    if value is None:
        value = obj[key] = []
    if not isinstance(value, list):
        raise NvcError("input", f"{where}: {key}: expected a list")
    return value


def check(obj: dict, *path: str) -> None:
    """That the objects along ``path`` and the list at its end, where present, have their types,
    without creating anything: done before an edit reads the host, so a malformed spec fails first."""
    where = "config.json"
    for key in path[:-1]:
        value = obj.get(key)
        if value is None:
            return
        if not isinstance(value, dict):
            raise NvcError("input", f"{where}: {key}: expected an object")
        obj, where = value, f"{where}: {key}" if where == "config.json" else f"{where}.{key}"
    if obj.get(path[-1]) is not None and not isinstance(obj[path[-1]], list):
        raise NvcError("input", f"{where}: {path[-1]}: expected a list")
