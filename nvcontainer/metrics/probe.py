"""Whether an exporter answers on this node (for ``doctor``): one GET of ``/metrics`` on the
local port, bounded, and what it says about the GPUs (``nvcontainer_gpu_up``)."""

from __future__ import annotations

import http.client

MAX_BODY = 8 << 20
SERVER = "nvcontainer-metrics"


def count_up(body: bytes) -> tuple[int, int]:
    """(GPUs up, GPUs) from a text-format body's ``nvcontainer_gpu_up`` samples."""
    up = total = 0
    for line in body.splitlines():
        if line.startswith(b"nvcontainer_gpu_up{"):
            total += 1
            up += line.rsplit(b" ", 1)[-1].strip() in (b"1", b"1.0")
    return up, total


def probe(host: str = "127.0.0.1", port: int = 9400, timeout: float = 3.0) -> dict:
    """``{"state": "absent" | "ours" | "other" | "locked", "server": ..., "up": n, "gpus": n}``:
    nothing listens; ours answers; another exporter (dcgm-exporter, say) holds the port; ours
    asks for credentials or TLS (not checked further)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/metrics", headers={"Accept": "text/plain"})
        reply = conn.getresponse()
        server = (reply.getheader("Server") or "").split("/", 1)[0].strip()
        body = reply.read(MAX_BODY)
    except ConnectionRefusedError:
        return {"state": "absent"}
    except (OSError, http.client.HTTPException) as exc:
        return {"state": "locked", "server": "", "why": type(exc).__name__}
    finally:
        conn.close()
    if reply.status == 401:
        return {"state": "locked", "server": server}
    if server != SERVER:
        return {"state": "other", "server": server or "unnamed"}
    up, total = count_up(body)
    return {"state": "ours", "server": server, "up": up, "gpus": total}
