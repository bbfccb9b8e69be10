"""What a shared writable mapping of a file read in passthrough costs BACKING: only the
blocks it changed (heldwrites.may_be_mapped / sync_back). An O_RDWR open of a file another
process reads in passthrough maps the cache file on mmap, so cachefs cannot see its writes;
it used to copy (write-through) or destage (write-back) the whole file after every such
open, and move its mtime, even when nothing was written. Now the blocks' checksums at the
open are the baseline: at the end only blocks whose bytes differ from it, or that the engine
changed meanwhile, go to BACKING."""

from __future__ import annotations

import mmap
import os

import pytest

from tests.conftest import ctl_flush, wait_until
from tests.mount.test_passthrough import MiB, _available, cache_fully, open_passthrough

pytestmark = pytest.mark.fuse

BLK = 4096
SIZE = 4 * MiB


@pytest.fixture
def held(make_mount, mode):
    """A mount (destaging held off in write-back: what turns dirty stays dirty until a
    flush) with a 4 MiB file cached whole and opened read-only in passthrough."""
    reason = _available()
    if reason:
        pytest.skip(reason)
    m = make_mount("--mode", mode, "--attr-timeout", "0.2", "--cache-size", "64M",
                   "--dirty-high", "48M", "--dirty-low", "40M", "--max-dirty-age", "1h")
    assert m.stats()["passthrough"] == "on", m.stats()["passthrough_off_reason"]
    data = bytearray(os.urandom(SIZE))
    (m.backing / "f").write_bytes(data)
    cache_fully(m, "f", SIZE)
    r = open_passthrough(m, "f")
    try:
        yield m, data, r
    finally:
        os.close(r)


def settled(m, before: dict) -> dict:
    """Wait for the end of the O_RDWR open's mapping to be taken (passthrough_syncs)."""
    wait_until(lambda: m.stats()["passthrough_syncs"] > before["passthrough_syncs"], 10,
               what="the mapping's end to be taken")
    return m.stats()


def test_an_o_rdwr_open_that_writes_nothing_costs_backing_nothing(held, mode):
    m, data, _ = held
    mtime = os.stat(m.backing / "f").st_mtime_ns
    before = m.stats()
    w = os.open(m.path("f"), os.O_RDWR)
    try:
        with mmap.mmap(w, 0) as mp:             # mapped writable, read only
            assert mp[:SIZE] == data
    finally:
        os.close(w)
    after = settled(m, before)
    assert after["dirty_bytes"] == 0
    assert after["backing_write_bytes"] == before["backing_write_bytes"]
    ctl_flush(m)
    assert m.stats()["destaged_bytes"] == before["destaged_bytes"]
    assert os.stat(m.backing / "f").st_mtime_ns == mtime
    assert (m.backing / "f").read_bytes() == data


def test_a_mapping_that_changes_one_block_costs_one_block(held, mode):
    m, data, r = held
    before = m.stats()
    w = os.open(m.path("f"), os.O_RDWR)
    try:
        with mmap.mmap(w, 0) as mp:
            mp[MiB + 10:MiB + 110] = b"m" * 100
            data[MiB + 10:MiB + 110] = b"m" * 100
            mp.flush()
    finally:
        os.close(w)
    after = settled(m, before)
    if mode == "write-back":
        assert after["dirty_bytes"] == BLK
        ctl_flush(m)
        assert m.stats()["destaged_bytes"] - before["destaged_bytes"] == BLK
    else:
        assert after["backing_write_bytes"] - before["backing_write_bytes"] == BLK
    assert (m.backing / "f").read_bytes() == data
    assert os.pread(r, SIZE, 0) == data


def test_bytes_a_mapping_puts_back_after_a_write_through_the_daemon_reach_backing(held, mode):
    """A write through the daemon changes a block (BACKING gets it: write-through at once,
    write-back by a destage), then the mapping writes the block's bytes of the open back: its
    checksum equals the baseline's, yet BACKING holds the write's. The engine's change voids
    the block's baseline, so the block still goes to BACKING."""
    m, data, _ = held
    off = 2 * MiB
    old = bytes(data[off:off + BLK])
    before = m.stats()
    w = os.open(m.path("f"), os.O_RDWR)
    try:
        assert os.pwrite(w, b"n" * BLK, off) == BLK       # a JOINED open: through the daemon
        if mode == "write-back":
            os.fsync(w)
            ctl_flush(m)            # a flush makes a live writer's file dirty whole: BACKING
        assert (m.backing / "f").read_bytes()[off:off + BLK] == b"n" * BLK
        with mmap.mmap(w, 0) as mp:
            mp[off:off + BLK] = old
            mp.flush()
    finally:
        os.close(w)
    settled(m, before)
    if mode == "write-back":
        ctl_flush(m)
    assert (m.backing / "f").read_bytes() == data
