"""The resident ``nvcontainer serve`` of a world of :mod:`benchmarks.world`: started there (the
server declines hooks from another mount namespace), restarted and stopped on demand, its CPU
counted in a cpuacct cgroup of its own, its memory read from /proc."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time


READY = b"nvcontainer serve: listening on "


CPUACCT = "/sys/fs/cgroup/cpuacct"


def _die_with_parent(account: str | None) -> None:
    """In the server's child before exec: a world that dies for any reason takes its server along
    (PR_SET_PDEATHSIG), so no server outlives the mount namespace it was started for; and into
    its CPU account, so that everything it forks is counted from the first instruction."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    if account:
        with open(os.path.join(account, "cgroup.procs"), "w") as f:
            f.write("0")


def _cpu_account() -> str | None:
    """A cpuacct cgroup for this world's server, or None where v1's cpuacct is not mounted (the
    cgroup v2 world)."""
    path = os.path.join(CPUACCT, f"nvc-bench-server-{os.getpid()}")
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except OSError:
        return None
    return path if os.path.exists(os.path.join(path, "cpuacct.usage")) else None


class Server:
    """One ``nvcontainer serve`` of this world: started, restarted and stopped on demand; its
    stderr goes to a log file, where its "listening on" line says it is ready."""

    def __init__(self, spec: dict):
        self.argv, self.env, self.socket, self.log = spec["argv"], spec["env"], spec["socket"], spec["log"]
        self.spare = "--no-spare" not in self.argv
        self.proc: subprocess.Popen | None = None
        self.record = {"ready_ms": [], "status": [], "stop_rc": [], "socket_left": [], "died": 0, "memory": None,
                       "children_cpu_ms": {}}
        self.account = _cpu_account()

    def start(self, timeout: float = 120.0) -> float:
        """Start and wait until it listens; the milliseconds that took (imports, inventory)."""
        with open(self.log, "ab") as log:
            offset = log.tell()
            start = time.perf_counter()
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
                                         cwd="/", preexec_fn=lambda: _die_with_parent(self.account))
        while True:
            with open(self.log, "rb") as f:
                f.seek(offset)
                text = f.read()
            if READY in text:
                ms = (time.perf_counter() - start) * 1000
                line = text[text.index(READY):].split(b"\n", 1)[0].decode(errors="replace")
                self.record["ready_ms"].append(ms)
                self.record["status"].append(line.split("; ", 1)[-1])
                return ms
            if self.proc.poll() is not None or time.perf_counter() - start > timeout:
                self.stop()
                raise RuntimeError(f"nvcontainer serve did not start: {text.decode(errors='replace')[-2000:]}")
            time.sleep(0.002)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            self.record["died"] += 1   # before it was told to stop: the runs since were not served
        else:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.record["stop_rc"].append(self.proc.returncode)
        self.record["socket_left"].append(os.path.lexists(self.socket))
        self.proc = None

    def cpu_ns(self) -> int | None:
        """CPU time of every process the server ever ran, itself included (its cpuacct group)."""
        if self.account is None:
            return None
        try:
            with open(os.path.join(self.account, "cpuacct.usage")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def remove_account(self) -> None:
        """After :meth:`stop`: the group goes once the last of the server's processes has left it
        (a straggler is killed after two seconds), so no run leaves a cgroup on the host."""
        if self.account is None:
            return
        for attempt in range(41):
            try:
                os.rmdir(self.account)
                return
            except OSError:
                pass
            try:
                with open(os.path.join(self.account, "cgroup.procs")) as f:
                    pids = [int(line) for line in f.read().split()]
            except (OSError, ValueError):
                return
            if attempt >= 40:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.05)

    def children_cpu_ms(self) -> float | None:
        """CPU time (user + system) of the server's reaped children and their workers so far:
        the served requests' own CPU, which no client-side measurement sees."""
        if self.proc is None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[13]) + int(fields[14])) * 1000 / os.sysconf("SC_CLK_TCK")   # cutime, cstime

    def measure_memory(self) -> None:
        """The resident process's own memory, once, after the runs: what a node pays for the
        server whether or not a container starts (its per-request children are measured by
        :func:`served_check`)."""
        if self.proc is not None:
            self.record["memory"] = memory_kb(self.proc.pid)


def memory_kb(pid: int) -> dict:
    """VmRSS and VmHWM from status; Pss and private (clean + dirty) from smaps_rollup. Empty when
    the process is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1])
        with open(f"/proc/{pid}/smaps_rollup") as f:
            private = 0
            for line in f:
                if line.startswith("Pss:"):
                    out["Pss"] = int(line.split()[1])
                elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                    private += int(line.split()[1])
            out["Private"] = private
    except (OSError, ValueError, IndexError):
        return {}
    return out


def children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []
