"""The recent history of one mount: rates over windows, decaying hit ratios, and the samples
`cachefs-ctl stats --plot` draws.

Owns `History`: a task that reads the engine's counters once a second (it only reads them;
the hit path is untouched) into two rings, one sample a second for an hour and one a minute
for a day. From the per-second ring come the read/write rates over the last second, 10 s and
minute; decayed sums of hits and reads (`x = x * exp(-dt / tau) + delta`, as bcache's) give
hit ratios with time constants of 1 minute, 5 minutes, 1 hour and 1 day. A sample is a tuple
in `COLUMNS` order: cumulative counters (rates are differences of two samples), gauges, and
latency percentiles of the requests finished since the sample before (the difference of two
copies of a histogram's buckets). Nothing here is saved: a remount starts a new history (the
lifetime totals are stats.py's).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

import trio

from .latency import percentile_of
from .stats import Stats

COUNTERS = ("read_ops", "read_bytes", "hit_ops", "hit_bytes", "write_ops", "write_bytes",
            "backing_read_ops", "backing_read_bytes", "backing_write_ops",
            "backing_write_bytes")
GAUGES = ("dirty_bytes", "cache_used")       # per-minute samples: dirty is the minute's peak
LATENCY_TIERS = ("ssd_hit", "backing_miss", "write")
LATENCY = tuple(f"{tier}_{q}_ns" for tier in LATENCY_TIERS for q in ("p50", "p99"))
COLUMNS = ("t", *COUNTERS, *GAUGES, *LATENCY)
SECOND_SAMPLES = 3600                        # an hour of per-second samples
MINUTE_SAMPLES = 1440                        # a day of per-minute samples
RATE_WINDOWS = (("1s", 1), ("10s", 10), ("1m", 60))
DECAY_WINDOWS = (("1m", 60), ("5m", 300), ("1h", 3600), ("1d", 86400))
MAX_WINDOW_S = MINUTE_SAMPLES * 60

_T = 0
_I = {name: i for i, name in enumerate(COLUMNS)}
_HIT_OPS, _READ_OPS, _HIT_BYTES, _READ_BYTES = (
    _I["hit_ops"] - 1, _I["read_ops"] - 1, _I["hit_bytes"] - 1, _I["read_bytes"] - 1)
_SLACK_S = 0.5          # a sample this much late still counts as a window's start


class _LatencyBase:
    """A copy of a histogram's buckets at the last sample: the next sample's percentiles are
    those of the difference."""

    __slots__ = ("hist", "count", "counts")

    def __init__(self, hist):
        self.hist = hist
        self.count = hist.count
        self.counts = list(hist.counts)

    def take(self) -> tuple[int | None, int | None]:
        """(p50, p99) in ns of the requests since the last call; (None, None) if none."""
        h = self.hist
        n = h.count - self.count
        if n <= 0:
            return None, None
        delta = [c - p for c, p in zip(h.counts, self.counts)]
        self.count = h.count
        self.counts = list(h.counts)
        return percentile_of(delta, n, 0.5), percentile_of(delta, n, 0.99)


class History:
    """Samples `stats` and `gauges()` (dirty bytes, cache used) on each `tick(now)`; `run`
    ticks once a second on trio's clock."""

    def __init__(self, stats: Stats, gauges: Callable[[], tuple[int, int]],
                 interval_s: float = 1.0):
        self._stats = stats
        self._gauges = gauges
        self.interval_s = interval_s
        self.seconds: deque[tuple] = deque(maxlen=SECOND_SAMPLES)
        self.minutes: deque[tuple] = deque(maxlen=MINUTE_SAMPLES)
        hists = [stats.latency[tier] for tier in LATENCY_TIERS]
        self._sec_lat = [_LatencyBase(h) for h in hists]
        self._min_lat = [_LatencyBase(h) for h in hists]
        self._minute_t0: float | None = None
        self._minute_dirty = 0
        self._prev: tuple | None = None      # counters at the last tick
        self._prev_t = 0.0
        # per decay window: decayed [hit ops, read ops, hit bytes, read bytes]
        self._decayed = {name: [0.0, 0.0, 0.0, 0.0] for name, _ in DECAY_WINDOWS}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Tick now and then every interval; a late wake-up (a stalled loop) skips the ticks
        it missed instead of bursting them."""
        self.tick(trio.current_time())
        task_status.started()
        deadline = trio.current_time()
        while True:
            deadline += self.interval_s
            now = trio.current_time()
            if deadline <= now:
                deadline = now + self.interval_s
            await trio.sleep_until(deadline)
            self.tick(trio.current_time())

    def tick(self, now: float) -> None:
        """Take a sample at time `now` (seconds, monotonic)."""
        s = self._stats
        counters = tuple(getattr(s, name) for name in COUNTERS)
        dirty, used = self._gauges()
        lat = [p for base in self._sec_lat for p in base.take()]
        self.seconds.append((now, *counters, dirty, used, *lat))
        prev = self._prev or (0,) * len(COUNTERS)
        dt = 0.0 if self._prev is None else max(0.0, now - self._prev_t)
        deltas = (counters[_HIT_OPS] - prev[_HIT_OPS], counters[_READ_OPS] - prev[_READ_OPS],
                  counters[_HIT_BYTES] - prev[_HIT_BYTES],
                  counters[_READ_BYTES] - prev[_READ_BYTES])
        for name, tau in DECAY_WINDOWS:
            f = math.exp(-dt / tau)
            d = self._decayed[name]
            for i in range(4):
                d[i] = d[i] * f + deltas[i]
        self._prev, self._prev_t = counters, now
        self._minute_dirty = max(self._minute_dirty, dirty)
        if self._minute_t0 is None or now - self._minute_t0 >= 60 - _SLACK_S:
            lat = [p for base in self._min_lat for p in base.take()]
            self.minutes.append((now, *counters, self._minute_dirty, used, *lat))
            self._minute_t0 = now
            self._minute_dirty = dirty

    def hit_ratios(self) -> dict:
        """{"1m": {"ops": r, "bytes": r}, "5m": ..., "1h": ..., "1d": ...}; None before the
        first read."""
        out = {}
        for name, _ in DECAY_WINDOWS:
            hit_ops, read_ops, hit_bytes, read_bytes = self._decayed[name]
            out[name] = {"ops": round(hit_ops / read_ops, 4) if read_ops > 0 else None,
                         "bytes": round(hit_bytes / read_bytes, 4) if read_bytes > 0 else None}
        return out

    def rates(self) -> dict:
        """Per-second rates over the last 1 s, 10 s and minute (fewer samples just after the
        mount); a window is None before the second sample."""
        return {name: self._rate(w) for name, w in RATE_WINDOWS}

    def _rate(self, window_s: float) -> dict | None:
        ring = self.seconds
        if len(ring) < 2:
            return None
        last = ring[-1]
        start = ring[0]
        limit = last[_T] - window_s + _SLACK_S
        for i in range(len(ring) - 2, -1, -1):      # newest sample old enough
            if ring[i][_T] <= limit:
                start = ring[i]
                break
        dt = last[_T] - start[_T]
        if dt <= 0:
            return None

        def per_s(name: str) -> float:
            return round((last[_I[name]] - start[_I[name]]) / dt, 1)

        reads = last[_I["read_ops"]] - start[_I["read_ops"]]
        return {
            "span_s": round(dt, 3),
            "read_iops": per_s("read_ops"), "read_bytes_per_s": per_s("read_bytes"),
            "write_iops": per_s("write_ops"), "write_bytes_per_s": per_s("write_bytes"),
            "backing_read_bytes_per_s": per_s("backing_read_bytes"),
            "backing_write_bytes_per_s": per_s("backing_write_bytes"),
            "hit_ratio": round((last[_I["hit_ops"]] - start[_I["hit_ops"]]) / reads, 4)
            if reads else None,
        }

    def windows(self) -> dict:
        return {"rates": self.rates(), "hit_ratio": self.hit_ratios()}

    def samples(self, window_s: float, wall_offset_s: float = 0.0) -> dict:
        """The samples of the last `window_s` seconds (per second up to an hour, per minute
        beyond), plus the one before them so differences cover the whole window, as columns
        {name: [values]}; times are monotonic + `wall_offset_s` (pass wall - monotonic to
        get Unix times)."""
        ring = self.seconds if window_s <= SECOND_SAMPLES else self.minutes
        step_s = self.interval_s if ring is self.seconds else 60.0
        rows: list[tuple] = []
        if ring:
            limit = ring[-1][_T] - window_s
            for row in reversed(ring):
                rows.append(row)
                if row[_T] <= limit:
                    break
            rows.reverse()
        cols = {name: [row[i] for row in rows] for i, name in enumerate(COLUMNS)}
        cols["t"] = [round(t + wall_offset_s, 3) for t in cols["t"]]
        return {"step_s": step_s, "window_s": window_s, "columns": cols}
