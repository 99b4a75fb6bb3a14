"""The lease decision on made-up inventories and real processes: free GPUs only, NUMA-aware
placement, one line naming the holders, pending inits that already exited, and two hundred
processes asking at once getting distinct GPUs."""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from nvcontainer.config.model import Config
from nvcontainer.errors import NvcError
from nvcontainer.inventory.model import Gpu, Inventory
from nvcontainer.inventory.topology import Topology
from nvcontainer.leases import grant, liveness, store
from nvcontainer.leases.model import Lease
from nvcontainer.request.decide import request_from_env
from nvcontainer.request.placement import choose_gpus
from nvcontainer.request.selection import allow_list


def inventory(n: int) -> Inventory:
    return Inventory(root="/", driver_version="550.54.14", cuda_version="12.4", gpus=tuple(
        Gpu(index=i, minor=i, model="Fake", brand="Tesla", uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
            bus_id=f"00000000:{i + 1:02x}:00.0", arch="9.0") for i in range(n)))


def held(container: str, *indexes: int) -> Lease:
    return Lease(gpus=tuple(f"GPU-{i}" for i in indexes), indexes=indexes, container=container, pid=4242, start=1)


@pytest.mark.parametrize("value", ["free:0", "free:-1", "free:many", "free:1.5", "free,0", "0,free:2",
                                   "free:mig-1g.10gb", "free:99999"])
def test_bad_forms_are_one_line_naming_the_value(value):
    with pytest.raises(NvcError) as exc:
        request_from_env({"NVIDIA_VISIBLE_DEVICES": value}, Config(), privileged=False)
    assert value.split(",")[0] in str(exc.value) and "\n" not in str(exc.value)


def test_free_takes_only_unheld_allowed_gpus():
    inv = inventory(4)
    live = [held("aaaa", 0), held("bbbb", 2)]
    assert grant.decide_free(live, inv, None, 1, Topology(), "free") == [1]
    assert grant.decide_free(live, inv, None, 2, Topology(), "free:2") == [1, 3]
    assert grant.decide_free(live, inv, None, 3, Topology(), "free:3") is None
    allow = allow_list(inv, ("1", "2"))
    assert grant.decide_free(live, inv, allow, 1, Topology(), "free") == [1]
    with pytest.raises(NvcError, match=r"free:3: this node has 2 GPU\(s\) allowed \(allowed-devices\)"):
        grant.decide_free([], inv, allow, 3, Topology(), "free:3")
    with pytest.raises(NvcError, match=r"free:99: this node has 4 GPU\(s\)$"):
        grant.decide_free([], inv, None, 99, Topology(), "free:99")


def test_who_holds_names_every_holder():
    line = grant.who_holds([held("aaaabbbbccccdddd", 0, 1), held("eeee", 3)])
    assert line == "GPU 0, 1 held by container aaaabbbbcccc (pid 4242); GPU 3 held by container eeee (pid 4242)"


def test_placement_prefers_one_numa_node_then_nvlink():
    numa = Topology(numa={0: 0, 1: 0, 2: 1, 3: 1})
    assert choose_gpus([0, 2, 3], 2, numa) == [2, 3]            # not 0 and 2 across sockets
    linked = Topology(numa={}, links={(1, 3): 4})
    assert choose_gpus([0, 1, 2, 3], 2, linked) == [1, 3]      # the NVLinked pair
    assert choose_gpus([0, 1, 2, 3], 2, Topology()) == [0, 1]  # else the lowest indexes


def test_an_init_that_exited_before_the_lease_is_refused(tmp_path):
    child = subprocess.Popen(["true"])
    while liveness.stat_of(child.pid)[0] != "Z":
        pass
    cfg = Config(cache_dir=str(tmp_path / "run"))
    request = request_from_env({"NVIDIA_VISIBLE_DEVICES": "free"}, cfg, privileged=False)
    with pytest.raises(NvcError, match=r"its init \(pid \d+\) exited before its GPUs were leased"):
        grant.acquire(request, inventory(2), cfg, "c1", child.pid, "/b")
    child.wait()
    assert store.load(store.path_in(cfg.cache_dir)) == ()


