"""``nvcontainer doctor``: a node's driver, devices and engine set-up, read once and judged by
pure checks."""
