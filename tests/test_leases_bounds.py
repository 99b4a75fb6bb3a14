"""Leases fail closed (issue 35): what a container writes never reaches the lease file as text
(the lease records the normalized request), the writer refuses what the reader would refuse (one
bound, checked at it and one past it), one damaged entry is kept beside the others and holds its
GPUs (all of them when it says too little) until its container is known to have ended, and a
request is refused rather than granted a GPU such an entry may hold. In-process against real
processes; ``tests/test_leases_hostile.py`` runs the same under runc, in-process and served."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from nvcontainer.config.model import Config
from nvcontainer.errors import NvcError
from nvcontainer.leases import grant, liveness, store
from nvcontainer.leases.model import MAX_GPUS, MAX_TEXT, Lease, from_json, problem
from nvcontainer.records import replace
from nvcontainer.request.decide import request_from_env
from tests.test_leases_grant import inventory


def me(container="c1", indexes=(0,), **kw) -> Lease:
    pid = os.getpid()
    fields = {"bundle": "/b", "since": 1.0, "how": "free", "asked": "free:1", **kw}
    return Lease(gpus=tuple(f"GPU-{i}" for i in indexes), indexes=tuple(indexes), container=container, pid=pid,
                 start=liveness.start_time(pid), **fields)


@pytest.fixture
def cfg(tmp_path):
    return Config(cache_dir=str(tmp_path / "run"), exclusive_gpus=True)


def path_of(cfg) -> str:
    return store.path_in(cfg.cache_dir)


def entries(cfg) -> list:
    with open(path_of(cfg)) as f:
        return json.load(f)["leases"]


def write_entries(cfg, items) -> None:
    os.makedirs(cfg.cache_dir, mode=0o700, exist_ok=True)
    with open(path_of(cfg), "w") as f:
        json.dump({"version": store.VERSION, "leases": items}, f)


def ask(cfg, value: str, container: str, inv=None):
    inv = inv or inventory(4)
    request = request_from_env({"NVIDIA_VISIBLE_DEVICES": value}, cfg, privileged=False)
    return grant.acquire(request, inv, cfg, container, os.getpid(), "/b")


def spellings(uuid: str, n: int) -> str:
    """``n`` distinct mixed-case spellings of one UUID, comma-separated: the issue's request."""
    letters = [i for i, ch in enumerate(uuid) if ch.isalpha()]
    out = []
    for k in range(n):
        chars = list(uuid)
        for bit, at in enumerate(letters):
            if k >> bit & 1:
                chars[at] = chars[at].swapcase()
        out.append("".join(chars))
    assert len(set(out)) == n
    return ",".join(out)


@pytest.mark.parametrize("key", ["container", "bundle", "asked"])
def test_a_text_field_at_the_bound_is_written_and_read_back_and_one_past_is_refused(cfg, key):
    path = path_of(cfg)
    store.update(path, lambda old: ((me(container="first"),), None))
    at = me(**{"container": "c", key: "x" * MAX_TEXT})
    assert problem(at.to_json()) is None and from_json(at.to_json()) == at
    store.update(path, lambda old: ((*old, at), None))
    assert store.load(path) == (me(container="first"), at)
    before = open(path, "rb").read()
    past = me(**{"container": "d", key: "x" * (MAX_TEXT + 1)})
    with pytest.raises(NvcError) as exc:
        store.update(path, lambda old: ((*old, past), None))
    assert f"field '{key}' is {MAX_TEXT + 1} characters, more than {MAX_TEXT}" in exc.value.detail
    assert "\n" not in str(exc.value)
    assert open(path, "rb").read() == before        # nothing half-written, nothing lost


def test_a_container_id_past_the_bound_is_refused_its_lease_in_one_line(cfg):
    with pytest.raises(NvcError) as exc:
        ask(cfg, "free:1", "c" * (MAX_TEXT + 1))
    assert "not recorded: field 'container'" in str(exc.value) and "\n" not in str(exc.value)
    assert store.load(path_of(cfg)) == ()
    assert ask(cfg, "free:1", "c" * MAX_TEXT).devices == (inventory(4).gpus[0].uuid,)
    assert [x.container for x in store.load(path_of(cfg))] == ["c" * MAX_TEXT]


def test_every_gpu_of_the_largest_node_leased_explicitly_stays_readable(cfg):
    """The normalized request of an explicit lease is its indexes: at :data:`MAX_GPUS` GPUs
    that is still within the text bound, so the largest lease the writer makes is read back."""
    ask(cfg, "all", "big", inventory(MAX_GPUS))
    (lease,) = store.load(path_of(cfg))
    assert lease.indexes == tuple(range(MAX_GPUS)) and lease.asked == ",".join(map(str, range(MAX_GPUS)))
    assert len(lease.asked) <= MAX_TEXT


