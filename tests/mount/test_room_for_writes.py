"""Write-back writes that need a cache slot while every slot holds dirty data.

The pool counts 64 KiB extents; the dirty marks count bytes. Scattered small writes fill
every slot with an extent holding a few dirty blocks while the dirty bytes stay under
--dirty-low, so the destager, going by bytes and age alone, waited for the write-back delay
(5 s by default) while a writer needing a new slot waited for it: a write took 5 s. Now a
writer waiting for room makes the destager due at once; and while destaging fails, a write
that needs room goes to BACKING (which takes it or says why) instead of waiting forever."""

import errno
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

from tests.conftest import flush_all, pread_aligned  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.slow]
KiB = 1024


def test_scattered_writes_never_wait_for_the_write_back_delay(make_mount):
    # 1 MiB pool = 16 slots; dirty high 256 KiB, low 128 KiB; write-back delay 5 s
    m = make_mount("--mode", "write-back", "--cache-size", "1M")
    n_ext = 48                                   # three times the slots
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
    expect = bytearray(n_ext * 64 * KiB)
    slowest = 0.0
    try:
        for rnd in range(2):
            for e in range(n_ext):
                off = e * 64 * KiB + rnd * 4 * KiB
                block = bytes([e + 1, rnd + 1]) * 2 * KiB
                t0 = time.monotonic()
                os.pwrite(fd, block, off)
                slowest = max(slowest, time.monotonic() - t0)
                expect[off:off + 4 * KiB] = block
        s = m.stats()
        del expect[(n_ext - 1) * 64 * KiB + 8 * KiB:]     # the file ends after the last write
    finally:
        os.close(fd)
    print(f"slowest write {slowest:.3f} s; {s['throttled_writes']} writes waited for room; "
          f"dirty {s['dirty_bytes'] // KiB} KiB")
    assert slowest < 2.0, f"a 4 KiB write took {slowest:.1f} s waiting for a cache slot"
    flush_all(m)
    with open(m.backing / "f", "rb") as f:
        assert f.read() == bytes(expect)
    with open(m.path("f"), "rb") as f:
        assert f.read() == bytes(expect)


def test_a_write_needing_room_while_destaging_fails_gets_the_error_not_a_hang(make_mount,
                                                                             tmp_path):
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    with mounted_slowfs(src, slow, latency_ms=0.2, jitter_ms=0) as sf:
        m = make_mount("--mode", "write-back", "--cache-size", "1M", backing=slow)
        fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
        result: list = []
        try:
            sf.set(eio=1)                        # BACKING fails every read and write
            for e in range(16):                  # every slot of the pool dirty (on the SSD)
                os.pwrite(fd, bytes([e + 1]) * 4 * KiB, e * 64 * KiB)


            def needs_room():
                try:
                    result.append(os.pwrite(fd, b"x" * 4 * KiB, 16 * 64 * KiB))
                except OSError as exc:
                    result.append(exc)

            t = threading.Thread(target=needs_room, daemon=True)
            t0 = time.monotonic()
            t.start()
            t.join(20)
            print(f"the write needing room ended after {time.monotonic() - t0:.1f} s")
            stuck = t.is_alive()
            sf.set(eio=0)                        # lets a stuck write finish, for clean-up
            t.join(60)
            assert not stuck, "a write needing room hung while destaging failed"
            assert isinstance(result[0], OSError) and result[0].errno == errno.EIO, result
            os.pwrite(fd, b"y" * 4 * KiB, 16 * 64 * KiB)     # BACKING is back: accepted
        finally:
            sf.set(eio=0)
            os.close(fd)
        t0 = time.monotonic()
        flush_all(m)
        print(f"flush after recovery {time.monotonic() - t0:.1f} s")
        data = (slow / "f").read_bytes()
        for e in range(16):
            assert data[e * 64 * KiB:e * 64 * KiB + 4 * KiB] == bytes([e + 1]) * 4 * KiB
        assert data[16 * 64 * KiB:] == b"y" * 4 * KiB
        m.stop()                                 # before its BACKING goes away


def test_a_partial_write_racing_a_promotion_of_its_extent_does_not_stall(make_mount, tmp_path):
    """A read miss promotes its extent (a slow BACKING read with the fill marked); a partial
    write to the same extent meanwhile fills it too, and the promotion's install comes first.
    The write's own install is then refused as overtaken: it used to wait for the destager
    (0.5 s, with nothing dirty); now it looks again at once and finds the extent cached."""
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    data = bytearray(os.urandom(16 * 64 * KiB))
    (src / "f").write_bytes(bytes(data))
    with mounted_slowfs(src, slow, latency_ms=30, jitter_ms=0):
        m = make_mount("--mode", "write-back", "--promote-after", "1", backing=slow)
        rfd = os.open(m.path("f"), os.O_RDONLY | os.O_DIRECT)
        wfd = os.open(m.path("f"), os.O_WRONLY)
        slowest = 0.0
        try:
            for e in range(16):
                reader = threading.Thread(target=pread_aligned, args=(rfd, 4 * KiB, e * 64 * KiB))
                reader.start()
                time.sleep(0.01)                 # the promotion's BACKING read is under way
                off = e * 64 * KiB + 8 * KiB + 100
                t0 = time.monotonic()
                os.pwrite(wfd, b"w" * 100, off)
                slowest = max(slowest, time.monotonic() - t0)
                data[off:off + 100] = b"w" * 100
                reader.join(30)
        finally:
            os.close(rfd)
            os.close(wfd)
        print(f"slowest partial write {slowest:.3f} s")
        assert slowest < 0.3, f"a 100-byte write took {slowest:.2f} s"
        flush_all(m)
        assert (slow / "f").read_bytes() == bytes(data)
        m.stop()


def test_a_pool_remounted_smaller_than_its_dirty_data_comes_down_to_its_size(make_mount):
    """A mount with a smaller --cache-size than the dirty data it finds keeps that data (it
    is BACKING's only copy) but dropped the pool back to its size only at the next mount:
    once destaged it stayed over it for the whole mount (a helper's hunt: 24 MiB of an 8
    MiB pool). A destage now evicts what is over the size once it is clean."""
    m = make_mount("--mode", "write-back", "--cache-size", "64M", "--dirty-high", "48M",
                   "--dirty-low", "40M", "--max-dirty-age", "1h")
    data = os.urandom(24 << 20)
    with open(m.path("f"), "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    assert m.stats()["dirty_bytes"] == len(data)
    m.stop()
    m.args = ["--mode", "write-back", "--cache-size", "8M"]
    m.start()
    s = m.stats()           # all kept: dirty, or destaged already (a fast BACKING: tmpfs)
    assert s["dirty_bytes"] + s["destaged_bytes"] == len(data), s
    flush_all(m)
    s = m.stats()
    assert s["dirty_bytes"] == 0
    assert s["cache_used"] <= 8 << 20, s["cache_used"]
    assert (m.backing / "f").read_bytes() == data
