"""Write-back ages: an extent rewritten during every destage pass is not "old" forever.

What a destage pass leaves dirty was written after the pass's snapshot, so it ages from the
snapshot (DirtyIndex.restamp). Before, such an extent kept the time it first turned dirty:
`oldest_dirty_age_s` grew without bound under a steady rewrite of one block (a database
header, a log's tail) and the destager, seeing data always older than its write-back delay,
destaged that block back to back instead of letting rewrites coalesce for the delay."""

import os
import threading
import time

import pytest

from tests.conftest import flush_all

pytestmark = [pytest.mark.fuse, pytest.mark.slow]


def test_hot_rewritten_extent_ages_from_the_last_destage(make_mount):
    # --max-dirty-age 4: the write-back delay is min(5 s, 4 / 2) = 2 s
    m = make_mount("--mode", "write-back", "--cache-size", "64M", "--max-dirty-age", "4")
    stop = threading.Event()
    written = [0]

    def rewriter():
        fd = os.open(m.path("hot"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while not stop.is_set():
                written[0] += 1
                os.pwrite(fd, written[0].to_bytes(8, "little") * 512, 0)
        finally:
            os.close(fd)

    t = threading.Thread(target=rewriter, daemon=True)
    t.start()
    try:
        time.sleep(1)
        first = m.stats()
        oldest = 0.0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 9:
            oldest = max(oldest, m.stats()["oldest_dirty_age_s"])
            time.sleep(0.3)
        last = m.stats()
    finally:
        stop.set()
        t.join(10)
    passes = last["destage_ops"] - first["destage_ops"]
    print(f"{written[0]} rewrites; {passes} destage passes in ~9 s; oldest dirty age seen "
          f"{oldest:.1f} s")
    assert written[0] > 1000
    assert oldest < 4.0, f"oldest dirty data looked {oldest:.1f} s old with a 2 s delay"
    assert 2 <= passes <= 12, f"{passes} destage passes for one rewritten block in 9 s"
    flush_all(m)
    with open(m.backing / "hot", "rb") as f:
        assert f.read() == written[0].to_bytes(8, "little") * 512
