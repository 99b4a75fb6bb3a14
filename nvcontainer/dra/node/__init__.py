"""The node side of ``nvcontainer dra-driver``: the kubelet's plugin (``agent.py``,
``service.py``) preparing and unpreparing the claims allocated to this node (``prepare.py``:
claims read, devices held, MPS daemons and time-slices, the CDI spec written, the checkpoint
kept). It reads claims from the API server and writes nothing there.
"""
