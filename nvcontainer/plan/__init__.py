"""Deciding what a container gets: request + inventory + rootfs facts → one :class:`.model.Plan`.

The plan is what ``--dry-run`` prints and all that :mod:`nvcontainer.apply` executes.
"""
