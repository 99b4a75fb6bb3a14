"""A claim's time-slicing settings and compute modes, applied to its GPUs as NVIDIA's driver
applies them: ``nvidia-smi -i <UUID> -c DEFAULT`` then ``nvidia-smi compute-policy -i <UUID>
--set-timeslice=<0-3>`` when a time-sliced GPU is prepared, back to the default (0) when the
last claim that set it is unprepared; ``-c EXCLUSIVE_PROCESS`` before a GPU's MPS daemon starts
(only the daemon then opens it: every client goes through it), ``-c DEFAULT`` once it is gone.

Why nvidia-smi and not NVML here: the plugin is a multi-threaded process that never loads NVML
(the device plugin's rule, for the same reason: a driver call that hangs would hang a thread
the kubelet waits on, and NVML cannot be unloaded). A program started with a clean
environment, no input and a timeout can be killed. It is the inventory's nvidia-smi (the running
driver's, under the driver root), never one found on PATH, checked as MPS control is
(:func:`~nvcontainer.mps.control.driver_program`: a regular file only root can change). MIG devices have no time-slice
setting (NVIDIA's ``MigDeviceConfig`` has none); MPS settings are recorded, not applied.
"""

from __future__ import annotations

import subprocess

from ..errors import NvcError, escape
from ..mps.control import driver_program

INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
TIMEOUT = 10.0
ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}


SMI = "nvidia-smi"
MODES = ("DEFAULT", "EXCLUSIVE_PROCESS")


def smi_path(inv, why: str) -> str:
    """The inventory's nvidia-smi, checked; an error saying ``why`` it is needed otherwise."""
    return driver_program(inv, SMI, why)


def mode_argv(smi: str, uuid: str, mode: str) -> list[str]:
    return [smi, "-i", uuid, "-c", mode]


def timeslice_argv(smi: str, uuid: str, interval: str) -> list[str]:
    return [smi, "compute-policy", "-i", uuid, f"--set-timeslice={INTERVALS[interval]}"]


def wanted(units) -> dict[str, str]:
    """GPU UUID → interval, for the claim's whole GPUs whose configuration asks time-slicing."""
    return {u.gpu.uuid: u.sharing.interval or "Default" for u in units
            if u.mig is None and u.sharing.strategy == "TimeSlicing"}


def run(argv: list[str]) -> None:
    """One nvidia-smi call; NvcError with its first line of output when it fails."""
    try:
        res = subprocess.run(argv, env=ENV, stdin=subprocess.DEVNULL, capture_output=True, timeout=TIMEOUT,
                             close_fds=True, cwd="/")
    except subprocess.TimeoutExpired:
        raise NvcError("device", f"{escape(' '.join(argv[1:]), 200)}: no answer in {TIMEOUT:g} s") from None
    except OSError as exc:
        raise NvcError("device", f"{escape(argv[0])}: {exc.strerror}") from None
    if res.returncode != 0:
        said = (res.stdout + res.stderr).decode("utf-8", "replace").strip().splitlines()
        raise NvcError("device", f"{escape(' '.join(argv[1:]), 200)}: exit status {res.returncode}"
                                 f"{': ' + escape(said[0], 200) if said else ''}")
