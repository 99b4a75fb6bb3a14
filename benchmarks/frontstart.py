"""What the fronts' ``-I -S`` start saves: ``python -m benchmarks.frontstart [--runs N] PYTHON...``.

Each interpreter (a venv's ``bin/python``) is started ``--runs`` times each way, alternating, from
an environment of ``PATH`` alone, as the native fronts start it: ``-I -c CODE`` (``site``'s own
start, as before) and ``-I -S -c BOOT CODE`` (``native/boot.py``'s byte code first, as the fronts
run now), where ``CODE`` imports what the in-process hook imports on a GPU start (``--code``
overrides it; ``import os`` measures the start alone). Printed per interpreter and way: the
median wall time, the mean and median CPU time, the median minor page faults, and which start
the boot took ("fast", or "site" where the install has what ``-S`` would drop).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from nvcontainer.native import build

HOOK_IMPORTS = ("import nvcontainer.hook.main, nvcontainer.hook.prestart, nvcontainer.plan.gather, "
                "nvcontainer.inventory.cache, nvcontainer.apply.execute, nvcontainer.cgroups.v1")
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def _one(argv: list[str]) -> tuple[float, float, int]:
    start = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, ENV)
    _, status, usage = os.wait4(pid, 0)
    if status:
        raise SystemExit(f"{argv[0]} {' '.join(argv[1:3])}: exit status {status}")
    return (time.perf_counter() - start) * 1000, (usage.ru_utime + usage.ru_stime) * 1000, usage.ru_minflt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frontstart", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--code", default=HOOK_IMPORTS)
    parser.add_argument("pythons", nargs="+")
    args = parser.parse_args(argv)
    boot = build.boot_line()
    print(f"load average {os.getloadavg()[0]:.2f}; {args.runs} runs each way, alternating; code: {args.code}")
    for python in map(os.path.abspath, args.pythons):
        took = subprocess.run([python, "-I", "-S", "-c", boot + "print(_nvc_start)"], env=ENV, cwd="/",
                              capture_output=True, text=True, check=True).stdout.strip()
        ways = {"-I (site)": [python, "-I", "-c", args.code], f"-I -S boot ({took})": [python, "-I", "-S", "-c",
                                                                                        boot + args.code]}
        samples: dict[str, list] = {way: [] for way in ways}
        for _ in range(args.runs):
            for way, command in ways.items():
                samples[way].append(_one(command))
        for way, got in samples.items():
            cpu = [s[1] for s in got]
            print(f"{python}  {way:20} wall {statistics.median(s[0] for s in got):6.2f} ms  CPU mean "
                  f"{statistics.mean(cpu):6.2f} median {statistics.median(cpu):6.2f} ms  "
                  f"faults {statistics.median(s[2] for s in got):.0f}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
