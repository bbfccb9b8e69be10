"""Flow control over a slow BACKING (the bench/ emulator): a write burst several times
--dirty-high completes without error, dirty data stays near the high mark, and drains to
zero after the burst; BACKING ends up with exactly the bytes written."""

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

from tests.conftest import wait_until  # noqa: E402
from tests.conftest import flush_all as flush  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.slow]
MiB = 1 << 20


def test_write_burst_is_slowed_to_backing_speed_and_drains(make_mount, tmp_path):
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    high = 4 * MiB
    with mounted_slowfs(src, slow, latency_ms=1, jitter_ms=0, bandwidth_mbs=16) as sf:
        m = make_mount("--mode", "write-back", "--cache-size", "64M", "--dirty-high", "4M",
                       "--dirty-low", "2M", "--max-dirty-age", "2", backing=slow)
        data = os.urandom(24 * MiB)                 # six times --dirty-high
        done = threading.Event()
        errors = []

        def writer():
            try:
                fd = os.open(m.path("burst"), os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    for off in range(0, len(data), 256 << 10):
                        os.pwrite(fd, data[off:off + (256 << 10)], off)
                finally:
                    os.close(fd)
            except OSError as exc:
                errors.append(exc)
            finally:
                done.set()

        t0 = time.monotonic()
        threading.Thread(target=writer, daemon=True).start()
        peak = 0
        while not done.wait(0.1):
            peak = max(peak, m.stats()["dirty_bytes"])
        burst_s = time.monotonic() - t0
        assert not errors, errors
        s = m.stats()
        print(f"burst {burst_s:.2f} s, peak dirty {peak / MiB:.2f} MiB, destage rate "
              f"{s['destage_rate'] / MiB:.1f} MiB/s, delayed {s['throttled_writes']} writes "
              f"{s['throttle_delay_s']:.2f} s")
        assert s["throttled_writes"] > 0 and s["throttle_delay_s"] > 0
        # within the mark plus the write in flight (what losing the SSD can lose); one
        # sleep per write let it run 30 % over with a busy CPU beside it
        assert peak <= high + (256 << 10), \
            f"dirty peaked at {peak / MiB:.2f} MiB over a 4 MiB mark"
        # the writer ran at about BACKING's speed, not the SSD's
        assert burst_s > 24 / 16 * 0.6, burst_s
        wait_until(lambda: m.stats()["dirty_bytes"] == 0, 30, what="dirty data to drain")
        assert sf.stats()["write_bytes"] >= len(data)
        flush(m)
        m.stop()
    log = m.logs[-1].read_text()                    # an operator sees the episode
    assert "flow control engaged" in log and "flow control released" in log, log[-2000:]
    assert (src / "burst").read_bytes() == data
