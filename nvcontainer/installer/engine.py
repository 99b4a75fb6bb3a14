"""The node's engine told about the installed programs, restarted, and told again when they go.

Registration is ``nvcontainer setup ENGINE``'s (the same decision, the same atomic writes, the
same backups and the same record that ``--undo`` takes back byte for byte), with the paths of
the installed tree and without the parts a DaemonSet does itself: no systemd units (the
installer's pod serves) and no links on the engines' PATH.

Before anything is written, :func:`conflict` refuses an engine that already has a runtime
``nvidia`` that is not ours (NVIDIA's toolkit, an operator's own): replacing it would change
what the node's pods run without its owner knowing, and taking it back later could not restore
it. A malformed file or a symlink in the engine's place is refused by setup's reading of it.

Restart modes are NVIDIA's. ``signal``: SIGHUP to the process that answers on the engine's
socket (its peer credentials), which dockerd takes as "reload daemon.json" and containerd as
"exit", for its service manager to start it again; ``systemd``: ``systemctl restart`` of the
unit, run in the host's root; ``none``: the operator restarts it. Containers outlive either:
their shims (containerd-shim-runc-v2, conmon) are not children of the engine. Afterwards the
engine must answer on its socket again within a deadline (for containerd and CRI-O, a new
process); if it does not, the caller puts the engine's files back and says so.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import time

from ..errors import NvcError, escape
from .settings import UNITS, Settings

SYSTEMCTL_TIMEOUT = 120.0


def _runtime_path(value) -> str | None:
    return value if isinstance(value, str) else None


def conflict(engine: str, read, expand, ours: str) -> str | None:
    """Why the engine's files already name another runtime ``nvidia`` (None: they do not, or it
    is ``ours``). ``read``/``expand`` as setup's World gives them (host paths)."""
    from ..setup import containerd, engines, tomltext

    if engine == "docker":
        import json

        text = read(engines.DAEMON_JSON)
        try:
            doc = json.loads(text) if text and text.strip() else {}
        except ValueError as exc:
            raise NvcError("setup", f"{engines.DAEMON_JSON}: not JSON ({escape(exc, 80)}); fix it first") from None
        found = doc.get("runtimes", {}).get("nvidia") if isinstance(doc, dict) and \
            isinstance(doc.get("runtimes"), dict) else None
        path = _runtime_path(found.get("path")) if isinstance(found, dict) else found and "?"
        where = engines.DAEMON_JSON
    elif engine == "containerd":
        own = read(containerd.DROPIN)
        if own is not None and not own.startswith(containerd.HEADER.splitlines()[0][:40]):
            return f"{containerd.DROPIN} is not nvcontainer's (NVIDIA's toolkit writes one there): remove it first"
        if own is not None:
            mine = _handler_path(tomltext.parse(own, containerd.DROPIN).get("plugins", {}), ("containerd", "runtimes",
                                                                                          "nvidia", "options",
                                                                                          "BinaryName"))
            if mine and mine != ours:
                return _by_hand(containerd.DROPIN, mine, engine)
        main_text = read(containerd.MAIN)
        main = tomltext.parse(main_text, containerd.MAIN) if main_text is not None else {}
        key = containerd.CRI[containerd.layout(main, None, containerd.MAIN)] if main else None
        cri = containerd.effective_cri(main, key, containerd.MAIN, read, expand) if key else {}
        found = cri.get("containerd", {}).get("runtimes", {}).get("nvidia") if isinstance(cri.get("containerd"),
                                                                                            dict) else None
        options = found.get("options") if isinstance(found, dict) else None
        path = _runtime_path(options.get("BinaryName")) if isinstance(options, dict) else found and "?"
        where = containerd.MAIN
    else:
        own = read(engines.CRIO_DROPIN)
        if own is not None and not own.startswith(engines.CRIO_HEADER.splitlines()[0][:40]):
            return f"{engines.CRIO_DROPIN} is not nvcontainer's (NVIDIA's toolkit writes one there): remove it first"
        if own is not None:
            mine = _handler_path({"x": tomltext.parse(own, engines.CRIO_DROPIN)},
                                 ("crio", "runtime", "runtimes", "nvidia", "runtime_path"))
            if mine and mine != ours:
                return _by_hand(engines.CRIO_DROPIN, mine, engine)
        path, where = None, ""
        for f in ["/etc/crio/crio.conf", *expand("/etc/crio/crio.conf.d/*")]:
            if f == engines.CRIO_DROPIN:
                continue
            text = read(f)
            doc = tomltext.parse(text, f) if text is not None else {}
            found = doc.get("crio", {}).get("runtime", {}).get("runtimes", {}).get("nvidia")
            if isinstance(found, dict):
                path, where = _runtime_path(found.get("runtime_path")) or "?", f
    if path and path != ours:
        return f"{where} already has a runtime 'nvidia' ({escape(path, 120)}): remove it first, or run NVIDIA's " \
               "toolkit instead of this one"
    return None


