"""The runtime shim ``nvidia-container-runtime`` (also ``nvcontainer-runtime``): an OCI runtime in
front of runc or crun that, on ``create``, writes a GPU container's needs into its bundle's
``config.json`` and then runs the low-level runtime with the engine's argv unchanged."""
