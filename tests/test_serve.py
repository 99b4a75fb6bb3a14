"""``nvcontainer serve`` and the hook client: a served run is the same run, only warm.

Every case runs a real server (``python -m nvcontainer serve``) inside the fake machine's world
together with its clients, so both share the mount namespace, as on a node. The proof that a
run was served and not done in the client's own process is the hook's trace line
``(served by nvcontainer serve, pid N)``, written by the server's child.
"""

from __future__ import annotations

import json
import re
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures import runtime as rt
from tests.test_dry_run import bundle, pid, write_config  # noqa: F401 (fixtures)
from tests.fixtures.fakegpu.runner import fake_proc_command

REPO = Path(__file__).resolve().parent.parent
CLIENT = str(REPO / "nvcontainer" / "hook" / "client.py")
SERVED = "(served by nvcontainer serve, pid "
IN_PROCESS = [sys.executable, "-I", "-m", "nvcontainer.hook"]

# Runs inside the fake machine's world: starts a server, runs the steps (argv, stdin, and an
# optional "unshare" to run the step in a mount namespace of its own), stops the server with
# SIGTERM, and prints one JSON document with every result.
DRIVER = textwrap.dedent(r"""
    import json, os, select, signal, subprocess, sys, time
    sock, root, steps, debug = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    flags = os.environ.get("NVC_TEST_SERVER_FLAGS", "").split()   # interpreter flags (-X importtime)
    server = subprocess.Popen([sys.executable, "-I", *flags, "-m", "nvcontainer", "--root", root, "--debug", debug,
                               "serve", "--socket", sock, *sys.argv[5:]], stderr=subprocess.PIPE, text=True)
    first, imports = server.stderr.readline(), ""
    while first.startswith("import time:"):   # the server's own imports, with -X importtime
        imports, first = imports + first, server.stderr.readline()
    out = {"ready": first, "steps": [], "imports_before_ready": imports}
    def spares():
        found = []
        for _ in range(200):
            found = subprocess.run(["pgrep", "-P", str(server.pid), "-x", "nvc-spare"], capture_output=True,
                                   text=True).stdout.split()
            if found or "--no-spare" in sys.argv:
                break
            time.sleep(0.01)
        return found
    for step in steps:
        spare_pids = spares()
        time.sleep(step.get("pause", 0))
        started = time.monotonic()
        env = dict(os.environ, **step.get("env", {}))
        res = subprocess.run(step["argv"], input=step.get("stdin", ""), capture_output=True, text=True, timeout=180,
                             env=env)
        out["steps"].append({"rc": res.returncode, "stdout": res.stdout, "stderr": res.stderr,
                             "seconds": time.monotonic() - started, "spares": spare_pids})
    out["spares"] = spares()
    out["children"] = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
    out["requests"] = subprocess.run(["pgrep", "-P", str(server.pid), "-x", "nvc-request"], capture_output=True,
                                     text=True).stdout.split()
    out["server_fds"] = [os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.pid}/fd")]
    out["socket_mode"] = oct(os.lstat(sock).st_mode)
    out["dir_mode"] = oct(os.lstat(os.path.dirname(sock)).st_mode)
    server.send_signal(signal.SIGTERM)
    out["server_rc"] = server.wait(timeout=30)
    out["server_stderr"] = first + server.stderr.read()
    out["socket_left"] = os.path.exists(sock)
    print(json.dumps(out))
""")


def state(pid: int, bundle: Path) -> str:
    return json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": pid, "bundle": str(bundle)})


def client(sock: str, *args: str) -> list[str]:
    """The registration ``nvcontainer setup --serve`` writes without a C compiler: no site,
    builtin modules only."""
    return [sys.executable, "-I", "-S", CLIENT, "--socket", sock, *args]


@pytest.fixture(params=["python", "native"])
def any_client(request, native_client):
    """Both registrations ``nvcontainer setup --serve`` writes: the Python client, and the
    native one it builds where there is a C compiler."""
    if request.param == "python":
        return client
    return lambda sock, *args: [native_client, "--socket", sock, *args]


