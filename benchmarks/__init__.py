"""Container start latency benchmarks, on the fake GPU machine (``realgpu``: on a real GPU node).

Run, as root, from the repository root::

    .venv/bin/python -m benchmarks            # about three minutes; --runs N for more or fewer

It prints a table (median, p95, min, max; machine facts on top) and writes the same numbers and
every sample to ``benchmarks/results/<time>.json`` and ``benchmarks/results/latest.json``:

* ``runc run`` of a busybox ``true`` container, without and with the hook
  (``NVIDIA_VISIBLE_DEVICES=0``, ``compute,utility``), interleaved run by run, on cgroup v1 and
  on cgroup v2; the difference of the medians is the hook's overhead. Each world (a private
  mount namespace on the fake machine, where runc runs) has its own resident
  ``nvcontainer serve``, started there from the production-like install (the server declines
  hooks from another mount namespace) and stopped with SIGTERM at the world's end:

  - "served": the registration ``nvcontainer setup`` writes, the bare client
    ``python -I -S <package>/nvcontainer/hook/client.py --socket ...`` handing the run to the
    server; also the console script with ``--socket``, and a container that asks no GPU. The
    targets are judged on these;
  - "in-process": the console script of a production install with no server listening (as
    before there was one), the same from an editable install, with a ``config.toml``, and a
    container that asks no GPU; kept for comparison;
  - before the timed runs, each served registration runs a few times while the server's
    process tree is sampled: a request counts as served only if a worker of the server's child
    is seen (a declined one would be timed as an in-process run), and the request's private
    memory on the server side is recorded;
* the hook alone and ``nvcontainer configure`` alone, each timed inside a real prestart by
  ``benchmarks/probe.py``, which also records peak RSS (for the served client: its own, the
  server's side being the sampled memory above and the server's resident size, reported once);
  ``configure --dry-run``, ``info`` and ``list``; ``python -c pass`` and ``python -I -S -c pass``
  as the floor;
* with the mock NVML made to take 300 ms to initialise (the fake machine's ``init_delay_ms``, as
  a real driver without persistence mode), in-process: the first start after a (simulated)
  reboot, the later starts, and, interleaved with them, starts with NVML fast again. Served, a
  server builds the inventory before it listens, so after a reboot it is the server's start-up
  that pays NVML: the server is restarted after each simulated reboot (its time to listening is
  a row), then come the first start, later and fast starts, and a start after the cache was made
  stale under the running server (that request pays NVML itself);
* 32 containers started at once: no hook, served, in-process, NVIDIA's hook (with the anchors
  tarball), and each of ours after the cache went stale with the slow NVML (they queue behind
  one initialisation).

Timings are never pass/fail tests: the table ends with issue 27's targets (``benchmarks/targets.py``:
ratios against NVIDIA's arm of the same run, the limits a real node's where the fake machine
cannot stand for one), after issue 6's absolute ones.
``python -m benchmarks.hookprofile [--served]`` shows where one hook run spends its time;
``--compare LABEL=DIR|git:REV`` times another tree's hook beside this one (what a change bought);
``--only PART`` runs a part (v1, concurrent, probes, commands, v2, slow).
``python -m benchmarks.mountplace [RUNS]`` times the mount worker's body alone (``place``).
``python -m benchmarks.shim [--runs N]`` times a non-GPU container's lifecycle through the runtime
shim (``nvidia-container-runtime``) against runc alone, and the shim's native front per call.

How the folder is laid out (pyproject.toml's import-linter contract holds it): each benchmark is
a leaf that no other imports (``docker``, ``cri``, ``dockertrace``, ``deviceplugin``, ``dra``,
``hookprofile``, ``leases``, ``mountplace``, ``shim``, ``shimprofile``, ``frontstart``, the
real-GPU check ``realgpu/``, and this one: ``run`` collects, ``report`` makes the table,
``__main__`` is only its command line) over a shared harness: ``machine`` (the fake machine's
facts and worlds), ``world`` and ``worldserver`` (run inside a world), ``dockernode`` (the
Docker node of docker, cri and dockertrace), ``nvidia`` (NVIDIA's arm), ``workspace``,
``stats``, ``targets`` and ``probe``. Results go to ``benchmarks/results/``; only the files
docs/ or README cite are kept in git.
"""