def _handler_path(plugins: dict, keys: tuple[str, ...]) -> str | None:
    """The path at ``keys`` under any one section of ``plugins`` (CRI's v2 or v3 key)."""
    for section in plugins.values():
        node = section
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, str):
            return node
    return None


def _by_hand(where: str, path: str, engine: str) -> str:
    return (f"{where} registers {escape(path, 120)}: nvcontainer setup did that (by hand or the package); "
            f"leave this node to it, or run 'nvcontainer setup {engine} --undo' first")


def engine_pid(sock: str) -> int | None:
    """The pid of the process answering on ``sock`` (its peer credentials); None if none does."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(2.0)
    try:
        s.connect(sock)
        pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid or None
    except OSError:
        return None
    finally:
        s.close()


def restart(s: Settings) -> str:
    """Restart (or signal) the engine as ``s.restart_mode`` says and wait for it to answer; the
    line to log. :class:`NvcError` when it does not come back within ``s.restart_timeout``."""
    sock = s.on_host(s.socket)
    if s.restart_mode == "none":
        return f"restart mode none: restart {s.runtime} for it to read its new configuration"
    before = engine_pid(sock)
    if s.restart_mode == "signal":
        if before is None:
            return f"{s.runtime} does not answer on {s.socket}: nothing to signal (it reads the configuration " \
                   "when it starts)"
        try:
            os.kill(before, signal.SIGHUP)
        except OSError as exc:
            raise NvcError("install", f"cannot signal {s.runtime} (pid {before}): {exc.strerror}") from None
    else:
        _systemctl(s, "restart", UNITS[s.runtime])
    return _wait(s, sock, before)


def _wait(s: Settings, sock: str, before: int | None) -> str:
    new_process = s.runtime != "docker" or s.restart_mode == "systemd"
    end = time.monotonic() + s.restart_timeout
    time.sleep(0.05)
    while time.monotonic() < end:
        now = engine_pid(sock)
        if now is not None and (not new_process or now != before):
            verb = "reloaded" if now == before else "restarted"
            return f"{s.runtime} {verb} ({s.restart_mode}): answering on {s.socket} (pid {now})"
        time.sleep(0.1)
    raise NvcError("install", f"{s.runtime} did not answer on {s.socket} within {s.restart_timeout:g} s of its "
                              f"restart ({s.restart_mode})")


def _systemctl(s: Settings, *args: str) -> None:
    argv = ["systemctl", *args]
    if os.path.realpath(s.host_root) != "/":
        argv = ["chroot", s.host_root, *argv]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, errors="replace", cwd="/", timeout=SYSTEMCTL_TIMEOUT,
                             env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NvcError("install", f"{' '.join(argv)}: {escape(exc, 120)}") from None
    if res.returncode:
        raise NvcError("install", f"{' '.join(argv)}: "
                                  f"{escape((res.stderr.strip().splitlines() or ['failed'])[-1], 200)}")
