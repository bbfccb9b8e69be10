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
import threading
import time

import pytest

from tests.conftest import ctl_flush, wait_until
from tests.mount.test_passthrough import (MiB, _available, _slow_source, cache_fully,
                                          open_passthrough)

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
        try:
            os.close(r)
        except OSError:             # the test closed it
            pass


def assert_same(got: bytes, want: bytes, what: str) -> None:
    """Compare files of megabytes without pytest's diff of them (minutes of difflib)."""
    if got != want:
        first = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]),
                     min(len(got), len(want)))
        raise AssertionError(f"{what}: {len(got)} bytes, {len(want)} expected; the first "
                             f"difference at byte {first}")


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
            assert_same(mp[:SIZE], data, "the mapping")
    finally:
        os.close(w)
    after = settled(m, before)
    assert after["dirty_bytes"] == 0
    assert after["backing_write_bytes"] == before["backing_write_bytes"]
    ctl_flush(m)
    assert m.stats()["destaged_bytes"] == before["destaged_bytes"]
    assert os.stat(m.backing / "f").st_mtime_ns == mtime
    assert_same((m.backing / "f").read_bytes(), data, "BACKING")


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
    assert_same((m.backing / "f").read_bytes(), data, "BACKING")
    assert_same(os.pread(r, SIZE, 0), data, "the reader")


def test_a_mapping_write_moves_the_mtime_and_backing_gets_it(held, mode):
    """Write-back turned the blocks a mapping changed dirty but kept the file's mtime: the
    mount showed the one from before, and so did BACKING after the destage (a helper's
    differential hunt: ext4 and write-through move it; rsync -a and make miss the change)."""
    m, data, _ = held
    before_mtime = os.stat(m.path("f")).st_mtime_ns
    time.sleep(0.05)
    before = m.stats()
    w = os.open(m.path("f"), os.O_RDWR)
    try:
        with mmap.mmap(w, 0) as mp:
            mp[10:20] = b"x" * 10
            mp.flush()
    finally:
        os.close(w)
    settled(m, before)
    time.sleep(0.3)                             # past --attr-timeout
    shown = os.stat(m.path("f"))
    assert shown.st_mtime_ns > before_mtime
    assert shown.st_ctime_ns >= shown.st_mtime_ns
    ctl_flush(m)
    assert os.stat(m.backing / "f").st_mtime_ns == os.stat(m.path("f")).st_mtime_ns


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
    assert_same((m.backing / "f").read_bytes(), data, "BACKING")


def test_a_new_open_after_backing_changed_under_a_reader_maps_the_new_bytes(held, mode):
    """BACKING changes under a file a reader holds in passthrough. The kernel makes every
    later open of the inode use the reader's backing file (the cache file) until the reader
    closes (any other open fails with EIO): its cache file used to be set aside for that
    reader, so a new open read the new bytes through cachefs, but its mmap mapped the old
    ones, and what it wrote through a shared mapping was lost (a helper's hunt). The cache
    file is now read again from BACKING before the new open is answered."""
    m, data, r = held
    before = m.stats()
    with open(m.backing / "f", "r+b") as f:            # someone else changes BACKING
        f.seek(3 * BLK)
        f.write(b"X" * BLK)
    data[3 * BLK:4 * BLK] = b"X" * BLK
    fd = os.open(m.path("f"), os.O_RDWR)
    try:
        assert os.pread(fd, BLK, 3 * BLK) == b"X" * BLK          # the new bytes
        with mmap.mmap(fd, SIZE) as mp:
            mp[10 * BLK:11 * BLK] = b"W" * BLK
            mp.flush()
            data[10 * BLK:11 * BLK] = b"W" * BLK
            mapped_new = mp[3 * BLK:4 * BLK] == b"X" * BLK
        assert os.pread(r, BLK, 3 * BLK) == b"X" * BLK   # the reader: the new bytes too
    finally:
        os.close(fd)
    assert m.stats()["passthrough_refreshed"] == before["passthrough_refreshed"] + 1
    os.close(r)
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 10, what="the release")
    if mode == "write-back":
        ctl_flush(m)
    assert_same((m.backing / "f").read_bytes(), data, "BACKING")
    assert mapped_new


