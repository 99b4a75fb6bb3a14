"""What a container asks for, from its OCI bundle: state and ``config.json``, the image's
``NVIDIA_*`` variables, volume-mount and label requests, requirements and device tokens.

The image is hostile; everything it controls is parsed here, bounded and strictly typed, into
plain data.
"""