def test_many_spellings_of_one_gpu_are_recorded_as_that_gpu_and_hold_it(cfg):
    """The issue's case: ~140 mixed-case spellings of GPU 1's UUID under exclusive-gpus used to
    be recorded as written (over the reader's bound); the next start set the whole file aside
    and a ``free`` request got GPU 1."""
    base = inventory(2)
    inv = replace(base, gpus=tuple(replace(g, uuid=f"GPU-{g.index:08x}-abcd-ef01-2345-6789abcdefab") for g in base.gpus))
    value = spellings(inv.gpus[1].uuid, 140)
    assert len(value) > MAX_TEXT
    ask(cfg, value, "holder", inv)
    (item,) = entries(cfg)
    assert (item["indexes"], item["gpus"], item["asked"], item["how"]) == ([1], [inv.gpus[1].uuid], "1", "explicit")
    assert ask(cfg, "free", "other", inv).devices == (inv.gpus[0].uuid,)
    with pytest.raises(NvcError, match=r"^device error: free:1: no 1 GPU\(s\) free; GPU 0 held by container other"):
        ask(cfg, "free", "third", inv)
    assert [x.container for x in store.load(path_of(cfg))] == ["holder", "other"]


def damaged(indexes=(1,), pid=None, start=None, **extra) -> dict:
    item = me(container="damaged", indexes=indexes).to_json()
    item.update(asked="y" * (MAX_TEXT + 1), **extra)   # what an older nvcontainer wrote
    if pid is not None:
        item.update(pid=pid, start=start)
    return item


def test_one_damaged_entry_keeps_the_others_and_holds_its_gpus(cfg):
    good, bad = me(container="good", indexes=(0,)).to_json(), damaged(indexes=[1])
    write_entries(cfg, [good, bad])
    assert store.load(path_of(cfg)) == (from_json(good),)      # a reader that only looks: the others
    assert ask(cfg, "free", "new").devices == (inventory(4).gpus[2].uuid,)   # 0 and 1 held
    kept = entries(cfg)
    assert good in kept and bad in kept and len(kept) == 3     # the damaged entry kept, verbatim
    with pytest.raises(NvcError) as exc:
        ask(cfg, "1", "clash")
    assert "exclusive-gpus: GPU 1 held by unreadable lease entry" in str(exc.value)
    assert f"field 'asked' is {MAX_TEXT + 1} characters" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("item", [damaged(indexes="all"), "not an object", damaged(indexes=[])],
                         ids=["indexes unreadable", "not an object", "no indexes"])
def test_an_entry_that_says_too_little_holds_every_gpu(cfg, item):
    write_entries(cfg, [item])
    for value, held in (("free", "GPU 0, 1, 2, 3"), ("3", "GPU 3")):
        with pytest.raises(NvcError) as exc:
            ask(cfg, value, "new")
        assert f"{held} held by unreadable lease entry 0" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(NvcError, match="held by unreadable lease entry 0"):
        grant.preview(request_from_env({"NVIDIA_VISIBLE_DEVICES": "free"}, cfg, privileged=False), inventory(4), cfg)
    assert entries(cfg) == [item]


def test_a_damaged_entry_whose_container_ended_is_dropped(cfg):
    child = subprocess.Popen(["true"])
    while liveness.stat_of(child.pid)[0] != "Z":
        pass
    start = liveness.stat_of(child.pid)[1]
    live_bad = damaged(indexes=[1])
    write_entries(cfg, [damaged(indexes="x", pid=child.pid, start=start), live_bad])
    child.wait()   # its init gone: what the entry salvaged says it ended
    assert ask(cfg, "free", "new").devices == (inventory(4).gpus[0].uuid,)
    assert live_bad in entries(cfg) and len(entries(cfg)) == 2
    reused = damaged(indexes="x", pid=os.getpid(), start=liveness.start_time(os.getpid()) + 1)   # a reused pid
    write_entries(cfg, [reused])
    assert ask(cfg, "free", "new").devices == (inventory(4).gpus[0].uuid,)
    assert len(entries(cfg)) == 1


def test_a_request_at_the_environment_bound_leases_one_gpu_and_one_past_is_refused(cfg):
    """``NVIDIA_VISIBLE_DEVICES`` at its 64 KiB bound, all spellings of GPU 1: one GPU leased,
    recorded as ``1``; one character more is refused in one line and nothing is recorded."""
    from nvcontainer.request.visible import MAX_VALUE

    base = inventory(2)
    inv = replace(base, gpus=tuple(replace(g, uuid=f"GPU-{g.index:08x}-abcd-ef01-2345-6789abcdefab") for g in base.gpus))
    value = spellings(inv.gpus[1].uuid, 1000)
    value = "," * (MAX_VALUE - len(value)) + value     # empty entries are dropped: at the bound
    with pytest.raises(NvcError) as exc:
        ask(cfg, "," + value, "past", inv)
    assert f"longer than {MAX_VALUE} characters" in str(exc.value) and "\n" not in str(exc.value)
    assert not os.path.exists(path_of(cfg))
    ask(cfg, value, "at", inv)
    (item,) = entries(cfg)
    assert (item["indexes"], item["asked"]) == ([1], "1")
