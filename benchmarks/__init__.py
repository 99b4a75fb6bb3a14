"""Container start latency benchmarks, on the fake GPU machine.

Run, as root, from the repository root::

    .venv/bin/python -m benchmarks            # about three minutes; --runs N for more or fewer

It prints a table (median, p95, min, max; machine facts on top) and writes the same numbers and
every sample to ``benchmarks/results/<time>.json`` and ``benchmarks/results/latest.json``:

* ``runc run`` of a busybox ``true`` container, without and with ``nvcontainer-hook``
  (``NVIDIA_VISIBLE_DEVICES=0``, ``compute,utility``), interleaved run by run, on cgroup v1 and
  on cgroup v2; the difference of the medians is the hook's overhead;
* the hook registered as a production install runs it (a console script of a regular install),
  beside the same hook from an editable install and the hook reading a ``config.toml``;
* the hook alone and ``nvcontainer configure`` alone, each timed inside a real prestart by
  ``benchmarks/probe.py``, which also records the hook's peak RSS; ``configure --dry-run``,
  ``info`` and ``list``; ``python -c pass`` and ``python -I -S -c pass`` as the floor;
* with the mock NVML made to take 300 ms to initialise (the fake machine's ``init_delay_ms``, as
  a real driver without persistence mode): the first start after a (simulated) reboot, the later
  starts, and, interleaved with them, starts with NVML fast again;
* 32 containers started at once, with and without the hook, and with the hook right after a
  reboot with the slow NVML (they queue behind one initialisation).

Timings are never pass/fail tests: the table says whether issue #6's targets were met.
``python -m benchmarks.hookprofile`` shows where one hook run spends its time;
``--compare LABEL=DIR|git:REV`` times another tree's hook beside this one (what a change bought);
``--only PART`` runs a part (v1, concurrent, probes, commands, v2, slow).
"""
