"""What the kubelet's plugins share: their sockets in the kubelet's directories, made and
removed without trusting what else is there (``sockets``), and a grpc.aio server on one of them
that can be served again when the kubelet wipes it (``endpoint``), and the pause between failed
tries (``backoff``). Used by ``deviceplugin/`` and ``dra/``, which do not import each other.
"""
