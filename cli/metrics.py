"""`cachefs-ctl metrics`: the Prometheus exposition text of one mount, built client-side from
the stats JSON with prometheus_client (a custom Collector on its own CollectorRegistry).

Every sample carries `mount` and `backing` labels, so several mounts on one host written to
node_exporter's textfile directory stay distinct. The latency histogram's `le` bounds are the
powers of two from 2**10 ns (about 1 us) to 2**36 ns (about 69 s): the daemon's log-linear
buckets (cachefs/latency.py) split exactly at powers of two, so these cumulative counts are
exact.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

LE_NS = tuple(1 << k for k in range(10, 37))
TIER_COUNTERS = (("ssd", "hit"), ("backing", "miss"), ("bypass", "bypass"))
COUNTERS = (    # (metric name without cachefs_ and _total, stats key, help)
    ("write_ops", "write_ops", "Write requests."),
    ("write_bytes", "write_bytes", "Bytes written."),
    ("backing_read_ops", "backing_read_ops", "Read calls to BACKING."),
    ("backing_read_bytes", "backing_read_bytes", "Bytes read from BACKING."),
    ("backing_write_ops", "backing_write_ops", "Write calls to BACKING."),
    ("backing_write_bytes", "backing_write_bytes", "Bytes written to BACKING."),
    ("promotions", "promotions", "Extents copied into the cache."),
    ("promotions_dropped", "promotions_dropped", "Promotions given up."),
    ("evictions", "evictions", "Extents evicted."),
    ("stale_files", "stale_files", "Files found changed behind the cache."),
    ("backing_errors", "backing_errors", "Failed BACKING calls."),
    ("cache_errors", "cache_errors", "Failed SSD calls."),
    ("metadata_errors", "metadata_errors", "Failed metadata commits."),
    ("conflicts", "conflicts", "Write-back: BACKING changed while dirty here."),
    ("writes_around", "writes_around", "Write-back writes sent straight to BACKING."),
    ("destage_ops", "destage_ops", "Destage passes."),
    ("destaged_bytes", "destaged_bytes", "Bytes destaged to BACKING."),
    ("destage_errors", "destage_errors", "Failed destage passes."),
    ("throttled_writes", "throttled_writes", "Writes delayed by flow control."),
    ("prefetched_bytes", "prefetched_bytes", "Bytes loaded by prefetch/pin."),
)
GAUGES = (
    ("cache_used_bytes", "cache_used", "Bytes of the SSD cache in use."),
    ("cache_size_bytes", "cache_size", "Size of the SSD cache."),
    ("dirty_bytes", "dirty_bytes", "Write-back data not yet on BACKING."),
    ("files_cached", "files_cached", "Files with cached extents."),
    ("extents_cached", "extents_cached", "Cached extents."),
    ("pinned_bytes", "pinned_bytes", "Resident bytes of pinned files."),
    ("oldest_dirty_age_seconds", "oldest_dirty_age_s", "Age of the oldest dirty data."),
    ("destage_rate_bytes", "destage_rate", "Recent destage rate, bytes per second."),
    ("throttling", "throttling", "1 while flow control slows writers."),
    ("uptime_seconds", "uptime_s", "Seconds since the mount."),
)


class StatsCollector:
    """Yields the metric families of one stats snapshot."""

    def __init__(self, stats: dict):
        self.s = stats

    def collect(self):
        s = self.s
        names = ["mount", "backing"]
        base = [str(s["mountpoint"]), str(s["backing"])]
        ops = CounterMetricFamily("cachefs_read_ops", "Read requests answered, by tier.",
                                  labels=names + ["tier"])
        nbytes = CounterMetricFamily("cachefs_read_bytes", "Bytes read, by tier.",
                                     labels=names + ["tier"])
        for tier, key in TIER_COUNTERS:
            ops.add_metric(base + [tier], s.get(key + "_ops", 0))
            nbytes.add_metric(base + [tier], s.get(key + "_bytes", 0))
        yield ops
        yield nbytes
        for name, key, text in COUNTERS:
            if key in s:
                c = CounterMetricFamily("cachefs_" + name, text, labels=names)
                c.add_metric(base, s[key])
                yield c
        drops = CounterMetricFamily("cachefs_dropped_extents", "Cached extents dropped, by "
                                    "reason.", labels=names + ["reason"])
        for reason, n in s.get("drops", {}).items():
            drops.add_metric(base + [reason], n)
        yield drops
        for name, key, text in GAUGES:
            if s.get(key) is not None:
                g = GaugeMetricFamily("cachefs_" + name, text, labels=names)
                g.add_metric(base, float(s[key]))
                yield g
        health = s.get("backing_health")
        if health:
            g = GaugeMetricFamily("cachefs_backing_healthy", "1 while BACKING answers, 0 "
                                  "while its calls fail (see the daemon log).", labels=names)
            g.add_metric(base, 1.0 if health["state"] == "ok" else 0.0)
            yield g
            c = CounterMetricFamily("cachefs_backing_timeouts", "BACKING calls that ran past "
                                    "--backing-timeout.", labels=names)
            c.add_metric(base, health["timeouts"])
            yield c
            c = CounterMetricFamily("cachefs_backing_failures", "Failed BACKING calls that "
                                    "count against its health, by errno.",
                                    labels=names + ["errno"])
            for name, n in sorted(health["errors"].items()):
                c.add_metric(base + [name], n)
            yield c
        lat = HistogramMetricFamily("cachefs_latency_seconds", "Request latency by tier "
                                    "(ssd_hit, backing_miss, bypass, write, fsync, destage).",
                                    labels=names + ["tier"])
        for tier, h in s.get("latency", {}).items():
            lat.add_metric(base + [tier], _buckets(h), h["sum_ns"] / 1e9)
        yield lat


def _buckets(h: dict) -> list[tuple[str, int]]:
    out = []
    for le in LE_NS:
        out.append((repr(le / 1e9), sum(n for _, hi, n in h["buckets"] if hi <= le)))
    out.append(("+Inf", h["count"]))
    return out


def exposition(stats: dict) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    return generate_latest(registry).decode()
