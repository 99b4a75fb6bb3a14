"""The HTTP side: ``/metrics`` in the format the scraper asks for, whatever the clients do.

The exposition is prometheus_client's: the text format (0.0.4) by default, OpenMetrics when
the ``Accept`` header asks for it (``choose_encoder``, as its own server negotiates). One
adjustment keeps dcgm-exporter's names: DCGM's counters have no ``_total`` suffix, which
prometheus_client's text encoder adds to a counter's ``# TYPE`` line and OpenMetrics requires
of a counter's samples; so in the text format the two comment lines are given the plain name
back (the samples already have it, exactly as dcgm-exporter writes them), and in OpenMetrics
such a family is typed ``unknown`` (same name, same values; ``rate()`` works the same).

Why not prometheus_client's ``start_http_server``: it has no basic authentication and no bound
on connections. Here each connection is a thread with a socket timeout (a client that sends
nothing, or reads nothing, is dropped after ``CLIENT_TIMEOUT``), at most ``MAX_CLIENTS`` run at
once (more are closed at accept), and scrapes are serialised: every scrape runs in one long-lived
worker thread, which also owns the NVML sampler. One thread, not the connection's: the sampler
dies with the thread that started it (its parent-death signal follows the thread), and
connection threads end with their connection.
"""

from __future__ import annotations

import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import choose_encoder

CLIENT_TIMEOUT = 10.0
MAX_CLIENTS = 32
INDEX = (b"<html><head><title>nvcontainer metrics</title></head><body><h1>nvcontainer metrics</h1>"
         b"<p><a href=\"/metrics\">Metrics</a></p></body></html>\n")


class _Families:
    """What prometheus_client's encoders take: an object with ``collect()``."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


def encode(families, accept: str | None) -> tuple[bytes, str]:
    """The body and its Content-Type for an ``Accept`` header."""
    encoder, content_type = choose_encoder(accept or "")
    plain = [f.name for f in families if f.type == "counter" and not f.name.endswith("_total")]
    if content_type.startswith("application/openmetrics-text"):
        for f in families:
            if f.name in plain:
                f.type = "unknown"
        return encoder(_Families(families)), content_type
    body = encoder(_Families(families))
    for name in plain:
        body = body.replace(f"# HELP {name}_total ".encode(), f"# HELP {name} ".encode(), 1)
        body = body.replace(f"# TYPE {name}_total counter\n".encode(), f"# TYPE {name} counter\n".encode(), 1)
    return body, content_type


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address, scrape, say, *, users=None, context=None, family=socket.AF_INET6):
        """``scrape()`` → metric families; ``say(line)``: the log; ``users``: :class:`.webconfig.Users` or None;
        ``context``: an ``ssl.SSLContext`` or None."""
        self.address_family = family
        self.scrape_fn = scrape
        self.say = say
        self.users = users
        self.context = context
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self.jobs: queue.Queue = queue.Queue()
        super().__init__(address, _Handler)
        self._worker = threading.Thread(target=self._work, name="scrape", daemon=True)
        self._worker.start()

    def _work(self):
        while True:
            job = self.jobs.get()
            if job is None:            # server_close: the process may go on (an embedding, a test)
                return
            try:
                job["result"] = self.scrape_fn()
            except Exception as exc:   # the scrape handles its sources' failures; this is a bug's net
                job["error"] = f"{type(exc).__name__}: {exc}"
            job["done"].set()

    def server_close(self):
        super().server_close()
        self.jobs.put(None)
        self._worker.join(5)

    def server_bind(self):
        if self.address_family == socket.AF_INET6:
            try:
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except OSError:
                pass
        super().server_bind()

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            request.settimeout(CLIENT_TIMEOUT)
            if self.context is not None:
                request = self.context.wrap_socket(request, server_side=True)
            super().process_request_thread(request, client_address)
        except (OSError, ValueError):
            self.shutdown_request(request)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):
        pass   # a client that went away, or spoke nonsense: nothing to tell the log

    def families(self):
        """This scrape's families, or None (and one line on stderr) when it failed."""
        job = {"done": threading.Event()}
        self.jobs.put(job)
        job["done"].wait()
        if "error" in job:
            self.say(f"metrics: a scrape failed: {job['error'][:300]}")
            return None
        return job["result"]


class _Handler(BaseHTTPRequestHandler):
    server_version = "nvcontainer-metrics"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):   # noqa: A002 - quiet by default, as every command
        pass

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8", extra=()):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in extra:
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        server: Server = self.server
        if server.users is not None and not server.users.check(self.headers.get("Authorization")):
            self._send(401, b"Unauthorized\n", extra=(("WWW-Authenticate", 'Basic realm="nvcontainer"'),))
            return
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(200, INDEX, "text/html; charset=utf-8")
            return
        if path != "/metrics":
            self._send(404, b"Not Found\n")
            return
        families = server.families()
        if families is None:
            self._send(500, b"the scrape failed: see the exporter's log\n")
            return
        body, content_type = encode(families, self.headers.get("Accept"))
        self._send(200, body, content_type)

    do_HEAD = do_GET
