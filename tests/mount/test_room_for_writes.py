"""Write-back writes that need a cache slot while every slot holds dirty data.

The pool counts 64 KiB extents; the dirty marks count bytes. Scattered small writes fill
every slot with an extent holding a few dirty blocks while the dirty bytes stay under
--dirty-low, so the destager, going by bytes and age alone, waited for the write-back delay
(5 s by default) while a writer needing a new slot waited for it: a write took 5 s. Now a
writer waiting for room makes the destager due at once."""

import os
import time

import pytest

from tests.conftest import flush_all

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
