"""Reading the host for ``nvcontainer doctor``: the driver, the ld cache, NVML, device nodes,
cgroups, ldconfig, CDI specs, engine registrations and the hook server, into one
:class:`.checks.Facts`.

Kept apart from the verdicts (:mod:`.checks`) so those stay pure: this module only looks, and
every failure to look becomes a fact ("cannot read ...") rather than an exception.
"""

from __future__ import annotations

import os
import stat

from ..errors import NvcError
from ..inventory.model import CTL_MINOR, NVIDIA_MAJOR
from .checks import LIBRARIES, Check, Facts, Node, evaluate
from .registrations import problems as registration_problems, registrations


def examine(config, spec_dirs, *, proc: str = "/proc", etc: str = "/", serve_socket: str | None = None) -> list[Check]:
    return evaluate(gather(config, spec_dirs, proc=proc, etc=etc, serve_socket=serve_socket))


def gather(config, spec_dirs, *, proc: str = "/proc", etc: str = "/", serve_socket: str | None = None) -> Facts:
    """Everything :func:`evaluate` needs. ``etc`` prefixes the engines' configuration files
    (tests point it at a made-up tree); ``proc`` is the procfs to read."""
    from ..cdi import commands
    from ..inventory import procfs

    root = os.path.abspath(config.root)
    kernel = procfs.driver_version(proc)
    facts: dict = {"root": root, "ldcache": config.ldcache, "kernel_version": kernel}
    facts.update(_cache_facts(root, config.ldcache))
    if kernel is not None:
        facts.update(_nvml_facts(config, root, facts.get("cache_libs", {}), kernel))
        facts["nodes"] = tuple(_node_facts(root, proc))
    facts.update(_cgroup_facts(proc))
    facts.update(_ldconfig_facts(config))
    facts["persistenced"] = _persistenced(root)
    verdicts, problems = commands.check_specs(spec_dirs, ())
    facts.update(cdi_dirs=tuple(spec_dirs), cdi_verdicts=tuple(verdicts), cdi_problems=tuple(problems))
    facts["registrations"] = tuple(registrations(etc))
    facts["registration_problems"] = tuple(registration_problems(etc))
    from ..hook.client import SOCKET

    facts["serve_socket"] = serve_socket or SOCKET
    facts["serve_state"] = serve_state(facts["serve_socket"])
    facts["config_lines"] = tuple(config.report())
    facts.update(_lease_facts(config, proc))
    from ..metrics.probe import probe

    facts["metrics"] = probe()
    return Facts(**facts)


def _cache_facts(root: str, ldcache_path: str) -> dict:
    from ..fs.inroot import resolve_in_root
    from ..inventory import build, ldcache

    try:
        entries = build.read_cache(root, ldcache_path)
    except NvcError as exc:
        return {"cache_error": exc.detail}
    libs: dict[str, list[str]] = {}
    for entry in ldcache.entries_for_arch(entries, ldcache.native_arches()[0]):
        if entry.key in LIBRARIES:
            try:
                libs.setdefault(entry.key, []).append(resolve_in_root(root, entry.value))
            except OSError:
                continue
    return {"cache_libs": libs}


def _nvml_facts(config, root: str, cache_libs: dict, kernel: str) -> dict:
    from ..inventory.identity import parse_user
    from ..inventory import nvml

    match = [p for p in cache_libs.get("libnvidia-ml.so.1", []) if os.path.basename(p).endswith("." + kernel)]
    if not match:
        return {}
    path = os.path.join(root, match[0].lstrip("/"))
    try:
        reply = nvml.query(path, parse_user(config.user), min(config.deadline, 30))
    except NvcError as exc:
        return {"nvml_error": exc.detail}
    return {"nvml_version": reply["driver_version"], "nvml_gpus": len(reply["gpus"]),
            "nvml_persistence": tuple(g.get("persistence") for g in reply["gpus"])}


def _node_facts(root: str, proc: str) -> list[Node]:
    from ..cdi.check import probe, running
    from ..inventory import procfs

    def host(path: str) -> str:
        return os.path.join(root, path.lstrip("/")) if root != "/" else path

    wanted = [("/dev/nvidiactl", (NVIDIA_MAJOR, CTL_MINOR))]
    wanted += [(f"/dev/nvidia{minor}", (NVIDIA_MAJOR, minor)) for minor, _ in running(proc).gpus]
    uvm = procfs.char_majors(proc).get("nvidia-uvm")
    if uvm is not None:
        wanted += [("/dev/nvidia-uvm", (uvm, 0)), ("/dev/nvidia-uvm-tools", (uvm, 1))]
    return [Node(host(path), numbers, probe(host(path))) for path, numbers in wanted]


def _cgroup_facts(proc: str) -> dict:
    from ..inventory.procfs import read_text

    v1_devices = v2 = False
    for line in (read_text(os.path.join(proc, "self/mountinfo"), 16 << 20) or "").splitlines():
        _, sep, tail = line.partition(" - ")
        fields = tail.split()
        if not sep or len(fields) < 3:
            continue
        if fields[0] == "cgroup2":
            v2 = True
        elif fields[0] == "cgroup" and "devices" in fields[2].split(","):
            v1_devices = True
    comm = (read_text(os.path.join(proc, "1/comm"), 64) or "").strip()
    return {"cgroup_v1_devices": v1_devices, "cgroup_v2": v2, "systemd": comm == "systemd"}


def _ldconfig_facts(config) -> dict:
    """The very check a hook makes before its first run (a sealed copy, a static ELF)."""
    from ..apply import ldconfig

    program = config.ldconfig_program()
    try:
        ldconfig.prepare(program)
    except NvcError as exc:
        return {"ldconfig": program, "ldconfig_problem": exc.detail}
    return {"ldconfig": program}


def _lease_facts(config, proc: str) -> dict:
    from ..leases.store import path_in
    from ..ps.gather import lease_facts

    leases, problem = lease_facts(config, proc)
    return {"leases": tuple(leases), "lease_error": problem, "lease_file": path_in(config.cache_dir)}


def _persistenced(root: str) -> bool:
    from ..fs.inroot import resolve_in_root
    from ..inventory.catalog import PERSISTENCED_SOCKET

    try:
        real = resolve_in_root(root, PERSISTENCED_SOCKET)
        return stat.S_ISSOCK(os.stat(os.path.join(root, real.lstrip("/"))).st_mode)
    except OSError:
        return False




def serve_state(path: str) -> str:
    """``listening``, ``stale`` or ``absent`` (nothing there, not a socket, or not readable)."""
    from ..serve.listen import socket_state

    try:
        state = socket_state(path)
    except OSError:
        return "absent"
    return "absent" if state == "not a socket" else state
