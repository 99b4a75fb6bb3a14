"""From ``nvcontainer metrics``'s options to a running endpoint.

Each scrape reads the machine once: one NVML round from the sampler (:mod:`.sampling`), ``ps``'s
scan for the containers (:mod:`.attribution`), the kubelet's PodResources when there is one
(:mod:`.pods`), and :mod:`.families` turns those into the series. Every source may fail on its
own (a GPU hung, no kubelet, a scan that hit a vanished process); the scrape then goes out with
what the others gave and ``nvcontainer_source_up``/``nvcontainer_gpu_up`` say what is missing.
A failure is one line on stderr when it starts and one when it ends, never a traceback.

The inventory is the one every command reads (``inventory/cache.py``), re-read every
``INVENTORY_PERIOD`` seconds so a driver upgrade or a MIG change shows without a restart.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from ..errors import NvcError, escape

DEFAULT_LISTEN = ":9400"
INVENTORY_PERIOD = 60.0


def say(line: str) -> None:
    try:
        sys.stderr.write(f"nvcontainer: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def parse_listen(value: str) -> tuple[int, str, int]:
    """``ADDR:PORT`` → (address family, host, port); ``:PORT`` is every address, v4 and v6."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise NvcError("input", f"--listen {escape(value)}: expected ADDR:PORT, e.g. :9400 or 127.0.0.1:9400")
    port = int(port_text)
    if host.startswith("[") and host.endswith("]"):
        return socket.AF_INET6, host[1:-1], port
    if host == "":
        return socket.AF_INET6, "::", port
    if ":" in host:
        raise NvcError("input", f"--listen {escape(value)}: write an IPv6 address in brackets, [::1]:9400")
    return socket.AF_INET, host, port


class Exporter:
    """The scrape: ``families()`` reads the machine once and returns the metric families."""

    def __init__(self, config, inventory, counters, *, sampler, kubelet, hostname: str, proc: str = "/proc",
                 roots=None, reload_inventory=None, clock=time.monotonic):
        self.config, self.inventory, self.counters = config, inventory, counters
        self.sampler, self.kubelet, self.hostname = sampler, kubelet, hostname
        self.proc, self.roots = proc, roots
        self.reload_inventory = reload_inventory
        self.clock = clock
        self.inventory_at = clock()
        self.scan_state = "ok"

    def _fresh_inventory(self):
        if self.reload_inventory is None or self.clock() - self.inventory_at < INVENTORY_PERIOD:
            return
        self.inventory_at = self.clock()
        try:
            inv = self.reload_inventory()
        except NvcError as exc:
            say(f"metrics: the inventory could not be re-read ({exc.detail}); the last one is kept")
            return
        if [g.uuid for g in inv.gpus] != [g.uuid for g in self.inventory.gpus]:
            say(f"metrics: the GPUs changed ({len(inv.gpus)} now); the NVML sampler starts again")
            self.sampler.stop()
            self.sampler.gpus = [g.uuid for g in inv.gpus]
        self.inventory = inv

    def families(self):
        from . import attribution, families

        self._fresh_inventory()
        entries = self.sampler.round()
        view = None
        try:
            view = attribution.view(self.inventory, entries, self.config, proc=self.proc, roots=self.roots)
            if self.scan_state != "ok":
                say("metrics: the container scan works again")
            self.scan_state = "ok"
        except Exception as exc:   # one line per change, never a traceback
            state = f"{type(exc).__name__}: {exc}"
            if state != self.scan_state:
                say(f"metrics: the container scan failed ({escape(state, 200)}): no per-container series")
            self.scan_state = state
        holders = self.kubelet.holders(self.inventory) if self.kubelet is not None else None
        sources = {"nvml": bool(entries), "containers": view is not None}
        if self.kubelet is not None:
            sources["podresources"] = holders is not None
        return families.build(self.inventory, self.counters, entries, view, holders, self.hostname, sources)


def run(config, *, listen: str, counters_file: str | None, web_config_file: str | None, pod_resources: str,
        kubernetes: str, hostname: str | None, nvml_timeout: float, pod_timeout: float) -> None:
    from ..inventory.cache import cached_inventory
    from ..inventory.identity import parse_user
    from ..ps.gather import nvml_library
    from . import counters as counter_file
    from . import pods, sampling, server, webconfig

    family, host, port = parse_listen(listen)
    chosen, missing = counter_file.load(counters_file)
    if missing:
        say(f"metrics: not exported, NVML cannot give them: {', '.join(missing)}")
    web = webconfig.load(web_config_file) if web_config_file else webconfig.WebConfig()
    context = webconfig.ssl_context(web) if web.tls else None
    users = webconfig.Users(web.users) if web.users else None
    inv = cached_inventory(config)
    library = nvml_library(inv)
    sampler = sampling.Sampler(library, parse_user(config.user), [g.uuid for g in inv.gpus], say,
                               deadline=nvml_timeout)
    use_kubelet = kubernetes == "on" or (kubernetes == "auto" and os.path.exists(pod_resources))
    kubelet = pods.Kubelet(pod_resources, say, pod_timeout) if use_kubelet else None
    name = hostname or os.environ.get("NODE_NAME") or socket.gethostname()
    exporter = Exporter(config, inv, chosen, sampler=sampler, kubelet=kubelet, hostname=name,
                        reload_inventory=lambda: cached_inventory(config))
    try:
        httpd = server.Server((host, port), exporter.families, say, users=users, context=context, family=family)
    except OSError as exc:
        raise NvcError("input", f"--listen {escape(listen)}: {escape(exc.strerror or exc)}") from None
    stop = threading.Event()

    def _term(*_):
        stop.set()
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    scheme = "https" if context else "http"
    say(f"metrics: serving {scheme}://{listen}/metrics ({len(inv.gpus)} GPUs, {len(chosen)} counters)")
    try:
        httpd.serve_forever(poll_interval=0.5)
    finally:
        httpd.server_close()
        sampler.stop()
        if kubelet is not None:
            kubelet.close()
