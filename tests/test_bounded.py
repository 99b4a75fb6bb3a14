"""The one bounded read: exactly the bound is fine, one byte more is "more", whatever the file
says about its size."""

from __future__ import annotations

import os
import threading

import pytest

from nvcontainer.fs.bounded import CHUNK, read_at_most


@pytest.mark.parametrize("size, limit", [(0, 0), (0, 10), (10, 10), (11, 10), (CHUNK * 3 + 7, CHUNK * 3 + 7),
                                         (CHUNK * 3 + 8, CHUNK * 3 + 7), (CHUNK * 5, 100)])
def test_read_at_most(tmp_path, size, limit):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    fd = os.open(path, os.O_RDONLY)
    try:
        data, more = read_at_most(fd, limit)
    finally:
        os.close(fd)
    assert data == path.read_bytes()[:limit]
    assert more == (size > limit)


def test_a_pipe_that_never_ends_is_cut_at_the_bound():
    r, w = os.pipe()
    stop = threading.Event()

    def feed():
        try:
            while not stop.is_set():
                os.write(w, b"x" * 4096)
        except OSError:
            pass

    t = threading.Thread(target=feed)
    t.start()
    try:
        data, more = read_at_most(r, 100_000)
    finally:
        stop.set()
        os.close(r)
        t.join()
        os.close(w)
    assert len(data) == 100_000 and more


def test_procfs_files_that_say_size_zero_are_read_whole():
    fd = os.open("/proc/self/mountinfo", os.O_RDONLY)
    try:
        data, more = read_at_most(fd, 1 << 20)
    finally:
        os.close(fd)
    assert not more and data.count(b"\n") >= 3
