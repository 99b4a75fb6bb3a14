"""The native hook client (``nvcontainer/native/hookclient.c``) against its specification, ``nvcontainer/hook/client.py``.

Both clients are run as a runtime runs a hook, against a recording server in this process that
answers what each case needs, and must send the same request and say and return the same
things. The served end to end runs (a real ``nvcontainer serve`` and runc, crun and podman) are
in tests/test_serve.py, with both clients.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nvcontainer.hook import client as hookclient
from nvcontainer.native import build as nativeclient
from nvcontainer.errors import NvcError

REPO = Path(__file__).resolve().parent.parent
PY_CLIENT = [sys.executable, "-I", "-S", str(REPO / "nvcontainer" / "hook" / "client.py")]


@pytest.fixture
def native(native_client) -> str:
    return native_client


@pytest.fixture(params=["python", "native"])
def client(request, native):
    return PY_CLIENT if request.param == "python" else [native]


class Recorder:
    """A socket that answers each connection with the next of ``replies`` (None: hang up
    without a word) and keeps what each client sent."""

    def __init__(self, path: Path, replies: list[bytes | None]):
        self.path, self.replies, self.requests = path, list(replies), []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for reply in self.replies:
            while not self.stop.is_set() and not select.select([self.sock], [], [], 0.02)[0]:
                pass
            if self.stop.is_set():
                return
            conn, _ = self.sock.accept()
            with conn:
                data, ancillary, flags, _ = conn.recvmsg(1 << 17, socket.CMSG_SPACE(64))
                fds = []
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds += struct.unpack(f"{len(payload) // 4}i", payload)
                kinds = [stat.S_IFMT(os.fstat(fd).st_mode) for fd in fds]
                cwd = os.readlink(f"/proc/self/fd/{fds[3]}") if len(fds) == 4 else None
                for fd in fds:
                    os.close(fd)
                self.requests.append({"data": data, "fds": len(fds), "kinds": kinds, "cwd": cwd, "flags": flags})
                if reply is not None:
                    conn.send(reply)

    def close(self) -> None:
        """Ends the thread too: a thread left in the test process would make every later test
        that forks a worker refuse to (a worker is never forked from a threaded process)."""
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.sock.close()


def run(argv: list[str], *, stdin: str = "", cwd: str = "/", env: dict | None = None, umask: int = 0o022):
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin"} if env is None else env,
                          preexec_fn=lambda: os.umask(umask))


def test_both_clients_send_the_same_request(tmp_path, native):
    sock = tmp_path / "s.sock"
    rec = Recorder(sock, [b"rc 0", b"rc 0"])
    argv = ["--socket", str(sock), "--root", "/r w", "--debug=/tmp/é.log", "-u", "7:8", "prestart"]
    env = {"PATH": "/sbin:/bin", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps", "LD_PRELOAD": "/evil.so", "HOME": "/root"}
    procs = [run([*prog, *argv], cwd=str(tmp_path), env=env, umask=0o027) for prog in (PY_CLIENT, [native])]
    rec.thread.join(10)   # both answered: the thread ends by itself
    rec.close()
    assert [p.returncode for p in procs] == [0, 0], [p.stderr for p in procs]
    py, nat = rec.requests
    for req in (py, nat):
        pid, umask, args, got_env = hookclient.decode_request(req["data"])
        assert (umask, args) == (0o027, argv)
        assert got_env == {"PATH": "/sbin:/bin", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps"}   # nothing else passes
        assert req["fds"] == 4 and req["kinds"][3] == stat.S_IFDIR and req["cwd"] == str(tmp_path)
    # the same bytes but for the PID each client gives
    assert py["data"].split(b" ", 2)[2] == nat["data"].split(b" ", 2)[2]


@pytest.mark.parametrize("reply, rc, said", [
    (b"rc 0", 0, ""),
    (b"rc 3", 3, ""),
    (b"rc 255", 255, ""),
    (b"the hook's own words", 1, "the hook's own words"),
    (b"", 1, "no answer"),
    (None, 1, "no answer"),                      # the server's child died before answering
    (b"bad\x1b[2Jbytes\n", 1, "no answer"),      # never echoed to the runtime's log
    (b"rc 12345678", 1, "rc 12345678"),
])
def test_the_answer_decides_the_exit_status(tmp_path, client, reply, rc, said):
    sock = tmp_path / "s.sock"
    rec = Recorder(sock, [reply])
    res = run([*client, "--socket", str(sock), "prestart"])
    rec.thread.join(10)
    rec.close()
    assert res.returncode == rc
    expected = f"nvcontainer-hook: error: nvcontainer serve at {sock}: {said}\n" if said else ""
    assert res.stderr == expected and res.stdout == ""


@pytest.mark.parametrize("argv", [
    ["--debug", "/d.log", "--socket", "{s}", "prestart"],
    ["--debug=/d.log", "--socket={s}", "--dry-run", "prestart"],
    ["-d", "/d.log", "-r", "/", "--socket", "{s}", "prestart"],
    ["--socket", "{s}", "--socket", "{other}", "prestart"],   # the last one counts
    ["-d", "--socket", "prestart", "--socket", "{s}"],         # -d takes "--socket"; options end at the stage
    ["--socket", "", "prestart"],                               # fast path off
    ["prestart", "--socket", "{s}"],
])
def test_both_clients_find_the_same_socket(tmp_path, native, argv):
    """Served (the recorder answers rc 7) or not (the in-process hook runs: same words from both)."""
    sock, other = tmp_path / "s.sock", tmp_path / "other.sock"
    args = [a.replace("{s}", str(sock)).replace("{other}", str(other)) for a in argv]
    results = []
    for prog in (PY_CLIENT, [native]):
        rec = Recorder(sock, [b"rc 7"])
        res = run([*prog, *args], env={"PATH": "/usr/bin:/bin"})
        rec.close()
        sock.unlink()
        results.append((res.returncode, res.stdout, res.stderr.replace(str(tmp_path), "T"), len(rec.requests)))
    assert results[0] == results[1]
    served = hookclient.socket_path(args) == str(sock)
    assert (results[0][0] == 7) == served and results[0][3] == int(served)


def test_a_declined_run_is_the_in_process_hook(tmp_path, client):
    """Declined before anything is read: the hook then reads the state itself."""
    sock = tmp_path / "s.sock"
    rec = Recorder(sock, [b"declined client in another mnt namespace"])
    res = run([*client, "--socket", str(sock), "--dry-run", "prestart"], stdin='{"pid": true}')
    rec.close()
    assert res.returncode == 1
    assert res.stderr.startswith("nvcontainer-hook: input error: state: pid"), res.stderr


def test_without_a_server_the_native_client_runs_the_python_hook(tmp_path, native):
    res = run([native, "--socket", str(tmp_path / "none.sock"), "--help"])
    ref = run([sys.executable, "-I", "-m", "nvcontainer.hook", "--help"])
    assert (res.returncode, res.stdout, res.stderr) == (ref.returncode, ref.stdout, ref.stderr)
    assert res.returncode == 0 and res.stdout.startswith("usage: nvcontainer-hook")


def test_the_build_is_static_executable_and_replaced_whole(tmp_path):
    from elftools.elf.elffile import ELFFile

    dest = tmp_path / "bin" / nativeclient.NAME
    assert nativeclient.build(str(dest), sys.executable) in ("static", "dynamic")
    first = dest.stat()
    assert stat.S_IMODE(first.st_mode) == 0o755
    with open(dest, "rb") as f:
        linked = "dynamic" if any(seg["p_type"] == "PT_INTERP" for seg in ELFFile(f).iter_segments()) else "static"
    assert nativeclient.build(str(dest), "/other/python") == linked
    assert dest.stat().st_ino != first.st_ino            # a new file renamed over, never rewritten in place
    assert b"/other/python" in dest.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == [nativeclient.NAME]   # no staging file left


def test_the_header_embeds_what_the_python_client_reads():
    header = nativeclient.config_header('/opt/a "b"\\c?/python')
    assert '#define NVC_PYTHON "/opt/a \\"b\\"\\\\c\\?/python"\n' in header
    for option in hookclient.VALUED:
        assert f'"{option}"' in header
    with pytest.raises(NvcError, match="cannot embed"):
        nativeclient.config_header("/opt/new\nline/python")


def test_without_a_compiler_building_is_one_error(tmp_path):
    with pytest.raises(NvcError) as err:
        nativeclient.build(str(tmp_path / "x"), sys.executable, cc=str(tmp_path / "no-cc"))
    assert "cannot run" in err.value.detail and "\n" not in err.value.detail
    assert not (tmp_path / "x").exists()
