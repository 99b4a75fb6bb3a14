"""NVIDIA's MPS control daemon, as both kubelet plugins start it (``control.py``): it is not
kubelet plumbing, and what each plugin decides about its daemons stays with the plugin
(``deviceplugin/mps.py``, ``dra/mpsclaim.py``).
"""
