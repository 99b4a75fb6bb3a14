"""The slice side of ``nvcontainer dra-driver``: this node's devices as ResourceSlices in the API
server (``slices.py`` builds them, ``publish.py`` reconciles, ``keeper.py`` runs it with the GPUs'
health and inventory changes). It writes to the API server and prepares nothing.
"""
