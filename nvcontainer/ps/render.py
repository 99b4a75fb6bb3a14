"""``nvcontainer ps`` output: a table for people, JSON for programs (pure)."""

from __future__ import annotations

import json

from ..errors import escape


def size(value: int | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "-"


def _percent(value) -> str:
    return "-" if value is None else f"{value}%"


def _process(p: dict) -> str:
    parts = [size(p["memory"])] + ([f"SM {p['sm']}%"] if p["sm"] is not None else [])
    return f"{p['pid']} {escape(p['command']) or '?'} ({', '.join(parts)})"


def _short(container_id: str) -> str:
    return container_id[:12] if len(container_id) == 64 else container_id


def text(view: list[dict]) -> str:
    lines = []
    for gpu in view:
        lines.append(f"GPU {gpu['index']}  {escape(gpu['model'])}  {gpu['uuid']}  "
                     f"util {_percent(gpu['utilization'])}  memory util {_percent(gpu['memory_utilization'])}")
        rows = [("CONTAINER", "NAME", "ENGINE", "HOW", "PID", "MEMORY", "PROCESSES")]
        for c in gpu["containers"]:
            how = c["how"] + ("" if c["running"] else " (container gone)" if c["pid"] else " (never started)")
            if c["running"] and c["pid"] == 0:
                how += " (pending)"   # the runtime shim's, until the container's init binds it
            name = escape(c["name"]) or (f"[{c['command']}]" if c["command"] else "-")   # command: escaped by scan
            rows.append((escape(_short(c["id"])) or "-", name, c["engine"] or "-", how,
                         str(c["pid"]), size(c["memory"]), "; ".join(_process(p) for p in c["processes"]) or "-"))
        for p in gpu["host_processes"]:
            rows.append(("(host)", "-", "-", "-", "-", size(p["memory"]), _process(p)))
        if len(rows) == 1:
            lines.append("  no containers")
        else:
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
            for r in rows:
                lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    return "\n".join(lines) + "\n" if lines else "no GPUs\n"


def as_json(view: list[dict]) -> str:
    return json.dumps({"gpus": view}, indent=2) + "\n"
