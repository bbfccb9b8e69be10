"""cachefs/history.py: rates over windows, decaying hit ratios, the rings and their per-minute
aggregation, latency percentiles per interval; time injected into `tick` or driven by trio's
MockClock through `History.run`."""

from __future__ import annotations

import math

import trio

from cachefs.history import (COLUMNS, MINUTE_SAMPLES, SECOND_SAMPLES, History)
from cachefs.latency import bucket_bounds, bucket_of
from cachefs.stats import Stats


def _history(dirty=None):
    stats = Stats()
    gauges = dirty if dirty is not None else (lambda: (0, 0))
    return stats, History(stats, gauges)


def _reads(stats: Stats, n: int, hit: bool, size: int = 4096) -> None:
    stats.read_ops += n
    stats.read_bytes += n * size
    if hit:
        stats.hit_ops += n
        stats.hit_bytes += n * size


def _expected(tau: float) -> float:
    """The ratio after 5 min of hits then 5 min of misses at a constant rate: a / (1 + a)
    with a = exp(-300 / tau) (the same for per-second steps as for continuous decay)."""
    a = math.exp(-300 / tau)
    return a / (1 + a)


async def test_decaying_ratios_under_mock_clock(autojump_clock):
    """5 min of all-hit traffic, then 5 min of all-miss: the 1-minute ratio follows the
    misses, the 1-day one barely moves from the mount's average."""
    stats, h = _history()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.run)
        t0 = trio.current_time()
        assert h.hit_ratios()["1m"] == {"ops": None, "bytes": None}
        await trio.sleep(0.5)                   # traffic between ticks, never at one
        for _ in range(300):
            _reads(stats, 100, hit=True)
            await trio.sleep(1)
        r = h.hit_ratios()
        assert all(r[w] == {"ops": 1.0, "bytes": 1.0} for w in ("1m", "5m", "1h", "1d"))
        for _ in range(300):
            _reads(stats, 100, hit=False, size=8192)
            await trio.sleep(1)
        await trio.sleep(1)
        r = h.hit_ratios()
        assert 600 <= len(h.seconds) <= 603 and trio.current_time() - t0 < 603
        nursery.cancel_scope.cancel()
    assert r["1m"]["ops"] < 0.05
    for w, tau in (("1m", 60), ("5m", 300), ("1h", 3600), ("1d", 86400)):
        assert abs(r[w]["ops"] - _expected(tau)) < 0.003, (w, r[w], _expected(tau))
    assert 0.26 < r["5m"]["ops"] < 0.28
    assert 0.47 < r["1h"]["ops"] < 0.49
    assert 0.498 < r["1d"]["ops"] < 0.5
    # misses were twice as large: the byte ratio weighs them double, a / (a + 2)
    a = math.exp(-300 / 3600)
    assert abs(r["1h"]["bytes"] - a / (a + 2)) < 0.003


def test_rates_drop_to_zero_1s_first_then_the_minute():
    stats, h = _history()
    t = 1000.0
    h.tick(t)
    assert h.rates() == {"1s": None, "10s": None, "1m": None}
    for _ in range(120):                         # 2 min at 50 reads/s (half hits), 10 writes/s
        t += 1
        _reads(stats, 25, hit=True)
        _reads(stats, 25, hit=False)
        stats.write_ops += 10
        stats.write_bytes += 10 * 65536
        h.tick(t)
    r = h.rates()
    for w, span in (("1s", 1), ("10s", 10), ("1m", 60)):
        assert r[w]["span_s"] == span
        assert r[w]["read_iops"] == 50 and r[w]["read_bytes_per_s"] == 50 * 4096
        assert r[w]["write_iops"] == 10 and r[w]["write_bytes_per_s"] == 10 * 65536
        assert r[w]["hit_ratio"] == 0.5
    t += 1
    h.tick(t)                                    # traffic stops
    r = h.rates()
    assert r["1s"]["read_iops"] == 0 and r["1s"]["hit_ratio"] is None
    assert r["10s"]["read_iops"] == 45 and r["1m"]["read_iops"] == round(50 * 59 / 60, 1)
    for _ in range(9):
        t += 1
        h.tick(t)
    assert h.rates()["10s"]["read_iops"] == 0 and h.rates()["1m"]["read_iops"] > 0
    for _ in range(50):
        t += 1
        h.tick(t)
    r = h.rates()
    assert all(r[w]["read_iops"] == 0 and r[w]["write_iops"] == 0 for w in r)


def test_rates_right_after_mount_use_the_samples_there_are():
    stats, h = _history()
    h.tick(0.0)
    _reads(stats, 30, hit=True)
    h.tick(1.0)
    _reads(stats, 30, hit=True)
    h.tick(2.0)
    r = h.rates()
    assert r["1s"]["read_iops"] == 30 and r["1s"]["span_s"] == 1
    assert r["10s"]["read_iops"] == 30 and r["10s"]["span_s"] == 2
    assert r["1m"] == r["10s"]


def test_a_late_tick_still_counts_as_a_window_start():
    """Sample times jitter: a window's start is the newest sample at most half a second
    later than now - window, and rates divide by the real time between the samples."""
    stats, h = _history()
    h.tick(0.0)
    _reads(stats, 100, hit=True)
    h.tick(1.3)
    _reads(stats, 100, hit=True)
    h.tick(2.0)
    r = h.rates()
    assert r["1s"]["span_s"] == 0.7 and r["1s"]["read_iops"] == round(100 / 0.7, 1)


