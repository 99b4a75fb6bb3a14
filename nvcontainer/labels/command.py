"""``nvcontainer labels``: the node's labels printed once, or kept in NFD's feature file.

Why it keeps running rather than failing: as a DaemonSet container it is the only thing that
tells the scheduler what a node's GPUs are, and every fault it meets is one the node recovers
from (a driver being upgraded, NFD's directory not there yet, a full disk). So a round that
fails says so in one line on stderr (once, until it changes, and once more when it is over),
leaves the last good file in place, and the file's expiry (:data:`EXPIRY_PERIODS` periods) makes
NFD drop labels that nobody refreshes. Only what the operator can fix at once, a bad
``[device-plugin]`` table, stops it.

It relabels every ``period`` seconds, and within :data:`WATCH_SECONDS` when the kernel's view of
the driver changes (another driver loaded, a GPU gone, MIG instances created or destroyed: the
same machine facts the inventory cache checks), rebuilding the inventory through that cache.
"""

from __future__ import annotations

import signal
import sys
import time

from ..errors import NvcError, escape
from ..inventory.procfs import read_text
from . import featurefile, gfd

EXPIRY_PERIODS = 4
ONE_SHOT_EXPIRY = 3600          # a file written once expires after an hour
WATCH_SECONDS = 5.0
MACHINE_TYPE_FILE = "/sys/class/dmi/id/product_name"
MAX_MACHINE_TYPE = 256


def machine_type(path: str) -> str | None:
    """The DMI product name (what NVIDIA's labeller reads), or None when it cannot be read."""
    try:
        text = read_text(path, MAX_MACHINE_TYPE)
    except OSError:
        return None
    return None if text is None else text.strip()


class Labeller:
    """One round at a time: read the inventory, decide the labels, publish them."""

    def __init__(self, config, *, output_file: str | None, period: float | None, machine_type_file: str,
                 timestamps: bool, clock=time.time):
        from ..deviceplugin import settings as settings_module

        self.config = config
        self.settings = settings_module.parse(config.device_plugin)
        self.output_file = output_file
        self.period = period
        self.machine_type_file = machine_type_file
        self.timestamps = timestamps
        self.clock = clock
        self.trouble: str | None = None

    def labels(self) -> dict[str, str]:
        from ..inventory.cache import cached_inventory

        inv = cached_inventory(self.config)
        now = self.clock()
        return gfd.node_labels(inv, self.settings, machine=machine_type(self.machine_type_file),
                               timestamp=int(now) if self.timestamps else None)

    def round(self) -> None:
        """Publish once; raise NvcError on failure."""
        labels = self.labels()
        if self.output_file is None:
            sys.stdout.write(featurefile.lines(labels))
            sys.stdout.flush()
            return
        lifetime = EXPIRY_PERIODS * self.period if self.period else ONE_SHOT_EXPIRY
        featurefile.write(self.output_file, featurefile.feature_file(labels, self.clock() + lifetime))

    def keep_going(self) -> None:
        """A round whose failure is reported, not raised."""
        try:
            self.round()
        except NvcError as exc:
            line = exc.line()
            if line != self.trouble:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            self.trouble = line
            return
        if self.trouble is not None:
            sys.stderr.write(f"nvcontainer: labels published again{self._where()}\n")
            sys.stderr.flush()
        self.trouble = None

    def _where(self) -> str:
        return f" to {escape(self.output_file)}" if self.output_file else ""


def run(config, *, output_file: str | None, period: float | None, machine_type_file: str = MACHINE_TYPE_FILE,
        timestamps: bool = True, clock=time.time, sleep=time.sleep, monotonic=time.monotonic,
        rounds: int | None = None) -> None:
    """Once without ``period`` (a failure is the command's); with it, until killed (``rounds``:
    the tests' bound). ``clock`` dates the labels and the file's expiry; ``monotonic`` paces
    the rounds."""
    from ..inventory.cache import machine_state

    # SIGTERM (the kubelet stopping the pod) ends a round cleanly: no temporary file is left
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    labeller = Labeller(config, output_file=output_file, period=period, machine_type_file=machine_type_file,
                        timestamps=timestamps, clock=clock)
    if not period:
        labeller.round()
        return
    done = 0
    while rounds is None or done < rounds:
        state = machine_state()
        labeller.keep_going()
        done += 1
        due = monotonic() + period
        while monotonic() < due:
            sleep(min(WATCH_SECONDS, max(due - monotonic(), 0.01)))
            if machine_state() != state:
                break
