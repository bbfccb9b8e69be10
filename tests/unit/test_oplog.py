"""The operator's log helpers: the rate limiter (one line per key per minute, with the count
of what it held back; an injected clock) and the mount and unmount summaries."""

from __future__ import annotations

import logging

from cachefs import oplog


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_rate_limited_log_one_line_per_minute_per_key(caplog):
    clock = Clock()
    limited = oplog.RateLimitedLog(logging.getLogger("cachefs.test"), clock=clock)
    with caplog.at_level(logging.INFO, logger="cachefs.test"):
        assert limited.warning("a", "BACKING read of %s failed", "x")
        for _ in range(3):
            clock.t += 10
            assert not limited.warning("a", "BACKING read of %s failed", "y")
        assert limited.info("b", "another key")             # keys are independent
        clock.t += 31                                        # 61 s after the first line
        assert limited.warning("a", "BACKING read of %s failed", "z")
        clock.t += 1
        assert not limited.warning("a", "BACKING read of %s failed", "w")
        limited.flush()
        limited.flush()                                      # nothing left: no line
    assert [r.getMessage() for r in caplog.records] == [
        "BACKING read of x failed",
        "another key",
        "BACKING read of z failed (3 similar lines suppressed in the last 1 min)",
        "BACKING read of w failed (and 1 similar line suppressed)",
    ]
    assert caplog.records[0].levelno == logging.WARNING


def test_rate_limited_log_bounds_its_keys(caplog):
    clock = Clock()
    limited = oplog.RateLimitedLog(logging.getLogger("cachefs.test"), clock=clock, max_keys=4)
    with caplog.at_level(logging.INFO, logger="cachefs.test"):
        for i in range(10):
            limited.info(i, "event %d", i)
            limited.info(i, "event %d again", i)             # held back
            assert len(limited._last) <= 4
        limited.flush()
    texts = [r.getMessage() for r in caplog.records]
    assert [t for t in texts if "again" not in t] == [f"event {i}" for i in range(10)]
    # every held line was reported, either when its key was forgotten or by flush
    assert sum("again" in r.getMessage() for r in caplog.records) == 10


SNAP = {"backing": "/srv/slow", "mountpoint": "/mnt/fast", "cache_dir": "/ssd/c",
        "mode": "write-back", "cache_size": 64 << 20, "cache_used": 1 << 20,
        "extents_cached": 16, "dirty_high": 16 << 20, "dirty_low": 8 << 20,
        "dirty_bytes": 1 << 20, "pinned_files": 0, "uptime_s": 7325.0, "read_ops": 10,
        "read_bytes": 40960, "hit_ratio": 0.5, "write_ops": 3, "write_bytes": 12288,
        "backing_errors": 1, "cache_errors": 0, "destage_errors": 2}


def test_mount_and_unmount_lines():
    assert oplog.mount_line(SNAP) == (
        "mounted /srv/slow on /mnt/fast (write-back): cache 64.0 MiB in /ssd/c, 1.0 MiB in 16 "
        "extents warm; dirty high 16.0 MiB, low 8.0 MiB, 1.0 MiB dirty now")
    assert oplog.unmount_line(SNAP) == (
        "unmounted /mnt/fast (write-back) after 2 h 2 min: 10 reads (40.0 KiB, hit ratio "
        "50.0 %), 3 writes (12.0 KiB); cache 1.0 MiB of 64.0 MiB; 1.0 MiB dirty kept on the "
        "SSD, destaged after the next mount; errors: BACKING 1, cache 0, destage 2; metadata "
        "persisted")
    wt = {**SNAP, "mode": "write-through", "dirty_bytes": 0, "backing_errors": 0,
          "destage_errors": 0, "uptime_s": 5}
    assert oplog.mount_line(wt).endswith("1.0 MiB in 16 extents warm")
    assert oplog.unmount_line(wt).endswith("cache 1.0 MiB of 64.0 MiB; metadata persisted")
