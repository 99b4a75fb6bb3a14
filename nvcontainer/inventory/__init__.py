"""The driver and the GPUs of this host, as one :class:`.model.Inventory`: the ld cache, the
driver's libraries and binaries, NVML's answers (in a child process), procfs and device nodes.

One inventory feeds ``info``, ``list``, the hook, ``cdi generate`` and volumes; :mod:`.cache`
keeps it per boot and checks it on every read.
"""
