"""``nvcontainer metrics``: a Prometheus endpoint with dcgm-exporter's names, per container."""
