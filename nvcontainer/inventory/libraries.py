"""Choosing the driver's libraries out of the ld cache (REFERENCE §3.1–§3.2).

The cache, not a directory scan, is the source because it is what the host's loader uses: a
library the host cannot load should not be given to a container either. The one rule that
keeps stubs, CUDA-compat copies and leftovers of older drivers out is the version suffix: the
real file's name must end in the running driver's version.
"""

from __future__ import annotations

import os
import stat
from typing import Callable, Iterable

from .. import log
from ..fs.inroot import resolve_in_root
from .catalog import ALL_PREFIXES
from .elfinfo import read_elf, tls_abi_ok
from .ldcache import CacheEntry
from .model import DriverFile


def select(
    entries: Iterable[CacheEntry],
    root: str,
    version: str,
    *,
    label: str = "",
    prefixes: tuple[tuple[str, str], ...] = ALL_PREFIXES,
    resolve: Callable[[str, str], str] = resolve_in_root,
) -> list[DriverFile]:
    """The driver libraries among ``entries`` (already filtered to one architecture).

    In file order, each entry whose SONAME starts with a wanted prefix is resolved inside the
    root to its real file and checked; a later passing candidate with a different real path
    replaces an earlier one, as upstream does. The result is in catalogue order.
    """
    chosen: dict[str, DriverFile] = {}
    for entry in entries:
        for group, prefix in prefixes:
            if not entry.key.startswith(prefix):
                continue
            try:
                real = resolve(root, entry.value)
            except OSError as exc:
                log.warning(f"cannot resolve {entry.value}: {exc.strerror}")
                continue
            current = chosen.get(prefix)
            if current is not None and current.path == real:
                continue
            candidate = _check(root, real, prefix, group, version)
            if candidate is None:
                continue
            if current is not None:
                log.info(f"selecting {real} over {current.path}")
            chosen[prefix] = candidate
    out = []
    for group, prefix in prefixes:
        if prefix in chosen:
            out.append(chosen[prefix])
        else:
            log.warning(f"missing {label}library {prefix}")
    return out


def _check(root: str, real: str, prefix: str, group: str, version: str) -> DriverFile | None:
    host = _join(root, real)
    if not os.path.basename(real).endswith(version):
        log.info(f"skipping {real}: not of driver version {version}")
        return None
    facts = read_elf(host)
    if facts is None:
        log.warning(f"skipping {real}: not an ELF file")
        return None
    if prefix == "libnvidia-tls.so" and not tls_abi_ok(facts):
        log.warning(f"skipping {real}: wrong ABI note for libnvidia-tls")
        return None
    return DriverFile(
        path=real,
        group=group,
        name=prefix,
        soname=facts.soname,
        links=host_links(root, real, prefix, facts.soname),
    )


def host_links(root: str, real: str, prefix: str, soname: str) -> tuple[tuple[str, str], ...]:
    """The SONAME and ``.so`` links next to ``real`` on the host that lead to it.

    Containers get exactly these (libnvidia-container#292): a link is only recorded when the
    host has it and it resolves, inside the root, to the same file.
    """
    directory = os.path.dirname(real)
    links = []
    for name in dict.fromkeys((soname, prefix)):
        if not name or name == os.path.basename(real):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(_join(root, path))
            if not stat.S_ISLNK(st.st_mode):
                continue
            if resolve_in_root(root, path) != real:
                continue
            links.append((name, os.readlink(_join(root, path))))
        except OSError:
            continue
    return tuple(links)


def _join(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root != "/" else path
