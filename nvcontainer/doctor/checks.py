"""``nvcontainer doctor``: what is wrong with GPU containers on this node, and what to do.

Each check gives a verdict (``ok``, ``warn``, ``FAIL``, ``skip`` when an earlier failure makes
it meaningless) with one line of detail and, unless ok, one line saying how to fix it. The
host is read once into :class:`Facts` by :func:`.gather.gather`; :func:`evaluate` here turns
facts into checks without touching the host, so every verdict can be tested on made-up facts.
"""

from __future__ import annotations

import json
import os

from ..errors import escape
from ..records import asdict, field, record

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
LIBRARIES = ("libnvidia-ml.so.1", "libcuda.so.1")
CDI_HINT = "nvcontainer cdi generate --output /var/run/cdi/nvidia.yaml"


@record
class Check:
    name: str
    verdict: str
    detail: str
    fix: str = ""


@record
class Node:
    path: str                                   # as on the host (driver root included)
    expected: tuple[int, int]
    found: tuple[str, int, int] | None          # check.probe's answer


@record
class Facts:
    root: str = "/"
    ldcache: str = "/etc/ld.so.cache"
    kernel_version: str | None = None
    cache_error: str | None = None
    cache_libs: dict = field(default_factory=dict)       # SONAME → resolved files, root-relative
    nvml_version: str | None = None
    nvml_gpus: int | None = None
    nvml_error: str | None = None
    nvml_persistence: tuple = ()                          # per GPU: persistence mode on (None: unknown)
    nodes: tuple[Node, ...] = ()
    cgroup_v1_devices: bool = False
    cgroup_v2: bool = False
    systemd: bool = False
    persistenced: bool = False
    ldconfig: str = "/sbin/ldconfig"                      # the host program the hook runs
    ldconfig_problem: str | None = None                   # why the hook would refuse it
    cdi_dirs: tuple[str, ...] = ()
    cdi_verdicts: tuple = ()                              # cdi.check.Verdict
    cdi_problems: tuple[str, ...] = ()
    registrations: tuple[tuple[str, str, str], ...] = ()  # (engine, what, where)
    registration_problems: tuple[str, ...] = ()           # setup's registrations that no longer hold
    serve_socket: str = "/run/nvcontainer/hook.sock"
    serve_state: str = "absent"                           # listening, absent, stale (nobody answers)
    config_lines: tuple[str, ...] = ()                    # Config.report(): the file read, which won, inert keys
    leases: tuple = ()                                    # ps.model.Lease: recorded leases, each alive or not
    lease_file: str = "/run/nvcontainer/leases.json"
    lease_error: str | None = None                        # why the lease file cannot be trusted


# --- deciding ----------------------------------------------------------------------------------


def evaluate(f: Facts) -> list[Check]:
    checks = [_driver(f), _cache(f), _versions(f), _nvml(f), _nodes(f), _cgroups(f), _ldconfig(f), _persistence(f),
              _cdi(f)]
    checks.append(_registrations(f))
    checks.append(_serve(f))
    checks.append(_leases(f))
    checks.append(_configuration(f))
    return checks


def _configuration(f: Facts) -> Check:
    """The file read; a warning for upstream keys that have no effect here, or two files."""
    read, notes = (f.config_lines[:1] or ["configuration: unknown"])[0], f.config_lines[1:]
    if notes:
        return Check("configuration", WARN, escape(f"{read}; " + "; ".join(notes), 600),
                     "remove the keys that have no effect (or merge the two files), so the file says what happens")
    return Check("configuration", OK, escape(read))


def _driver(f: Facts) -> Check:
    if f.kernel_version is None:
        return Check("driver loaded", FAIL, "no /proc/driver/nvidia/version: the nvidia kernel module is not loaded",
                     "load it (modprobe nvidia) or install the driver; dmesg shows why it did not load (NVRM lines)")
    return Check("driver loaded", OK, f"kernel module {f.kernel_version}")


def _cache(f: Facts) -> Check:
    where = escape(os.path.join(f.root, f.ldcache.lstrip("/")))
    if f.cache_error:
        return Check("ld cache", FAIL, escape(f.cache_error),
                     "run ldconfig on the host (or point --root/--ldcache at the driver's cache)")
    missing = [name for name in LIBRARIES if not f.cache_libs.get(name)]
    if missing:
        return Check("ld cache", FAIL, f"{', '.join(missing)} not in {where}",
                     "install the driver's user-space libraries, then run ldconfig; a library directory "
                     "outside the default ones needs a file in /etc/ld.so.conf.d")
    return Check("ld cache", OK, f"{', '.join(LIBRARIES)} in {where}")