def test_rings_keep_an_hour_of_seconds_and_a_day_of_minutes():
    stats, h = _history()
    for i in range(SECOND_SAMPLES + 100):
        h.tick(float(i))
    assert len(h.seconds) == SECOND_SAMPLES
    assert h.seconds[0][0] == 100.0 and h.seconds[-1][0] == SECOND_SAMPLES + 99
    assert len(h.minutes) == (SECOND_SAMPLES + 99) // 60 + 1
    assert [m[0] for m in list(h.minutes)[:3]] == [0.0, 60.0, 120.0]
    stats2, h2 = _history()
    for i in range(0, (MINUTE_SAMPLES + 10) * 60, 30):      # late ticks: every 30 s
        h2.tick(float(i))
    assert len(h2.minutes) == MINUTE_SAMPLES
    assert h2.minutes[-1][0] - h2.minutes[0][0] == (MINUTE_SAMPLES - 1) * 60


def test_minute_samples_aggregate_the_seconds():
    stats = Stats()
    gauge = {"dirty": 0, "used": 0}
    h = History(stats, lambda: (gauge["dirty"], gauge["used"]))
    col = {name: i for i, name in enumerate(COLUMNS)}
    h.tick(0.0)
    for i in range(1, 61):
        _reads(stats, 10, hit=i % 2 == 0)
        gauge["dirty"] = 5 << 20 if i == 30 else 1 << 20       # a peak mid-minute
        gauge["used"] = i << 16
        if i <= 30:
            stats.lat_hit.add(1000)
        else:
            stats.lat_hit.add(1_000_000)
        h.tick(float(i))
    assert len(h.minutes) == 2
    m = h.minutes[-1]
    assert m[col["t"]] == 60.0 and m[col["read_ops"]] == 600 and m[col["hit_ops"]] == 300
    assert m[col["dirty_bytes"]] == 5 << 20 and m[col["cache_used"]] == 60 << 16
    assert m[col["ssd_hit_p50_ns"]] == bucket_bounds(bucket_of(1000))[1]
    assert m[col["ssd_hit_p99_ns"]] == bucket_bounds(bucket_of(1_000_000))[1]
    assert m[col["backing_miss_p50_ns"]] is None
    s = h.seconds[-1]                         # the second sample: that second's requests only
    assert s[col["ssd_hit_p50_ns"]] == s[col["ssd_hit_p99_ns"]] == \
        bucket_bounds(bucket_of(1_000_000))[1]
    assert s[col["dirty_bytes"]] == 1 << 20


def test_latency_percentiles_are_of_the_interval_only():
    stats, h = _history()
    h.tick(0.0)
    for _ in range(99):
        stats.lat_miss.add(2_000_000)
    stats.lat_miss.add(50_000_000)
    stats.lat_write.add(30_000)
    h.tick(1.0)
    for _ in range(10):
        stats.lat_miss.add(100_000)
    h.tick(2.0)
    h.tick(3.0)
    col = {name: i for i, name in enumerate(COLUMNS)}
    one, two, three = list(h.seconds)[1:]
    assert one[col["backing_miss_p50_ns"]] == bucket_bounds(bucket_of(2_000_000))[1]
    assert one[col["backing_miss_p99_ns"]] == bucket_bounds(bucket_of(2_000_000))[1]
    assert one[col["write_p50_ns"]] == bucket_bounds(bucket_of(30_000))[1]
    assert two[col["backing_miss_p50_ns"]] == two[col["backing_miss_p99_ns"]] == \
        bucket_bounds(bucket_of(100_000))[1]
    assert two[col["write_p50_ns"]] is None
    assert three[col["backing_miss_p50_ns"]] is None and three[col["ssd_hit_p99_ns"]] is None


def test_samples_pick_the_ring_and_add_the_baseline():
    stats, h = _history()
    for i in range(200):
        _reads(stats, 1, hit=True)
        h.tick(float(i))
    out = h.samples(10, wall_offset_s=1_000_000.0)
    assert out["step_s"] == 1 and set(out["columns"]) == set(COLUMNS)
    assert out["columns"]["t"] == [1_000_000.0 + t for t in range(189, 200)]
    assert out["columns"]["read_ops"] == list(range(190, 201))
    out = h.samples(7200)
    assert out["step_s"] == 60 and out["columns"]["t"] == [0.0, 60.0, 120.0, 180.0]
    assert len(h.samples(3600)["columns"]["t"]) == 200
    empty = History(Stats(), lambda: (0, 0)).samples(60)
    assert empty["columns"]["t"] == [] and empty["columns"]["ssd_hit_p50_ns"] == []


def test_parse_duration():
    import pytest

    from cachefs.errors import UserError
    from cachefs_cli.ctl import parse_duration
    assert [parse_duration(x) for x in ("30s", "10m", "10min", "1h", "1d", "90", "1.5h")] == \
        [30, 600, 600, 3600, 86400, 90, 5400]
    for bad in ("0s", "2d", "1w", "", "h", "-1m"):
        with pytest.raises(UserError):
            parse_duration(bad)


def test_plot_draws_both_rings(tmp_path):
    """cli/plot.py on a synthetic history: per-second and per-minute samples, latency gaps
    (None), and an empty history."""
    from cachefs_cli import plot
    stats, h = _history(lambda: (stats.write_bytes // 2, stats.read_bytes))
    for i in range(7200):
        if i % 3:
            _reads(stats, 20, hit=i > 600)
            stats.lat_hit.add(8000 + i)
            stats.write_ops += 1
            stats.write_bytes += 4096
        h.tick(float(i))
    for window in (300, 86400):
        out = tmp_path / f"{window}.png"
        n = plot.draw(h.samples(window, 1.7e9), str(out), "test")
        assert n == (301 if window == 300 else 120)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.png"
    assert plot.draw(History(Stats(), lambda: (0, 0)).samples(60), str(empty), "t") == 0
    assert empty.stat().st_size > 0
