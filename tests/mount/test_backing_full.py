"""A BACKING that fills up part way through a write: the write answers the bytes it wrote, as
write(2) on BACKING itself does, and those bytes (no more) are in the file, through the mount
and in BACKING. cachefs answered ENOSPC for the whole write although part of it was written:
a program that appends or retries then wrote after bytes it did not know were there."""

from __future__ import annotations

import os

import pytest

from tests.mount.test_passthrough import _available, held_file

pytestmark = pytest.mark.fuse

KiB = 1024


def fill(backing, leave: int) -> None:
    """Fill BACKING (a tmpfs) but for about `leave` bytes."""
    st = os.statvfs(backing)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(backing, "pad"), "wb") as f:
        f.write(bytes(free - leave))


def write_until_full(path, data: bytes) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        return os.write(fd, data)
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_write_that_fills_backing_answers_what_it_wrote(make_mount, make_tmpfs, mode):
    backing = make_tmpfs("4M")
    args = ["--mode", mode]
    if mode == "write-back":
        # the pool is all held by a file read in passthrough: the write goes around it
        if _available():
            pytest.skip(_available())
        args += ["--cache-size", "1M"]
    m = make_mount(*args, backing=backing)
    holder = None
    try:
        if mode == "write-back":
            _, holder = held_file(m, "h")
        fill(backing, 256 * KiB)
        data = os.urandom(1024 * KiB)
        n = write_until_full(m.path("f"), data)
        assert 0 < n < len(data), f"{n} bytes written of {len(data)}"
        if mode == "write-back":
            assert m.stats()["writes_around"] >= 1, "the write did not go around the cache"
        assert m.path("f").read_bytes() == data[:n]
        assert (m.backing / "f").read_bytes() == data[:n]
        os.unlink(backing / "pad")
    finally:
        if holder is not None:
            os.close(holder)
