"""A prestart hook that runs another one and records how long it took and how much memory it used.

Registered in a bundle in place of the hook being measured, as
``python3 -I -S benchmarks/probe.py OUT [--stderr FILE] -- CMD ARGS...``: it reads the OCI state
from stdin, starts CMD with the same state on its stdin, waits for it, and appends one JSON line
to OUT: wall milliseconds from spawn to exit, CPU milliseconds, peak RSS (``ru_maxrss``) and
minor page faults of CMD and the children it waited for, and the exit status. CPU time is the steadier number on a
shared machine: other load stretches wall time much more than it adds CPU time. Its own start-up is outside the measured window. ``{pid}`` and
``{rootfs}`` in CMD become the container's init PID and its rootfs as the host sees it (for
``nvcontainer configure``, which takes them as arguments). CMD's exit status is the probe's, so
a failing hook still fails the container.
"""

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    stderr_path = None
    if rest[:1] == ["--stderr"]:
        stderr_path, rest = rest[1], rest[2:]
    cmd = rest[1:] if rest[:1] == ["--"] else rest
    state = sys.stdin.buffer.read()
    if any("{pid}" in a or "{rootfs}" in a for a in cmd):
        facts = json.loads(state)
        with open(os.path.join(facts["bundle"], "config.json")) as f:
            root = json.load(f)["root"]["path"]
        rootfs = os.path.join(facts["bundle"], root)
        cmd = [a.replace("{pid}", str(facts["pid"])).replace("{rootfs}", rootfs) for a in cmd]
    r, w = os.pipe()
    os.write(w, state)
    os.close(w)
    actions = [(os.POSIX_SPAWN_DUP2, r, 0)]
    if stderr_path:
        actions.append((os.POSIX_SPAWN_OPEN, 2, stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    start = time.perf_counter()
    pid = os.posix_spawn(cmd[0], cmd, os.environ, file_actions=actions)
    _, status, usage = os.wait4(pid, 0)
    ms = (time.perf_counter() - start) * 1000
    os.close(r)
    rc = os.waitstatus_to_exitcode(status)
    cpu_ms = (usage.ru_utime + usage.ru_stime) * 1000
    line = json.dumps({"ms": ms, "cpu_ms": cpu_ms, "maxrss_kb": usage.ru_maxrss, "minflt": usage.ru_minflt,
                       "rc": rc}) + "\n"
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, line.encode())
    os.close(fd)
    return rc if rc >= 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
