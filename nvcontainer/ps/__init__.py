"""``nvcontainer ps``: which containers use which GPU, found from the kernel, not our records."""
