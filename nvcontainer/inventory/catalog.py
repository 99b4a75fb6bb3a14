"""What the driver consists of, by capability: library name prefixes, binaries, IPC paths.

These tables are the contract with images built for nvidia-container-cli (REFERENCE §2); the
selection rules that use them live in :mod:`.libraries`. ``display`` has no libraries of its own:
it brings the graphics set plus the modeset node, as upstream does.
"""

from __future__ import annotations

LIBRARY_PREFIXES: dict[str, tuple[str, ...]] = {
    "utility": (
        "libnvidia-ml.so",
        "libnvidia-cfg.so",
        "libnvidia-nscq.so",
    ),
    "compute": (
        "libcuda.so",
        "libcudadebugger.so",
        "libnvidia-opencl.so",
        "libnvidia-gpucomp.so",
        "libnvidia-ptxjitcompiler.so",
        "libnvidia-fatbinaryloader.so",
        "libnvidia-allocator.so",
        "libnvidia-compiler.so",
        "libnvidia-pkcs11.so",
        "libnvidia-pkcs11-openssl3.so",
        "libnvidia-nvvm.so",
        "libnvidia-tileiras.so",
    ),
    # upstream looks libraries up (and lists them) in this order: utility, compute, ngx, video,
    # graphics (nvc_info.c's lookup_libraries), so the NGX library comes right after compute
    "ngx": ("libnvidia-ngx.so",),
    "video": (
        "libvdpau_nvidia.so",
        "libnvidia-encode.so",
        "libnvidia-opticalflow.so",
        "libnvcuvid.so",
    ),
    "graphics": (
        "libnvidia-eglcore.so",
        "libnvidia-glcore.so",
        "libnvidia-tls.so",
        "libnvidia-glsi.so",
        "libnvidia-fbc.so",
        "libnvidia-ifr.so",
        "libnvidia-rtcore.so",
        "libnvoptix.so",
        # GLVND vendor libraries (the default driver layout)
        "libGLX_nvidia.so",
        "libEGL_nvidia.so",
        "libGLESv2_nvidia.so",
        "libGLESv1_CM_nvidia.so",
        "libnvidia-glvkspirv.so",
        "libnvidia-cbl.so",
    ),
}

# The order in which libraries are listed: the order of the prefix tables above.
ALL_PREFIXES: tuple[tuple[str, str], ...] = tuple(
    (group, prefix) for group, prefixes in LIBRARY_PREFIXES.items() for prefix in prefixes
)

BINARIES: dict[str, tuple[str, ...]] = {
    "utility": ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nv-fabricmanager"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
}

PERSISTENCED_SOCKET = "/var/run/nvidia-persistenced/socket"
FABRICMANAGER_SOCKET = "/var/run/nvidia-fabricmanager/socket"
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# NVML brand enum → the names nvidia-container-cli prints (REFERENCE §1.2). Values past the
# table (DLA, VGameDev, NPU, ...) print as "Unknown", as upstream does.
BRANDS = (
    "Unknown",      # 0
    "Quadro",       # 1
    "Tesla",        # 2
    "NVS",          # 3
    "GRID",         # 4
    "GeForce",      # 5
    "TITAN",        # 6
    "VApps",        # 7
    "VPC",          # 8
    "VCS",          # 9
    "VWS",          # 10
    "CloudGaming",  # 11
    "QuadroRTX",    # 12
    "NvidiaRTX",    # 13
    "Nvidia",       # 14
    "GeForceRTX",   # 15
    "TitanRTX",     # 16
)


def brand_name(value: int) -> str:
    if 0 <= value < len(BRANDS):
        return BRANDS[value]
    return "Unknown"
