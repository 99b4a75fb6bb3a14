"""Changing a container, and only as a plan says: pinning it, placing mounts from a worker in its
mount namespace, writing its device cgroup, running the host's ldconfig in a sandbox.

Everything that enters another namespace or may block runs in a forked worker under a deadline
(:mod:`.worker`); nothing here decides what to do.
"""
