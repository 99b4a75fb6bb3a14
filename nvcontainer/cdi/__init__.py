"""Container Device Interface (CDI) specs for the host's NVIDIA driver.

With CDI the engine (podman, CRI-O, containerd 2.x, Docker 25+) injects device nodes, mounts and
hooks itself from a spec file, so device cgroup rules are part of the container's OCI config
and survive ``systemctl daemon-reload`` (toolkit#48), unlike rules a prestart hook adds.

Modules: :mod:`.spec` (the spec as data, names, the minimum ``cdiVersion`` the content needs),
:mod:`.yamltext` (YAML without a dependency), :mod:`.generate` (inventory + plan builder →
spec), :mod:`.store` (spec files and directories), :mod:`.check` (is a spec stale for the
running driver).
"""