def test_leases_of_ended_containers_are_released_by_the_next_request(tmp_path):
    cfg = Config(cache_dir=str(tmp_path / "run"))
    inv = inventory(1)
    request = request_from_env({"NVIDIA_VISIBLE_DEVICES": "free"}, cfg, privileged=False)
    child = subprocess.Popen(["sleep", "30"])
    got = grant.acquire(request, inv, cfg, "first", child.pid, "/b")
    assert got.devices == (inv.gpus[0].uuid,)
    with pytest.raises(NvcError, match=r"free:1: no 1 GPU\(s\) free; GPU 0 held by container first \(pid"):
        grant.acquire(request, inv, cfg, "second", os.getpid(), "/b")
    child.kill()
    child.wait()
    assert grant.acquire(request, inv, cfg, "second", os.getpid(), "/b").devices == (inv.gpus[0].uuid,)
    assert [x.container for x in store.load(store.path_in(cfg.cache_dir))] == ["second"]


def _ask(args):
    cache_dir, n = args
    cfg = Config(cache_dir=cache_dir)
    request = request_from_env({"NVIDIA_VISIBLE_DEVICES": "free"}, cfg, privileged=False)
    try:
        return grant.acquire(request, inventory(8), cfg, f"c{n}", os.getpid(), "/b").devices[0]
    except NvcError as exc:
        return str(exc)


def test_two_hundred_at_once_never_share_a_gpu(tmp_path):
    """200 processes (each its own live init) ask free:1 of 8 GPUs at once: 8 distinct grants."""
    with multiprocessing.get_context("fork").Pool(16) as pool:
        answers = pool.map(_ask, [(str(tmp_path / "run"), n) for n in range(200)], chunksize=1)
    granted = [a for a in answers if a.startswith("GPU-")]
    # pool workers are reused: a worker's second ask finds its own pid's lease under another
    # container id, so at most 8 grants in all, each a different GPU
    assert len(granted) == len(set(granted)) == 8, answers
    assert all("no 1 GPU(s) free" in a for a in answers if not a.startswith("GPU-"))
    leases = store.load(store.path_in(str(tmp_path / "run")))
    assert sorted(i for x in leases for i in x.indexes) == list(range(8))


def test_dry_run_preview_records_nothing(tmp_path):
    cfg = Config(cache_dir=str(tmp_path / "run"))
    inv = inventory(2)
    request = request_from_env({"NVIDIA_VISIBLE_DEVICES": "free"}, cfg, privileged=False)
    grant.acquire(request, inv, cfg, "holder", os.getpid(), "/b")
    before = store.load(store.path_in(cfg.cache_dir))
    assert grant.preview(request, inv, cfg).devices == (inv.gpus[1].uuid,)
    assert store.load(store.path_in(cfg.cache_dir)) == before
    two = request_from_env({"NVIDIA_VISIBLE_DEVICES": "free:2"}, cfg, privileged=False)
    with pytest.raises(NvcError, match=r"free:2: no 2 GPU\(s\) free; GPU 0 held by container holder"):
        grant.preview(two, inv, cfg)


def test_rehearsal_reads_only(tmp_path):
    """The spare's rehearsal of a lease: nothing locked, written or set aside, whatever the file."""
    cfg = Config(cache_dir=str(tmp_path / "run"))
    path = store.path_in(cfg.cache_dir)
    grant.rehearse(path, inventory(2))                      # no file: nothing made
    assert not os.path.exists(os.path.dirname(path))
    request = request_from_env({"NVIDIA_VISIBLE_DEVICES": "free"}, cfg, privileged=False)
    grant.acquire(request, inventory(2), cfg, "holder", os.getpid(), "/b")
    before = os.stat(path)
    grant.rehearse(path, inventory(2))
    assert os.stat(path).st_ino == before.st_ino
    with open(path, "w") as f:
        f.write("{truncated")
    grant.rehearse(path, inventory(2))                      # a bad file: left for a writer
    assert open(path).read() == "{truncated"
