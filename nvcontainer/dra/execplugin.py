"""A kubeconfig's exec credential plugin (``users[].user.exec``: ``aws eks get-token``,
``gke-gcloud-auth-plugin``, ``kubelogin``), run the way kubectl runs it, but bounded.

Why not lightkube's own: it waits for the plugin for ever and reads all it writes, so one plugin
that hangs (a browser login nobody will finish, a metadata server that does not answer) held
the DRA driver's publisher and every prepare that needed a token past any deadline, and one
that failed (exit status 1, no JSON, no token) escaped as an exception of lightkube's or of the
JSON parser instead of a line. Here the plugin is given what is left of the call's deadline (and
:data:`TIMEOUT` at most), its output is read to :data:`MAX_OUTPUT` bytes and no further, it is
killed with everything it started when either runs out, and every failure is one
:class:`NvcError` line naming the plugin.

What kubectl does and this does too: the plugin inherits this process's environment plus the
``env`` the kubeconfig gives, is told ``KUBERNETES_EXEC_INFO`` (non-interactive: it gets no
terminal and an empty stdin), a command written as a relative path with a slash is taken from
the kubeconfig's directory, the token is kept until the API server answers 401 or the plugin's
``expirationTimestamp`` passes. The kubeconfig is the operator's (it names a program to run),
so the plugin is trusted as kubectl trusts it; what is bounded is how long and how much.
"""

from __future__ import annotations

import datetime
import json
import os
import select
import signal
import subprocess
import threading
import time

from .. import documents
from ..errors import NvcError, escape
from . import deadline as bounded

API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1",
                "client.authentication.k8s.io/v1alpha1")
TIMEOUT = 30.0                 # one run, when the call's deadline leaves more
MAX_OUTPUT = 1 << 20           # an ExecCredential is a token and a date: a few KiB
MAX_ERROR = 4096               # of its standard error, kept for the line
EARLY = 10.0                   # seconds before its expiry a token is asked for again


def command(exec_, kubeconfig_dir: str | None) -> list[str]:
    """The plugin's argv: a relative path with a slash is the kubeconfig's directory's (a bare
    name is looked up in PATH, as kubectl does)."""
    cmd = exec_.command
    if "/" in cmd and not os.path.isabs(cmd) and kubeconfig_dir:
        cmd = os.path.join(kubeconfig_dir, cmd)
    return [cmd, *(exec_.args or [])]


def environment(exec_, base) -> dict[str, str]:
    """``base`` (this process's environment) plus the kubeconfig's ``env`` and what kubectl tells."""
    env = dict(base)
    env.update((v.name, v.value) for v in exec_.env or ())
    env["KUBERNETES_EXEC_INFO"] = json.dumps({"apiVersion": exec_.apiVersion, "kind": "ExecCredential",
                                              "spec": {"interactive": False}})
    return env


def failure(name: str, why: str) -> NvcError:
    return NvcError("kubernetes", f"kubeconfig exec plugin {name}: {why}")


def credential(output: bytes, name: str) -> tuple[str, float | None]:
    """(token, expiry as a time.time() value or None) from the plugin's ``ExecCredential``."""
    doc = documents.json_value(output, f"kubeconfig exec plugin {name}: its output", cap=MAX_OUTPUT,
                               category="kubernetes")
    status = doc.get("status") if isinstance(doc, dict) else None
    token = status.get("token") if isinstance(status, dict) else None
    if not isinstance(token, str) or not token or any(c in token for c in "\r\n"):
        why = ("a client certificate, not a token (not supported)" if isinstance(status, dict)
               and status.get("clientCertificateData") else "no status.token")
        raise failure(name, f"its ExecCredential has {why}")
    expiry = status.get("expirationTimestamp")
    if expiry is None:
        return token, None
    try:
        when = datetime.datetime.fromisoformat(str(expiry).replace("Z", "+00:00"))
        if when.tzinfo is None:
            raise ValueError
    except ValueError:
        raise failure(name, f"status.expirationTimestamp {escape(expiry, 60)} is not an RFC 3339 time") from None
    return token, when.timestamp()


def run(argv: list[str], env: dict[str, str], seconds: float, name: str, late: str) -> bytes:
    """The plugin's standard output, once it has exited 0 within ``seconds``; else one line
    (``late``: what it says when the time runs out)."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, close_fds=True, start_new_session=True)
    except OSError as exc:
        raise failure(name, escape(exc.strerror or exc)) from None
    end = time.monotonic() + seconds
    out, err, why = bytearray(), bytearray(), None
    try:
        open_fds = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        poller = select.poll()
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        while open_fds and why is None:
            left = end - time.monotonic()
            if left <= 0:
                why = late
                break
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    poller.unregister(fd)
                    del open_fds[fd]
                    continue
                kept = open_fds[fd]
                room = (MAX_OUTPUT + 1 if kept is out else MAX_ERROR) - len(kept)
                kept += chunk[:max(room, 0)]
                if len(out) > MAX_OUTPUT:
                    why = f"wrote more than {MAX_OUTPUT} bytes"
                    break
        if why is None:
            try:
                status = proc.wait(max(end - time.monotonic(), 0.001))
            except subprocess.TimeoutExpired:
                why = late
            else:
                if status != 0:
                    said = err.decode("utf-8", "replace").strip().splitlines()
                    why = f"exit status {status}" + (f": {escape(said[0], 200)}" if said else "")
    finally:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)     # the plugin and whatever it started
            except OSError:
                pass
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    if why is not None:
        raise failure(name, why)
    return bytes(out)


class Credentials:
    """The bearer token from the plugin, run within the calling thread's deadline (the one
    :mod:`.deadline` gives every socket operation of the call), kept until refused or expired
    (:func:`.kubeapi.exec_auth` puts it on the HTTP client: only ``kubeapi`` talks HTTP).
    One run at a time: the DRA driver's workers that all need a token at once wait for one run
    (within their own deadlines) instead of each starting the plugin."""

    def __init__(self, exec_, kubeconfig_dir: str | None, environ=None):
        self.exec = exec_
        self.argv = command(exec_, kubeconfig_dir)
        self.name = escape(exec_.command, 120)
        self.environ = os.environ if environ is None else environ
        self.token: str | None = None
        self.expiry: float | None = None
        self.lock = threading.Lock()

    def current(self) -> str | None:
        """The token kept, while it has not expired."""
        token, expiry = self.token, self.expiry
        return token if token is not None and (expiry is None or time.time() < expiry - EARLY) else None

    def fresh(self, refused: str | None) -> str:
        """A token other than ``refused``: one another thread got meanwhile, or the plugin's."""
        if self.exec.apiVersion not in API_VERSIONS:
            raise failure(self.name, f"apiVersion {escape(self.exec.apiVersion, 80)} is not one of {', '.join(API_VERSIONS)}")
        left = bounded.left()
        if not self.lock.acquire(timeout=-1 if left is None else max(left, 0)):
            raise failure(self.name, bounded.LATE)
        try:
            token = self.current()
            if token is not None and token != refused:
                return token
            left = bounded.left()
            if left is not None and left <= 0:
                raise failure(self.name, bounded.LATE)
            seconds, late = TIMEOUT, f"no answer in {TIMEOUT:g} s"
            if left is not None and left < TIMEOUT:      # said as the state, not the seconds that were left
                seconds, late = left, bounded.LATE
            output = run(self.argv, environment(self.exec, self.environ), seconds, self.name, late)
            self.token, self.expiry = credential(output, self.name)
            return self.token
        finally:
            self.lock.release()