def in_world(machine, tmp_path: Path, steps: list[dict], sock: str | None = None, serve_args: tuple = ()) -> dict:
    sock = sock or str(tmp_path / "srv" / "hook.sock")
    argv = [sys.executable, "-I", "-c", DRIVER, sock, str(machine.root), json.dumps(steps),
            str(tmp_path / "serve.log"), *serve_args]
    res = subprocess.run(fake_proc_command(machine, argv), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_served_dry_run_is_the_in_process_one(fake_machine, tmp_path, bundle, pid, any_client):
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=utility,compute"])
    sock = str(tmp_path / "srv" / "hook.sock")
    log = tmp_path / "hook.log"
    root = ["--root", str(fake_machine.root)]
    out = in_world(fake_machine, tmp_path, [
        {"argv": any_client(sock, *root, "--debug", str(log), "--dry-run", "prestart"), "stdin": state(pid, bundle)},
        {"argv": [*IN_PROCESS, *root, "--dry-run", "prestart"], "stdin": state(pid, bundle)},
    ], sock)
    served, local = out["steps"]
    assert served["rc"] == local["rc"] == 0, (served, local)
    assert served["stdout"] == local["stdout"]
    plan = json.loads(served["stdout"])
    assert plan["pid"] == pid and "/dev/nvidia1" in [d["path"] for d in plan["devices"]]
    assert "/dev/nvidia0" not in [d["path"] for d in plan["devices"]]
    assert SERVED in log.read_text()
    assert out["ready"].startswith(f"nvcontainer serve: listening on {sock}; inventory ready: driver 550.54.14")


@pytest.mark.parametrize("env, st, expected", [
    (["NVIDIA_VISIBLE_DEVICES=9"], None, "nvcontainer-hook: device error: 9: unknown device\n"),
    (["NVIDIA_VISIBLE_DEVICES=0"], '{"pid": true, "bundle": "/x"}', "nvcontainer-hook: input error: state: pid"),
    (["NVIDIA_VISIBLE_DEVICES=0\x1b[2J\nforged"], None, "nvcontainer-hook: "),
])
def test_a_served_failure_says_what_the_in_process_one_says(fake_machine, tmp_path, bundle, pid, env, st, expected, any_client):
    write_config(bundle, env)
    sock = str(tmp_path / "srv" / "hook.sock")
    log = tmp_path / "hook.log"
    root = ["--root", str(fake_machine.root)]
    stdin = st if st is not None else state(pid, bundle)
    out = in_world(fake_machine, tmp_path, [
        {"argv": any_client(sock, *root, "--debug", str(log), "prestart"), "stdin": stdin},
        {"argv": [*IN_PROCESS, *root, "prestart"], "stdin": stdin},
    ], sock)
    served, local = out["steps"]
    assert (served["rc"], served["stderr"]) == (local["rc"], local["stderr"])
    assert served["rc"] == 1 and served["stderr"].startswith(expected)
    assert served["stderr"].count("\n") == 1 and "Traceback" not in served["stderr"]
    if st is None:   # a bad state fails before the trace's first line
        assert SERVED in log.read_text()


def test_without_a_server_the_client_runs_the_hook_itself(fake_machine, tmp_path, bundle, pid, any_client):
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=0"])
    log = tmp_path / "hook.log"
    res = subprocess.run(fake_proc_command(fake_machine, any_client(str(tmp_path / "none.sock"), "--root",
                                                                str(fake_machine.root), "--debug", str(log),
                                                                "--dry-run", "prestart")),
                         input=state(pid, bundle), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    devices = [d["path"] for d in json.loads(res.stdout)["devices"]]
    assert "/dev/nvidia0" in devices and "/dev/nvidia1" not in devices
    text = log.read_text()
    assert "prestart: pid" in text and SERVED not in text


def test_a_client_in_another_mount_namespace_is_declined_and_runs_itself(fake_machine, tmp_path, bundle, pid, any_client):
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=0"])
    sock = str(tmp_path / "srv" / "hook.sock")
    log = tmp_path / "hook.log"
    argv = ["unshare", "-m", "--propagation", "private", "--",
            *any_client(sock, "--root", str(fake_machine.root), "--debug", str(log), "--dry-run", "prestart")]
    out = in_world(fake_machine, tmp_path, [{"argv": argv, "stdin": state(pid, bundle)}], sock)
    step, = out["steps"]
    assert step["rc"] == 0, step
    assert json.loads(step["stdout"])["pid"] == pid
    assert SERVED not in log.read_text()
    assert "request declined: client in another mnt namespace" in (tmp_path / "serve.log").read_text()


def test_socket_is_root_only_and_goes_away_with_the_server(fake_machine, tmp_path):
    out = in_world(fake_machine, tmp_path, [])
    assert stat.S_IMODE(int(out["socket_mode"], 8)) == 0o600 and stat.S_ISSOCK(int(out["socket_mode"], 8))
    assert stat.S_IMODE(int(out["dir_mode"], 8)) == 0o700
    assert out["server_rc"] == 0 and not out["socket_left"], out["server_stderr"]
    # the host's ldconfig, copied and sealed once for every request to inherit
    assert any(fd.startswith("/memfd:ldconfig") for fd in out["server_fds"]), out["server_fds"]


def _hook_pid(log_text: str) -> int:
    """The PID of the process that wrote the hook's trace (the glog-style third field)."""
    line = next(line for line in log_text.splitlines() if "prestart: pid" in line)
    return int(line.split()[2])


def test_each_request_runs_in_the_spare_forked_before_it(fake_machine, tmp_path, bundle, pid):
    """The spare takes the next request, and a new spare stands in for it; no child serves twice."""
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=0"])
    sock = str(tmp_path / "srv" / "hook.sock")
    logs = [tmp_path / f"hook-{i}.log" for i in range(3)]
    out = in_world(fake_machine, tmp_path, [
        {"argv": client(sock, "--root", str(fake_machine.root), "--debug", str(log), "--dry-run", "prestart"),
         "stdin": state(pid, bundle)} for log in logs], sock)
    assert all(step["rc"] == 0 for step in out["steps"]), out["steps"]
    served_by = [_hook_pid(log.read_text()) for log in logs]
    assert [len(step["spares"]) for step in out["steps"]] == [1, 1, 1] and len(out["spares"]) == 1
    assert served_by == [int(step["spares"][0]) for step in out["steps"]]
    assert len(set(served_by + [int(out["spares"][0])])) == 4


def test_spares_warm_only_what_a_request_wrote(fake_machine, tmp_path, bundle, pid):
    """The first spare warms nothing and its request reports the pages it wrote; later spares
    warm those only (a learned range is always within what they warm)."""
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=0"])
    sock = str(tmp_path / "srv" / "hook.sock")
    logs = [tmp_path / f"hook-{i}.log" for i in range(3)]
    out = in_world(fake_machine, tmp_path, [
        {"argv": client(sock, "--root", str(fake_machine.root), "--debug", str(log), "--dry-run", "prestart"),
         "stdin": state(pid, bundle), "pause": 0.3} for log in logs], sock)
    assert all(step["rc"] == 0 for step in out["steps"]), out["steps"]
    trace = (tmp_path / "serve.log").read_text()
    learned = [int(kib) for kib in re.findall(r"spares warm (\d+) KiB from now on, in \d+ ranges a request wrote", trace)]
    warmed = [int(kib) for kib in re.findall(r"spare \d+: warmed (\d+) KiB", trace)]
    assert len(learned) == 1 and learned[0] > 0, trace   # the first request reported; the next did not need to
    # the spares after the report warmed (the spare of the 3rd request, and the last one)
    assert len(warmed) >= 2 and all(0 < kib <= learned[0] for kib in warmed), trace
    assert trace.index("spares warm") < trace.index(": warmed")


def test_spares_and_requests_import_nothing(fake_machine, tmp_path, monkeypatch, native_client):
    """Whatever a spare, its standby worker and a GPU start (runc, the mounts, the ldconfig
    sandbox) run was imported by the server before it listened: an import in a spare is paid
    again by every spare (the standby module was, 1.3 ms a start in the spare). With
    ``-X importtime`` every process of the server's tree reports its own imports on the
    server's stderr."""
    monkeypatch.setenv("NVC_TEST_SERVER_FLAGS", "-X importtime")
    sock = str(tmp_path / "srv" / "hook.sock")
    log = tmp_path / "hook.log"

    def served_hook(spec):
        entry = spec["hooks"]["prestart"][1]
        entry["args"] = [native_client, "--socket", sock, "--root", str(fake_machine.root), "--debug", str(log),
                         "prestart"]
        entry["path"] = entry["args"][0]

    bundle = rt.make_bundle(tmp_path, fake_machine, ["NVIDIA_VISIBLE_DEVICES=0"], 'echo "DONE:ok"\n',
                            extra_spec=served_hook)
    state_dir = tmp_path / "state"
    run = ["runc", "--root", str(state_dir), "run", "--bundle", str(bundle), bundle.name]
    delete = ["runc", "--root", str(state_dir), "delete", "-f", bundle.name]
    out = in_world(fake_machine, tmp_path, [{"argv": run, "pause": 0.5}, {"argv": delete}] * 2, sock)
    assert all(step["rc"] == 0 for step in out["steps"]), out["steps"]
    assert rt.parse_facts(out["steps"][2]["stdout"])["DONE"] == ["ok"]
    assert log.read_text().count("mount worker: handed to the standby worker, pid ") == 2
    assert "nvcontainer.serve.server" in out["imports_before_ready"]   # the flag reached the server
    late = [line for line in out["server_stderr"].splitlines() if line.startswith("import time:")]
    assert late == []


def test_without_spares_each_request_gets_a_fresh_child(fake_machine, tmp_path, bundle, pid):
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=0"])
    sock = str(tmp_path / "srv" / "hook.sock")
    log = tmp_path / "hook.log"
    out = in_world(fake_machine, tmp_path, [
        {"argv": client(sock, "--root", str(fake_machine.root), "--debug", str(log), "--dry-run", "prestart"),
         "stdin": state(pid, bundle)}], sock, serve_args=("--no-spare",))
    step, = out["steps"]
    assert step["rc"] == 0 and step["spares"] == [] and out["spares"] == []
    assert SERVED in log.read_text()


# Raw protocol cases, against a server in the test's own namespace.

def start_server(machine, sock: Path, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-I", "-m", "nvcontainer", "--root", str(machine.root),
                             "--debug", str(log), "serve", "--socket", str(sock)],
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stderr.readline()
    assert "listening on" in line, line + proc.stderr.read()
    return proc


def requests_of(pid: int) -> list[str]:
    """The server's children serving a request (not the spare waiting for one)."""
    return subprocess.run(["pgrep", "-P", str(pid), "-x", "nvc-request"], capture_output=True, text=True).stdout.split()


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture
def server(fake_machine, tmp_path):
    sock = tmp_path / "srv" / "hook.sock"
    proc = start_server(fake_machine, sock, tmp_path / "serve.log")
    yield proc, sock
    stop_server(proc)


def _request(sock: Path, payload, fds=(0, 1, 2), uid: int | None = None) -> bytes:
    """Send one raw request from a forked child (as ``uid`` if given); return the reply.
    ``payload``: the bytes, or a function of the sending child's PID that makes them."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(r)
            if uid is not None:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(str(sock))
            cwd = os.open("/", os.O_PATH)
            data = payload(os.getpid()) if callable(payload) else payload
            s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   b"".join(fd.to_bytes(4, sys.byteorder) for fd in (*fds, cwd)))])
            s.settimeout(30)
            os.write(w, s.recv(4096) or b"<closed>")
        except OSError as exc:
            os.write(w, f"<{exc.strerror}>".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        reply = fh.read()
    os.waitpid(child, 0)
    return reply


def test_garbage_is_declined_and_the_server_goes_on(server, tmp_path):
    proc, sock = server
    assert _request(sock, b"hello").startswith(b"declined bad request")
    assert _request(sock, b"NVC1 1 18 2 0\nonly-one\0").startswith(b"declined ")
    assert _request(sock, b"NVC1 %d 18 0 0\n" % os.getpid(), fds=(0, 1)).startswith(b"declined bad request")
    # still serving: a well-formed request from a process that lies about its PID
    assert _request(sock, b"NVC1 1 18 1 0\nprestart\0") == b"declined client in another PID namespace"
    assert proc.poll() is None


def test_a_non_root_client_is_declined(fake_machine):
    base = Path(tempfile.mkdtemp(prefix="nvc-serve-"))   # a place uid 65534 can reach
    base.chmod(0o755)
    sock = base / "srv" / "hook.sock"
    proc = start_server(fake_machine, sock, base / "serve.log")
    try:
        assert _request(sock, b"NVC1 1 18 1 0\nprestart\0", uid=65534) == b"<Permission denied>"   # 0700 dir, 0600 socket
        os.chmod(sock.parent, 0o755)
        assert _request(sock, b"NVC1 1 18 1 0\nprestart\0", uid=65534) == b"<Permission denied>"   # 0600 socket
        os.chmod(sock, 0o666)
        reply = _request(sock, b"NVC1 1 18 1 0\nprestart\0", uid=65534)
        assert reply == b"declined client uid 65534 is not root"
        assert proc.poll() is None
    finally:
        stop_server(proc)
        shutil.rmtree(base, ignore_errors=True)


def test_a_request_dies_with_its_client(server, tmp_path, any_client):
    """Runtimes kill only the hook on their timeout: the request it started must not live on."""
    proc, sock = server
    r, w = os.pipe()   # the state never ends: the request waits for it
    # (--debug: the native client itself reads the state of a plain run, to answer a container
    # that asks for no GPU without the server; a traced run goes to the server at once)
    client_proc = subprocess.Popen(any_client(str(sock), "--debug", str(tmp_path / "hook.log"), "prestart"),
                                   stdin=r, stderr=subprocess.PIPE)
    os.close(r)
    try:
        children = []
        for _ in range(200):
            children = requests_of(proc.pid)
            if children:
                break
            time.sleep(0.02)
        assert children, "the request never started"
        client_proc.kill()
        client_proc.wait()
        for _ in range(200):
            if not requests_of(proc.pid):
                break
            time.sleep(0.02)
        else:
            pytest.fail("the request outlived its client")
        assert "went away: killing it" in (tmp_path / "serve.log").read_text()
    finally:
        os.close(w)
    assert proc.poll() is None


def test_spares_that_keep_dying_give_way_to_forking_per_request(server, tmp_path):
    proc, sock = server
    for _ in range(3):
        for _ in range(200):
            spare = subprocess.run(["pgrep", "-P", str(proc.pid), "-x", "nvc-spare"], capture_output=True,
                                   text=True).stdout.split()
            if spare:
                break
            time.sleep(0.01)
        assert spare, "no spare"
        os.kill(int(spare[0]), signal.SIGKILL)
        while os.path.exists(f"/proc/{spare[0]}/stat") and "Z" not in open(f"/proc/{spare[0]}/stat").read().split()[2:3]:
            time.sleep(0.01)
    for _ in range(200):
        if "forking per request from now on" in (tmp_path / "serve.log").read_text():
            break
        time.sleep(0.01)
    else:
        pytest.fail("the server kept forking spares")
    # said on stderr too (the service's journal), not only in the --debug trace
    assert select.select([proc.stderr], [], [], 10)[0], "nothing on the server's stderr"
    assert proc.stderr.readline() == ("nvcontainer serve: warning: 3 spare children in a row died without a "
                                      "request: forking per request from now on\n")
    time.sleep(0.1)
    assert requests_of(proc.pid) == [] and not subprocess.run(["pgrep", "-P", str(proc.pid), "-x", "nvc-spare"],
                                                              capture_output=True).stdout
    # still serving, now from a child forked for the connection
    assert _request(sock, b"NVC1 1 18 1 0\nprestart\0") == b"declined client in another PID namespace"
    assert proc.poll() is None


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def test_the_ldconfig_sandboxes_share_the_servers_empty_namespaces(server, tmp_path):
    """The server makes one set of empty network, IPC and UTS namespaces and holds it; the
    standby worker (the next ldconfig sandbox) is in it, not in the server's own nor in one of
    its own (docs/security.md, "The ldconfig sandbox's namespaces")."""
    proc, _sock = server
    kinds = ("net", "ipc", "uts")
    held = {}
    for fd in os.listdir(f"/proc/{proc.pid}/fd"):
        try:
            link = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
        except OSError:
            continue
        if link.split(":", 1)[0] in kinds:
            held[link.split(":", 1)[0]] = link
    own = {kind: os.readlink(f"/proc/{proc.pid}/ns/{kind}") for kind in kinds}
    assert sorted(held) == sorted(kinds)
    assert all(held[kind] != own[kind] for kind in kinds)
    end = time.monotonic() + 10
    standbys: list[int] = []
    while time.monotonic() < end and not standbys:   # the spare forks its standby when idle
        standbys = [c for spare in _children(proc.pid) for c in _children(spare)]
        time.sleep(0.05)
    assert standbys, "no standby worker appeared"
    assert {kind: os.readlink(f"/proc/{standbys[0]}/ns/{kind}") for kind in kinds} == held


def test_a_second_server_on_the_same_socket_is_refused(server, fake_machine):
    _proc, sock = server
    res = subprocess.run([sys.executable, "-I", "-m", "nvcontainer", "--root", str(fake_machine.root), "serve",
                          "--socket", str(sock)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 1
    assert res.stderr == f"nvcontainer: input error: another nvcontainer serve is listening on {sock}\n"


@pytest.mark.parametrize("case", ["not-absolute", "group-writable-dir", "not-a-socket"])
def test_bad_socket_places_are_one_line(fake_machine, tmp_path, case):
    path = tmp_path / "d" / "hook.sock"
    path.parent.mkdir()
    if case == "group-writable-dir":
        path.parent.chmod(0o777)
    if case == "not-a-socket":
        path.write_text("")
    arg = "relative.sock" if case == "not-absolute" else str(path)
    res = subprocess.run([sys.executable, "-I", "-m", "nvcontainer", "--root", str(fake_machine.root), "serve",
                          "--socket", arg], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("nvcontainer: input error: ") and "Traceback" not in res.stderr
    if case == "not-a-socket":
        assert path.read_text() == ""


def test_a_stale_socket_is_replaced(fake_machine, tmp_path):
    sock = tmp_path / "srv" / "hook.sock"
    sock.parent.mkdir(mode=0o700)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(str(sock))
    dead.close()   # the file stays, nobody listens
    out = in_world(fake_machine, tmp_path, [], str(sock))
    assert out["ready"].startswith("nvcontainer serve: listening on"), out
    assert out["server_rc"] == 0


def test_the_client_imports_no_module_but_builtins(fake_machine, tmp_path, bundle, pid):
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=0"])
    sock = str(tmp_path / "srv" / "hook.sock")
    argv = [sys.executable, "-X", "importtime", *client(sock, "--root", str(fake_machine.root), "--dry-run",
                                                        "prestart")[1:]]
    out = in_world(fake_machine, tmp_path, [{"argv": argv, "stdin": state(pid, bundle)}], sock)
    step, = out["steps"]
    assert step["rc"] == 0 and json.loads(step["stdout"])["gpu"] is True
    imported = {line.split("|")[-1].strip() for line in step["stderr"].splitlines() if line.startswith("import time:")}
    assert "_socket" in imported
    assert not imported & {"json", "re", "socket", "nvcontainer", "site", "typing"}, sorted(imported)


# The product's main job, through real runtimes, served.

@pytest.mark.parametrize("runtime", ["runc", "crun"])
def test_runtime_starts_a_gpu_container_through_the_server(fake_machine, tmp_path, runtime, any_client):
    sock = str(tmp_path / "srv" / "hook.sock")
    log = tmp_path / "hook.log"
    script = ('echo "OPEN0:$(cat /dev/nvidia0 2>&1 | head -1)"\n'
              'echo "NV1:$(ls /dev/nvidia1 2>&1)"\n'
              'echo "LIBS:$(ldconfig -p | grep -c -e libcuda.so.1 -e libnvidia-ml.so.1)"\necho "DONE:ok"\n')

    def served_hook(spec):
        entry = spec["hooks"]["prestart"][1]
        entry["args"] = any_client(sock, "--root", str(fake_machine.root), "--debug", str(log), "prestart")
        entry["path"] = entry["args"][0]

    bundle = rt.make_bundle(tmp_path, fake_machine, ["NVIDIA_VISIBLE_DEVICES=0",
                                                     "NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
                            script, extra_spec=served_hook)
    state_dir = tmp_path / f"state-{runtime}"
    run = [runtime, "--root", str(state_dir), "run", "--bundle", str(bundle), bundle.name]
    if runtime != "runc":
        run = ["sh", "-c", rt.V1_ONLY_WORLD, "sh", *run]
    delete = [runtime, "--root", str(state_dir), "delete", "-f", bundle.name]
    # the pause: time for the idle server's spare to fork and warm its standby worker
    script_steps = [{"argv": run, "pause": 0.5}, {"argv": delete}]
    out = in_world(fake_machine, tmp_path, script_steps, sock)
    res = out["steps"][0]
    assert res["rc"] == 0, res["stderr"]
    facts = rt.parse_facts(res["stdout"])
    assert facts["OPEN0"] == ["cat: can't open '/dev/nvidia0': No such device or address"]   # cgroup allows it
    assert "No such file" in facts["NV1"][0]
    assert facts["LIBS"] == ["2"] and facts["DONE"] == ["ok"]
    text = log.read_text()
    assert SERVED in text and "mount worker: handed to the standby worker, pid " in text
    assert out["requests"] == [] and out["server_rc"] == 0


def test_podman_runs_the_client_that_setup_registers(fake_machine, tmp_path, native_client):
    """hooks.d as ``nvcontainer setup podman`` writes it, the server started beside podman."""
    from nvcontainer.setup import engines as setup, install

    sock = str(tmp_path / "srv" / "hook.sock")
    log = tmp_path / "hook.log"
    work = tmp_path / "podman"
    hooks = work / "hooks"
    hooks.mkdir(parents=True)
    driver_hook, _ = rt.hook_entries(fake_machine)
    (hooks / "00-proc-driver.json").write_text(json.dumps(
        {"version": "1.0.0", "hook": driver_hook, "when": {"always": True}, "stages": ["prestart"]}))
    inst = install.Install(bin_dir=os.path.dirname(native_client), python=sys.executable, client_module=CLIENT,
                           client_ready=True)
    entry = json.loads(setup.hooks_json(install.hook_entry(inst, served=True, deadline=30)))
    assert entry["hook"]["args"] == [native_client, "prestart"] and entry["hook"]["path"] == native_client
    entry["hook"]["args"][-1:] = ["--socket", sock, "--root", str(fake_machine.root), "--debug", str(log), "prestart"]
    (hooks / "01-nvcontainer.json").write_text(json.dumps(entry))
    (work / "containers.conf").write_text(rt.PODMAN_CONF)
    rootfs = rt.busybox_rootfs(work / "rootfs")
    runroot = Path(tempfile.mkdtemp(prefix="nvc-pd-"))
    script = 'echo "OPEN0:$(cat /dev/nvidia0 2>&1 | head -1)"; echo "DONE:ok"'
    argv = ["sh", "-c", rt.V1_ONLY_WORLD, "sh", "podman", "--root", str(work / "storage"), "--runroot", str(runroot),
            "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs", "--hooks-dir", str(hooks), "run", "--rm",
            "--network", "none", "--env=NVIDIA_VISIBLE_DEVICES=0", "--rootfs", str(rootfs), "/bin/sh", "-c", script]
    try:
        out = in_world(fake_machine, tmp_path, [{"argv": argv, "env": {"CONTAINERS_CONF": str(work / "containers.conf")}}],
                       sock)
    finally:
        shutil.rmtree(runroot, ignore_errors=True)
    res, = out["steps"]
    assert res["rc"] == 0, res["stderr"]
    assert rt.parse_facts(res["stdout"])["OPEN0"] == ["cat: can't open '/dev/nvidia0': No such device or address"]
    assert SERVED in log.read_text()


def test_a_hook_during_the_warm_up_waits_for_a_warm_answer(fake_machine_factory, tmp_path, bundle, pid):
    """A node booting: NVML is slow, the server is still building the inventory. The socket is
    already there, so the hook queues for the server instead of running cold."""
    from tests.fixtures.fakegpu import FakeSpec

    machine = fake_machine_factory(FakeSpec(gpus=2, init_delay_ms=1500))
    write_config(bundle, ["NVIDIA_VISIBLE_DEVICES=0"])
    sock = str(tmp_path / "srv" / "hook.sock")
    log = tmp_path / "hook.log"
    driver = textwrap.dedent(r"""
        import os, subprocess, sys, time
        sock, root, debug, log, state = sys.argv[1:6]
        server = subprocess.Popen([sys.executable, "-I", "-m", "nvcontainer", "--root", root, "--debug", debug,
                                   "serve", "--socket", sock], stderr=subprocess.PIPE, text=True)
        while not os.path.exists(sock):
            time.sleep(0.005)
        started = time.monotonic()
        hook = subprocess.run([sys.executable, "-I", "-S", sys.argv[6], "--socket", sock, "--root", root,
                               "--debug", log, "--dry-run", "prestart"], input=state, capture_output=True, text=True)
        took = time.monotonic() - started
        ready = server.stderr.readline()
        server.terminate()
        server.wait()
        print(hook.returncode, ready.strip(), hook.stderr.strip(), took, sep="|")
    """)
    res = subprocess.run(fake_proc_command(machine, [sys.executable, "-I", "-c", driver, sock, str(machine.root),
                                                     str(tmp_path / "serve.log"), str(log), state(pid, bundle),
                                                     CLIENT]),
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    rc, ready, err, took = res.stdout.strip().split("|")
    assert rc == "0", (err, res.stderr)
    assert float(took) > 1.0   # it waited for NVML's 1.5 s through the server's warm-up
    assert ready.startswith("nvcontainer serve: listening on")
    assert SERVED in log.read_text()


HOOK_PATH_PATTERNS = ("config/values.py", "request/decide.py", "request/require.py", "request/selection.py",
                      "plan/build.py", "plan/container.py", "cgroups/locate.py", "plan/volume.py")


def test_the_server_compiles_the_hook_paths_patterns_before_it_forks():
    """The hook path keeps its patterns as strings, compiled by re on first use; the server
    compiles them all before it forks, so no request child does. Every pattern a module matches
    with is in its PATTERNS, and after preload() none of them is compiled again."""
    from importlib import import_module

    import re._compiler as compiler

    from nvcontainer.serve import server

    modules = []
    for path in HOOK_PATH_PATTERNS:
        module = import_module("nvcontainer." + path[:-3].replace("/", "."))
        used = set(re.findall(r"re\.(?:fullmatch|match|search|sub)\((_[A-Z_]+)", (REPO / "nvcontainer" / path).read_text()))
        assert used and used <= {name for name in dir(module) if getattr(module, name) in module.PATTERNS}, path
        modules.append(module)
    re.purge()
    server.preload()
    compiled = []
    original, compiler.compile = compiler.compile, lambda pattern, *rest: compiled.append(pattern) or original(pattern, *rest)
    try:
        for module in modules:
            for pattern in module.PATTERNS:
                re.fullmatch(pattern, "0")
    finally:
        compiler.compile = original
    assert compiled == []


def test_the_request_format_round_trips_and_rejects_what_is_not_it():
    from nvcontainer.hook import client as hc

    argv = ["--root", "/r w", "--debug", "/tmp/é.log", "prestart"]
    data = hc.encode_request(argv, ["PATH=/bin:/usr/bin", "CUDA_MPS_PIPE_DIRECTORY=/tmp/mps"], 0o027)
    assert hc.decode_request(data) == (os.getpid(), 0o027, argv,
                                       {"PATH": "/bin:/usr/bin", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps"})
    for bad in (b"NVC1 1 18 1 0\nprestart", b"NVC1 1 1000 1 0\nprestart\0", b"NVC1 1 18 1 0 9\nprestart\0",
                b"NVC2 1 18 1 0\nprestart\0", b"NVC1 \xd9\xa1 18 1 0\nprestart\0", b"NVC1 1 18 0 1\nLD_PRELOAD=/x\0",
                b"NVC1 1 18 2 0\nprestart\0", b"NVC1 1 18 1 0 prestart\0"):
        with pytest.raises(ValueError):
            hc.decode_request(bad)
    assert hc.socket_path(["--root", "/r", "--socket", "/s", "prestart"]) == "/s"
    assert hc.socket_path(["--socket=", "prestart"]) == ""
    assert hc.socket_path(["prestart", "--socket", "/late"]) == hc.SOCKET   # options come before the stage


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512) | st.builds(lambda h, b: h + b, st.sampled_from([b"NVC1 ", b"NVC1 1 18 ", b"NVC1 1 18 1 0\n"]),
                                           st.binary(max_size=256)))
def test_any_request_bytes_decode_or_raise_value_error(data):
    """The server decodes whatever a client sent: anything but a ValueError would be a crash."""
    from nvcontainer.hook import client as hc

    try:
        pid, umask, argv, env = hc.decode_request(data)
    except ValueError:
        return
    assert 0 <= umask <= 0o777 and set(env) <= set(hc.ENV) and all(isinstance(a, str) for a in argv)


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.is_symlink(), p.lstat().st_ino, p.lstat().st_size)
            for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("link", ["absolute", "dotdot"])
def test_a_hostile_image_gets_nothing_out_of_the_server(fake_machine, tmp_path, link, any_client):
    """The library directory and /etc/ld.so.conf.d of the image are links to a host directory:
    the served run resolves them inside the rootfs, as the in-process one does, and the host
    directory stays as it was."""
    sentinel = tmp_path / "host-sentinel"
    (sentinel / "lib").mkdir(parents=True)
    (sentinel / "lib" / "victim.so").write_text("host file\n")
    before = _tree(sentinel)
    sock = str(tmp_path / "srv" / "hook.sock")
    log = tmp_path / "hook.log"
    script = ('echo "OPEN0:$(cat /dev/nvidia0 2>&1 | head -1)"\n'
              'echo "LIBS:$(ldconfig -p | grep -c libcuda.so.1)"\necho "DONE:ok"\n')

    def hostile(spec):
        entry = spec["hooks"]["prestart"][1]
        entry["args"] = any_client(sock, "--root", str(fake_machine.root), "--debug", str(log), "prestart")
        entry["path"] = entry["args"][0]

    bundle = rt.make_bundle(tmp_path, fake_machine, ["NVIDIA_VISIBLE_DEVICES=0"], script, extra_spec=hostile)
    rootfs = bundle / "rootfs"
    libdir = rootfs / "usr/lib/x86_64-linux-gnu"
    shutil.rmtree(libdir)
    target = str(sentinel / "lib") if link == "absolute" else "../../.." + "/.." * len(rootfs.parts) + str(sentinel / "lib")
    os.symlink(target, libdir)
    state_dir = tmp_path / "state-runc"
    out = in_world(fake_machine, tmp_path, [
        {"argv": ["runc", "--root", str(state_dir), "run", "--bundle", str(bundle), bundle.name]},
        {"argv": ["runc", "--root", str(state_dir), "delete", "-f", bundle.name]},
    ], sock)
    res = out["steps"][0]
    assert _tree(sentinel) == before, "the host directory changed"
    assert SERVED in log.read_text()
    if res["rc"] == 0:
        facts = rt.parse_facts(res["stdout"])
        assert facts["OPEN0"] == ["cat: can't open '/dev/nvidia0': No such device or address"]
        assert facts["DONE"] == ["ok"]
    else:   # refused: one line from our hook in runc's error
        assert "nvcontainer-hook: " in res["stderr"], res["stderr"]


def test_the_next_spare_comes_at_once_only_when_a_hook_follows():
    """After a served runtime create, the spare for its hook is forked without the idle delay
    that otherwise leaves the CPUs to the container being started (serve/server.py)."""
    from nvcontainer.serve import server as srv

    assert srv.spare_wait(10.0, 10.0, False) == pytest.approx(srv.SPARE_DELAY)
    assert srv.spare_wait(10.0, 10.0 + srv.SPARE_DELAY, False) <= 0
    assert srv.spare_wait(10.0, 10.0, True) <= 0
    assert srv.spare_wait(10.0, 9.9, True) > 0   # still from the moment the server went idle