def _versions(f: Facts) -> Check:
    if f.kernel_version is None or f.cache_error or not all(f.cache_libs.get(n) for n in LIBRARIES):
        return Check("versions match", SKIP, "needs the driver and the ld cache")
    wrong = []
    for name in LIBRARIES:
        files = [os.path.basename(p) for p in f.cache_libs[name]]
        if not any(base.endswith("." + f.kernel_version) for base in files):
            wrong.append(f"{name} is {escape(', '.join(files), 120)}")
    if wrong:
        return Check("versions match", FAIL,
                     f"driver/library version mismatch: kernel module {f.kernel_version}, {'; '.join(wrong)}",
                     "after a driver upgrade, reboot (or unload and reload the nvidia modules) so the module "
                     "matches the libraries")
    return Check("versions match", OK, f"kernel module and {', '.join(LIBRARIES)} are {f.kernel_version}")


def _nvml(f: Facts) -> Check:
    if f.nvml_error:
        return Check("NVML", FAIL, escape(f.nvml_error, 300),
                     "rerun with --debug FILE for the trace; 'timed out' usually means persistence mode is off")
    if f.nvml_version is None:
        return Check("NVML", SKIP, "needs the driver and a matching libnvidia-ml.so.1")
    return Check("NVML", OK, f"driver {f.nvml_version}, {f.nvml_gpus} GPU(s)")


def _nodes(f: Facts) -> Check:
    if f.kernel_version is None:
        return Check("device nodes", SKIP, "needs the driver")
    missing = [n.path for n in f.nodes if n.found is None]
    wrong = [f"{n.path} is {n.found[1]}:{n.found[2]}, expected {n.expected[0]}:{n.expected[1]}"
             if n.found[0] == "c" else f"{n.path} is not a character device"
             for n in f.nodes if n.found is not None and n.found != ("c", *n.expected)]
    if wrong:
        return Check("device nodes", FAIL, escape("; ".join(wrong), 300),
                     "remove them and let the driver re-create them (nvidia-modprobe, or nvidia-smi as root), "
                     "or mknod PATH c MAJOR MINOR")
    if missing:
        return Check("device nodes", FAIL, f"missing {escape(', '.join(missing), 300)}",
                     "create them: nvidia-modprobe -c MINOR -u (or run nvidia-smi once as root); "
                     "the uvm nodes need the nvidia-uvm module")
    return Check("device nodes", OK, f"{len(f.nodes)} present with the driver's numbers")


def _cgroups(f: Facts) -> Check:
    if f.cgroup_v1_devices:
        kind = "cgroup v1 (devices controller): a hook adds lines to devices.allow"
    elif f.cgroup_v2:
        kind = "cgroup v2: a hook splices rules into the runtime's eBPF device program"
    else:
        return Check("cgroups", WARN, "no devices controller and no cgroup2 mount found",
                     "mount the cgroup hierarchies (the runtime cannot confine devices without them)")
    if f.systemd:
        return Check("cgroups", WARN, f"{kind}; with systemd, engines using the systemd cgroup driver lose such "
                                      "rules on 'systemctl daemon-reload' (NVML: Unknown Error, toolkit#48)",
                     f"use CDI, where device rules are part of the container's config: {CDI_HINT}")
    return Check("cgroups", OK, f"{kind}; no systemd to re-apply device rules")


def _ldconfig(f: Facts) -> Check:
    if f.ldconfig_problem is None:
        return Check("ldconfig", OK, f"{escape(f.ldconfig)}: a static binary, run sealed in each container")
    return Check("ldconfig", FAIL, f"{escape(f.ldconfig_problem, 300)}: every GPU container would be refused at "
                                   "its linker cache step",
                 'set ldconfig = "@PATH" in /etc/nvcontainer/config.toml to a static ldconfig binary (where '
                 "/sbin/ldconfig is a script, the binary it runs)")


def _persistence(f: Facts) -> Check:
    if f.persistenced:
        return Check("persistence", OK, "nvidia-persistenced is running (its socket is present)")
    modes = f.nvml_persistence
    if modes and all(modes):
        # seen on a real H100 node: persistence mode set (nvidia-smi -pm 1), no daemon
        return Check("persistence", OK, f"persistence mode is on for every GPU ({len(modes)}); "
                                        "nvidia-persistenced is not running")
    off = [str(i) for i, on in enumerate(modes) if on is False]
    which = f"persistence mode is off for GPU {', '.join(off)} and " if off else ""
    return Check("persistence", WARN, f"{which}nvidia-persistenced is not running: without persistence the driver "
                                      "tears the GPUs down when their last user exits, so container starts pay GPU "
                                      "initialisation (slow starts, 'driver rpc error: timed out')",
                 "systemctl enable --now nvidia-persistenced")


