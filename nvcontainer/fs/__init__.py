"""Touching paths safely: in-root resolution (``openat2(RESOLVE_IN_ROOT)`` or a component walk),
fd-based creation, detached mounts, bounded reads of files we did not write, and a file of
our own directory watched with inotify.

The mechanisms every other room uses; none of them decides anything.
"""
