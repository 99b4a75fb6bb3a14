"""The spare's warm-up: it copies only the pages requests were seen to write, and a request
child reads which ones it wrote from its own page map. Checked in forked children against the
kernel's own view (``/proc/self/pagemap``: a page mapped by this process alone)."""

from __future__ import annotations

import array
import json
import mmap
import os

import pytest

from nvcontainer.apply import prewarm

PAGES = 64
PAGE = prewarm.PAGE


def in_child(fn) -> dict:
    """``fn()``'s JSON answer, computed in a forked child (which shares every page with us)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.fixture
def shared_buffer():
    """64 private writable pages, written here before the fork, so a child shares them all."""
    buf = mmap.mmap(-1, PAGES * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
    for i in range(PAGES):
        buf[i * PAGE] = 1
    start = _address(buf)
    yield buf, start
    buf.close()


def _address(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def own(start: int) -> list[int]:
    """Which of the buffer's pages this process maps alone."""
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        entries = array.array("Q", os.pread(fd, PAGES * 8, start // PAGE * 8))
    finally:
        os.close(fd)
    return [i for i, e in enumerate(entries) if e >> 63 & 1 and e >> 56 & 1]


def pages_in(ranges: list[tuple[int, int]], start: int) -> list[int]:
    return [i for i in range(PAGES) if any(lo <= start + i * PAGE < hi for lo, hi in ranges)]


def test_a_child_reports_the_pages_it_wrote_and_not_the_others(shared_buffer):
    buf, start = shared_buffer

    def child():
        before = own(start)
        for i in (3, 4, 5, 40):
            buf[i * PAGE] = 2
        return {"before": before, "reported": pages_in(prewarm.unpack(prewarm.written_ranges()), start)}

    seen = in_child(child)
    assert seen["before"] == []                  # shared with the parent after the fork
    assert seen["reported"] == [3, 4, 5, 40]     # 3-5 as one range, 40 alone


def test_a_spare_warms_only_the_learned_pages(shared_buffer):
    buf, start = shared_buffer
    learned = array.array("Q", [start + 8 * PAGE, start + 16 * PAGE, start + 60 * PAGE, start + 70 * PAGE]).tobytes()

    def child():
        done = prewarm.own_pages(lambda: False, learned)
        return {"own": own(start), "done": done}

    seen = in_child(child)
    # 8-15, and 60-63: the learned range past the buffer's end is cut at the mapping
    assert seen["own"] == [*range(8, 16), *range(60, 64)]
    assert seen["done"] >= 12 * PAGE


def test_without_learned_ranges_everything_private_and_writable_is_warmed(shared_buffer):
    buf, start = shared_buffer
    assert in_child(lambda: own(start) if prewarm.own_pages(lambda: False) else []) == list(range(PAGES))


def test_the_warm_up_stops_when_a_client_waits(shared_buffer):
    _, start = shared_buffer
    assert in_child(lambda: [prewarm.own_pages(lambda: True), own(start)]) == [0, []]


@pytest.mark.parametrize("data", [
    b"\0" * 15,                                                   # not whole ranges
    array.array("Q", [PAGE + 1, 2 * PAGE]).tobytes(),             # not page-aligned
    array.array("Q", [2 * PAGE, 2 * PAGE]).tobytes(),             # empty
    array.array("Q", [4 * PAGE, 5 * PAGE, PAGE, 2 * PAGE]).tobytes(),   # not ascending
    array.array("Q", [PAGE, 3 * PAGE, 2 * PAGE, 4 * PAGE]).tobytes(),   # overlapping
    b"\0" * (prewarm.MAX_REPORT + 16),                            # too large
])
def test_a_malformed_report_is_refused(data):
    with pytest.raises(ValueError):
        prewarm.unpack(data)


def test_intersect_cuts_mappings_to_the_learned_ranges():
    mappings = [(0, 10), (20, 30), (40, 50)]
    assert prewarm.intersect(mappings, [(5, 25), (45, 100)]) == [(5, 10), (20, 25), (45, 50)]
    assert prewarm.intersect(mappings, []) == []
    assert prewarm.intersect(mappings, [(10, 20), (30, 40)]) == []
