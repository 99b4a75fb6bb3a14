"""The systemd units: checked by systemd's own ``systemd-analyze verify``, and the socket-activated
server emulated with ``systemd-socket-activate`` (no systemd runs here)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvcontainer.native import build as native
from nvcontainer.setup import units

CLI = str(Path(sys.executable).parent / "nvcontainer")


def verify(directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, sorted(directory.iterdir()))],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_units_verify(tmp_path):
    for name, text in units.all_units(CLI).items():
        (tmp_path / name).write_text(text)
    res = verify(tmp_path)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    # and the check would catch a unit that cannot work
    (tmp_path / units.SERVE_SOCKET).write_text(units.serve_socket().replace("ListenSequentialPacket=", "Listen="))
    assert verify(tmp_path).returncode != 0


def test_units_say_what_they_promise():
    socket, service = units.serve_socket(), units.serve_service("/usr/bin/nvcontainer")
    assert f"ListenSequentialPacket={units.SOCKET}\n" in socket and "SocketMode=0600\n" in socket
    assert "WantedBy=sockets.target" in socket
    assert f"ExecStart=/usr/bin/nvcontainer serve --socket {units.SOCKET}\n" in service
    assert f"Requires={units.SERVE_SOCKET}\n" in service
    path = units.refresh_path()
    assert "PathChanged=/lib/modules/%v/modules.dep\n" in path and "PathChanged=/etc/ld.so.cache\n" in path
    assert f"ExecStart=/usr/bin/nvcontainer cdi generate --output {units.CDI_SPEC}\n" in units.refresh_service(
        "/usr/bin/nvcontainer")
    assert 'KERNEL=="nvidia"' in units.udev_rule() and units.REFRESH_SERVICE in units.udev_rule()


@pytest.mark.skipif(not shutil.which("systemd-socket-activate"), reason="systemd-socket-activate is not installed")
def test_socket_activation_serves_the_first_hook(tmp_path, fake_machine, native_client):
    """As nvcontainer-serve.socket: the socket listens before any server runs; the first hook's
    connection starts the server with it (systemd-socket-activate plays systemd), which serves it."""
    home = tmp_path / "srv"
    home.mkdir(mode=0o700)
    sock = home / "hook.sock"
    activator = subprocess.Popen(["systemd-socket-activate", "--seqpacket", "-l", str(sock), "--", sys.executable, "-I", "-m",
                                  "nvcontainer", "--root", str(fake_machine.root), "--debug", str(home / "serve.log"),
                                  "serve", "--socket", str(sock)], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        bundle = tmp_path / "bundle"
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps({
            "ociVersion": "1.0.2", "process": {"env": ["PATH=/bin"], "args": ["sh"], "cwd": "/"},
            "root": {"path": "rootfs"}}))
        state = json.dumps({"ociVersion": "1.0.2", "id": "x", "status": "created", "pid": os.getpid(),
                            "bundle": str(bundle)})
        res = subprocess.run([native_client, "--socket", str(sock), "--debug", str(home / "hook.log"), "prestart"],
                             input=state, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert "(served by nvcontainer serve, pid " in (home / "hook.log").read_text()
    finally:
        activator.send_signal(signal.SIGTERM)
        activator.wait(timeout=30)


ADOPT = r"""
import os, socket, sys
from nvcontainer.errors import NvcError
from nvcontainer.serve import listen
kind, path, bound = sys.argv[1], sys.argv[2], sys.argv[3]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM if kind == "stream" else socket.SOCK_SEQPACKET)
sock.bind(bound)
if kind != "unlistened":
    sock.listen(1)
os.dup2(sock.fileno(), 3)
os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid() + (kind == "another-pid")))
try:
    got = listen.adopt(path)
except NvcError as exc:
    print("refused:", exc.detail)
else:
    print("none" if got is None else f"adopted {oct(os.stat(path).st_mode & 0o777)}",
          "LISTEN_FDS" in os.environ)
"""


@pytest.mark.parametrize("kind, expected", [
    ("seqpacket", "adopted 0o600 False"),            # tightened to 0600, the variables gone
    ("another-pid", "none False"),                   # meant for the process that started us
    ("stream", "refused: LISTEN_FDS: the socket from systemd must be a unix seqpacket socket"),
    ("unlistened", "refused: LISTEN_FDS: the socket from systemd is not listening"),
    ("elsewhere", "refused: LISTEN_FDS: the socket from systemd is bound to"),
])
def test_serve_adopts_only_the_socket_it_would_have_made(tmp_path, kind, expected):
    home = tmp_path / "srv"
    home.mkdir(mode=0o700)
    path = home / "hook.sock"
    bound = home / "other.sock" if kind == "elsewhere" else path
    res = subprocess.run([sys.executable, "-I", "-c", ADOPT, kind, str(path), str(bound)], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(expected), res.stdout
