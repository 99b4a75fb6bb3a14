"""``nvcontainer metrics``: a Prometheus endpoint with dcgm-exporter's names, per container.

Only the options live here; :mod:`nvcontainer.metrics.command` reads the machine and serves.
"""

from __future__ import annotations

import click

from .context import Context


@click.command()
@click.option("--listen", default=":9400", show_default=True, metavar="ADDR:PORT",
              help="Where to serve /metrics (:PORT: every address).")
@click.option("-f", "--collectors", "counters_file", metavar="FILE",
              help="dcgm-exporter's counters CSV: the fields to export. [default: dcgm-exporter's defaults]")
@click.option("--web-config-file", metavar="FILE", help="TLS and basic auth, in the exporter-toolkit's format.")
@click.option("--kubernetes", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Pod labels from the kubelet's PodResources API (auto: when its socket exists).")
@click.option("--pod-resources-socket", default="/var/lib/kubelet/pod-resources/kubelet.sock", show_default=True,
              metavar="PATH", help="The kubelet's PodResources socket.")
@click.option("--hostname", metavar="NAME", help="The Hostname label. [default: $NODE_NAME, else the host name]")
@click.option("--nvml-timeout", type=click.FloatRange(0.1, 60), default=5.0, show_default=True, metavar="SECONDS",
              help="How long a scrape waits for NVML; a GPU that takes longer is stale for that scrape.")
@click.option("--pod-resources-timeout", "pod_timeout", type=click.FloatRange(0.1, 60), default=2.0,
              show_default=True, metavar="SECONDS", help="How long a scrape waits for the kubelet.")
@click.pass_obj
def metrics(obj: Context, listen, counters_file, web_config_file, kubernetes, pod_resources_socket, hostname,
            nvml_timeout, pod_timeout) -> None:
    """Serve GPU metrics for Prometheus, with dcgm-exporter's names and per-container series."""
    from ..metrics import command

    command.run(obj.config, listen=listen, counters_file=counters_file, web_config_file=web_config_file,
                pod_resources=pod_resources_socket, kubernetes=kubernetes, hostname=hostname,
                nvml_timeout=nvml_timeout, pod_timeout=pod_timeout)
