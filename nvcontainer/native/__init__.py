"""Native programs in front of the Python code (the hook client) and how they are built for an
installation."""
