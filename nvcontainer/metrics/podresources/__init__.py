"""The kubelet's PodResources v1 API (see api.proto); the modules beside are generated."""
