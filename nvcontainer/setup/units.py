"""The systemd units of a node: the hook server, socket-activated, and the CDI spec's refresh.

``nvcontainer-serve.socket`` listens on the hook socket from boot, so the served path costs no
daemon until the first GPU container: the first hook to connect starts
``nvcontainer-serve.service`` with the listening socket handed over (``LISTEN_FDS``); its run
waits in the socket's queue meanwhile, and later ones find the server warm. A hook that finds
nothing listening, or a server that declines, still does the work itself.

``nvcontainer-cdi-refresh.service`` writes ``/var/run/cdi/nvidia.yaml`` (a directory cleared at
every boot) for the running driver, as upstream's ``nvidia-cdi-refresh`` does. It runs at boot, when
the nvidia module is loaded (the udev rule: ``/proc/driver/nvidia`` cannot be watched by a path
unit, procfs sends no inotify events), and when the driver's files change, watched by
``nvcontainer-cdi-refresh.path``: ``/lib/modules/<release>/modules.dep`` (rewritten by depmod when
a kernel module, DKMS's nvidia included, is installed) and ``/etc/ld.so.cache`` (rewritten by
ldconfig whenever libraries are installed, the driver's user-space libraries included; the spec
names those libraries, so this is the change that matters to it). A refresh that changes
nothing rewrites the same spec, atomically.

The same text serves the package (programs in ``/usr/bin``, units in ``/usr/lib/systemd/system``)
and an installation from source, where ``setup`` writes them to ``/etc/systemd/system`` naming
that installation's programs.
"""

from __future__ import annotations

from ..inventory.catalog import DEFAULT_PATH

SOCKET = "/run/nvcontainer/hook.sock"
CDI_SPEC = "/var/run/cdi/nvidia.yaml"
SERVE_SOCKET = "nvcontainer-serve.socket"
SERVE_SERVICE = "nvcontainer-serve.service"
REFRESH_SERVICE = "nvcontainer-cdi-refresh.service"
REFRESH_PATH = "nvcontainer-cdi-refresh.path"
METRICS_SERVICE = "nvcontainer-metrics.service"
PACKAGE_DIR = "/usr/lib/systemd/system"
LOCAL_DIR = "/etc/systemd/system"
UDEV_RULE = "71-nvcontainer-cdi-refresh.rules"
ENGINES = "docker.service containerd.service crio.service"


def serve_socket() -> str:
    return (
        "[Unit]\n"
        "Description=nvcontainer: the hook server's socket (the server starts with the first GPU container)\n"
        "Documentation=man:nvcontainer-serve(1)\n"
        f"Before={ENGINES}\n"
        "\n"
        "[Socket]\n"
        f"ListenSequentialPacket={SOCKET}\n"
        "SocketUser=root\n"
        "SocketGroup=root\n"
        "SocketMode=0600\n"
        "DirectoryMode=0700\n"
        "RemoveOnStop=yes\n"
        "\n"
        "[Install]\n"
        "WantedBy=sockets.target\n"
    )


def serve_service(cli: str) -> str:
    return (
        "[Unit]\n"
        "Description=nvcontainer: container GPU hooks, run warm\n"
        "Documentation=man:nvcontainer-serve(1)\n"
        f"Requires={SERVE_SOCKET}\n"
        f"After={SERVE_SOCKET}\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"Environment=PATH={DEFAULT_PATH}\n"
        f"ExecStart={cli} serve --socket {SOCKET}\n"
        "Restart=on-failure\n"
        "\n"
        "[Install]\n"
        f"Also={SERVE_SOCKET}\n"
    )


def refresh_service(cli: str) -> str:
    return (
        "[Unit]\n"
        "Description=nvcontainer: write the CDI spec of the running NVIDIA driver\n"
        "Documentation=man:nvcontainer-cdi(1)\n"
        "ConditionPathExists=/proc/driver/nvidia/version\n"
        f"Before={ENGINES}\n"
        "\n"
        "[Service]\n"
        "Type=oneshot\n"
        f"Environment=PATH={DEFAULT_PATH}\n"
        f"ExecStart={cli} cdi generate --output {CDI_SPEC}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def refresh_path() -> str:
    return (
        "[Unit]\n"
        "Description=nvcontainer: refresh the CDI spec when the NVIDIA driver changes\n"
        "Documentation=man:nvcontainer-cdi(1)\n"
        "\n"
        "[Path]\n"
        "PathChanged=/lib/modules/%v/modules.dep\n"
        "PathChanged=/etc/ld.so.cache\n"
        f"Unit={REFRESH_SERVICE}\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def metrics_service(cli: str) -> str:
    """``nvcontainer metrics`` on a node without Kubernetes (the package installs it disabled:
    ``systemctl enable --now nvcontainer-metrics``). Root, for the ps scan of every container;
    NVML still runs only in the exporter's unprivileged child."""
    return (
        "[Unit]\n"
        "Description=nvcontainer: GPU metrics for Prometheus, dcgm-exporter's names, per container\n"
        "Documentation=man:nvcontainer-metrics(1)\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"Environment=PATH={DEFAULT_PATH}\n"
        f"ExecStart={cli} metrics --listen :9400\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "NoNewPrivileges=yes\n"
        "ProtectSystem=full\n"
        "ProtectHome=read-only\n"
        "PrivateTmp=yes\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def package_units(cli: str) -> dict[str, str]:
    """What the .deb installs: every unit ``setup`` writes, and the metrics exporter's, which no
    engine needs and ``setup`` therefore leaves out."""
    return {**all_units(cli), METRICS_SERVICE: metrics_service(cli)}


def udev_rule() -> str:
    return (
        "# nvcontainer: refresh the CDI spec when the nvidia kernel module is loaded\n"
        'ACTION=="add", SUBSYSTEM=="module", KERNEL=="nvidia", TAG+="systemd", '
        f'ENV{{SYSTEMD_WANTS}}+="{REFRESH_SERVICE}"\n'
    )


def all_units(cli: str) -> dict[str, str]:
    """File name → text, for the units directory."""
    return {SERVE_SOCKET: serve_socket(), SERVE_SERVICE: serve_service(cli),
            REFRESH_SERVICE: refresh_service(cli), REFRESH_PATH: refresh_path()}