def _cdi(f: Facts) -> Check:
    dirs = ", ".join(escape(d) for d in f.cdi_dirs)
    stale = [v for v in f.cdi_verdicts if v.stale]
    if stale:
        first = stale[0]
        return Check("CDI specs", FAIL, f"{len(stale)} of {len(f.cdi_verdicts)} stale: {escape(first.path)}: "
                                        f"{first.problems[0]}",
                     f"regenerate: nvcontainer cdi generate --output {escape(first.path)}; "
                     "'nvcontainer cdi check' lists every problem")
    if f.cdi_problems:
        return Check("CDI specs", WARN, f"unreadable: {escape(f.cdi_problems[0], 200)}",
                     "fix or remove the file: engines skip a spec they cannot read")
    if not f.cdi_verdicts:
        return Check("CDI specs", SKIP, f"none in {dirs}", f"to use CDI: {CDI_HINT}")
    return Check("CDI specs", OK, f"{len(f.cdi_verdicts)} in {dirs}, none stale")


PROVIDERS = ("nvcontainer", "nvidia-container-toolkit")


def _registrations(f: Facts) -> Check:
    if not f.registrations:
        if f.cdi_verdicts:
            return Check("hooks", OK, "no hook registered: containers get GPUs through CDI only")
        return Check("hooks", WARN, "no engine is set up to give containers GPUs (no hook registration, no CDI spec)",
                     "nvcontainer setup ENGINE (docker, containerd, crio, podman); see nvcontainer-setup(1)")
    found = "; ".join(f"{engine}: {what} ({escape(where)})" for engine, what, where in f.registrations)
    if f.registration_problems:
        return Check("hooks", WARN, f"{escape(f.registration_problems[0], 300)}; {found}",
                     "run nvcontainer setup containerd again (it rewrites its drop-in from config.toml)")
    providers = {what.split(" ", 1)[0] for _, what, _ in f.registrations} & set(PROVIDERS)
    if len(providers) > 1:
        return Check("hooks", WARN, f"more than one injector registered: {found}",
                     "keep one: two hooks would both inject into the same container "
                     "(nvcontainer setup ENGINE --undo, or remove NVIDIA's)")
    return Check("hooks", OK, found)


def _serve(f: Facts) -> Check:
    where = escape(f.serve_socket)
    if f.serve_state == "listening":
        return Check("hook server", OK, f"nvcontainer serve listens on {where}: hooks run warm")
    clients = [what for _, what, _ in f.registrations if "client of nvcontainer serve" in what
               or what.startswith("nvcontainer runtime")]
    if f.serve_state == "stale":
        return Check("hook server", WARN, f"{where} is there but nobody answers: a server stopped hard; "
                                          "hooks run in their own process",
                     "systemctl restart nvcontainer-serve.socket (it replaces the stale socket)")
    if clients:
        return Check("hook server", WARN, f"hooks are registered to hand their runs to nvcontainer serve, and none "
                                          f"listens on {where}: each start runs the hook in its own process",
                     "systemctl enable --now nvcontainer-serve.socket")
    return Check("hook server", SKIP, f"none on {where}: hooks run in their own process (slower starts)",
                 "for faster starts: nvcontainer setup ENGINE (it enables nvcontainer-serve.socket); "
                 "see nvcontainer-serve(1)")


def _leases(f: Facts) -> Check:
    """Stale leases: GPUs recorded for containers that are gone. Requests check each lease's
    container and do not wait for them, but no server watched them end (it releases a lease
    within a second), and ``ps`` lists them until the next lease request prunes the file."""
    where = escape(f.lease_file)
    if f.lease_error:
        return Check("leases", WARN, f"{where} cannot be read: {escape(f.lease_error)}",
                     "no GPU is leased until it can be: move it aside once the containers it names have ended")
    stale = [lease for lease in f.leases if not lease.alive]
    if stale:
        names = "; ".join(f"container {escape(lease.container[:12])} "
                          + (f"(pid {lease.pid})" if lease.pid else "(its init never started)") + " on "
                          + ", ".join(escape(g) for g in lease.gpus) for lease in stale)
        return Check("leases", WARN, escape(f"{len(stale)} of {len(f.leases)} lease(s) stale, their container "
                                            f"gone: {names}", 600),
                     "requests do not wait for them; nvcontainer serve releases them at start and watches every "
                     "lease (systemctl restart nvcontainer-serve.service), else the next free request prunes them; "
                     "see nvcontainer-ps(1)")
    if not f.leases:
        return Check("leases", OK, f"no GPU leased ({where})")
    return Check("leases", OK, f"{len(f.leases)} lease(s), each held by a running container")


# --- output ------------------------------------------------------------------------------------


def render_text(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks) + 2
    lines = []
    for c in checks:
        lines.append(f"{c.verdict:<5} {c.name:<{width}}{c.detail}")
        if c.fix and c.verdict != OK:
            lines.append(f"{'':<6}{'':<{width}}fix: {c.fix}")
    return "".join(line + "\n" for line in lines)


def render_json(checks: list[Check]) -> str:
    return json.dumps([asdict(c) for c in checks], indent=2) + "\n"