@pytest.mark.parametrize("new_size", [SIZE // 2 + 100, SIZE + 3 * MiB + 5])
def test_backing_shrunk_or_grown_under_a_reader_is_read_again_before_the_next_open(
        held, mode, new_size):
    """The same when BACKING's file is cut or extended behind the mount: a new open (read
    only here: its mmap maps the cache file as well) and the reader see BACKING's bytes,
    nothing past its end; extents past the new end leave the pool."""
    m, data, r = held
    new = bytes(data[:min(SIZE, new_size)]) + os.urandom(max(0, new_size - SIZE))
    with open(m.backing / "f", "r+b") as f:
        f.truncate(new_size)
        f.seek(0)
        f.write(new)
    fd = os.open(m.path("f"), os.O_RDONLY)
    try:
        assert os.fstat(fd).st_size == new_size
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mp:
            assert_same(mp[:], new, "the new open's mapping")
        assert_same(os.pread(fd, 2 * SIZE, 0), new, "the new open")
        assert_same(os.pread(r, 2 * SIZE, 0), new, "the reader")
    finally:
        os.close(fd)
    assert m.stats()["cache_used"] == (new_size + 65535) // 65536 * 65536
    os.close(r)
    wait_until(lambda: m.stats()["passthrough_held_files"] == 0, 10, what="the release")
    assert_same(m.path("f").read_bytes(), new, "a read after the release")
    assert_same((m.backing / "f").read_bytes(), new, "BACKING")


def test_an_o_rdwr_open_during_the_last_ones_copy_keeps_its_mark(make_mount, tmp_path):
    """Write-through, a slow BACKING: the copy of what writer A's mapping changed takes
    seconds; writer B opens O_RDWR meanwhile, maps the file and msyncs a write. A's copy,
    when done, removed the file's mark B's open had put back, so a kill -9 while B mapped
    the file left B's bytes in the cache file as clean data BACKING never got (a helper's
    hunt; in write-back the window is the read of the cache file)."""
    size = 4 * MiB
    src, slow, data, mounted_slowfs = _slow_source(tmp_path, size)
    with mounted_slowfs(src, slow, latency_ms=0, jitter_ms=0) as sf:
        m = make_mount("--attr-timeout", "0.2", backing=slow)
        cache_fully(m, "f", size)
        r = open_passthrough(m, "f")
        try:
            before = m.stats()
            sf.set(bandwidth_mbs=1)                     # A's copy: ~4 s
            a = os.open(m.path("f"), os.O_RDWR)
            try:
                with mmap.mmap(a, size) as mp:
                    for off in range(0, size, BLK):
                        data[off] ^= 0xFF
                        mp[off] = data[off]
                    mp.flush()
            finally:
                os.close(a)
            settled(m, before)                          # A's copy is under way
            b = os.open(m.path("f"), os.O_RDWR)
            mp = mmap.mmap(b, size)
            mp[5 * BLK:6 * BLK] = data[5 * BLK:6 * BLK] = b"B" * BLK
            mp.flush()                                  # durable in the cache file
            wait_until(lambda: "bytes a shared mapping wrote copied to BACKING"
                       in m.logs[-1].read_text(), 30, m.proc, "A's copy")
            time.sleep(1.5)                             # a commit after it
            m.kill()
            mp.close()
            os.close(b)
        finally:
            os.close(r)
        sf.set(bandwidth_mbs=0)
        m.start()
        assert "was mapped shared and writable" in m.logs[-1].read_text()
        m.stop()
    assert_same((src / "f").read_bytes(), data, "BACKING")


def test_a_mapping_write_during_a_destage_of_its_block_is_not_lost(make_mount, tmp_path):
    """Write-back, BACKING hung in the middle of a destage pass: a flush made the file
    dirty whole (an O_RDWR open was mapping it) and the pass read block 1 before the mapping
    wrote it. The mapping's end was taken while the pass was still out (block 1 dirty: left
    to the destager), then the pass cleaned block 1 with its older bytes: BACKING never got
    the mapping's write, and an eviction would lose it. The end of a mapping now marks the
    file's dirty blocks rewritten since the pass's snapshot (redirty), as a write does."""
    size = MiB
    src, slow, data, mounted_slowfs = _slow_source(tmp_path, size)
    with mounted_slowfs(src, slow, latency_ms=0, jitter_ms=0) as sf:
        m = make_mount("--mode", "write-back", "--attr-timeout", "0.2", "--cache-size", "64M",
                       "--dirty-high", "48M", "--dirty-low", "40M", "--max-dirty-age", "1h",
                       backing=slow)
        cache_fully(m, "f", size)
        r = open_passthrough(m, "f")
        flushed = []
        try:
            w = os.open(m.path("f"), os.O_RDWR)
            mp = mmap.mmap(w, size)
            sf.set(hang=1)
            t = threading.Thread(target=lambda: flushed.append(ctl_flush(m, 120)))
            t.start()
            try:
                time.sleep(1.5)                     # the pass has read the file, BACKING hangs
                mp[BLK:2 * BLK] = data[BLK:2 * BLK] = b"w" * BLK
                mp.flush()
                mp.close()
                os.close(w)
                time.sleep(3 * 1.0 + 0.5)           # the hold check takes the mapping's end
            finally:
                sf.set(hang=0)
                t.join(150)
            assert flushed, "the flush did not finish"
            wait_until(lambda: "written through a shared mapping are dirty"
                       in m.logs[-1].read_text(), 15, m.proc, "the mapping's end")
            ctl_flush(m)
            assert_same((src / "f").read_bytes(), data, "BACKING")
            assert_same(os.pread(r, size, 0), data, "the reader")
        finally:
            os.close(r)
        m.stop()


def test_a_flush_copies_what_a_live_mapping_wrote_so_far(held, mode):
    """Write-through: a flush while an O_RDWR open still maps the file (or a program that
    msync'd and exited, its release not yet taken) copied nothing, and BACKING lacked the
    mapping's bytes after the flush (a helper's fio hunt, ioengine=mmap beside a reader).
    Write-back made the file dirty whole for that flush already."""
    m, data, r = held
    w = os.open(m.path("f"), os.O_RDWR)
    try:
        with mmap.mmap(w, 0) as mp:
            mp[3 * MiB:3 * MiB + BLK] = data[3 * MiB:3 * MiB + BLK] = b"f" * BLK
            mp.flush()
            ctl_flush(m)
            assert_same((m.backing / "f").read_bytes(), data, "BACKING after the flush")
            mp[BLK:2 * BLK] = data[BLK:2 * BLK] = b"g" * BLK     # after it: at the end
            mp.flush()
    finally:
        os.close(w)
    before = m.stats()
    wait_until(lambda: m.stats()["passthrough_syncs"] > before["passthrough_syncs"]
               or (mode == "write-back" and m.stats()["dirty_bytes"] > 0), 10,
               what="the mapping's end")
    ctl_flush(m)
    assert_same((m.backing / "f").read_bytes(), data, "BACKING at the end")
    assert_same(os.pread(r, SIZE, 0), data, "the reader")
