"""The GPUs' health, below both kubelet plugins: one watcher (a child program that alone holds
NVML), one set of rules (which XIDs count, recovery, a lost GPU, a driver that stops
answering), one monitor that runs the watcher and turns its lines into verdicts. The device
plugin advertises by them and the DRA driver publishes and prepares by them: a GPU cannot be
healthy to one and unhealthy to the other.
"""
