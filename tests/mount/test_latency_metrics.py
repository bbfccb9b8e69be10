"""Latency histograms per tier (`cachefs-ctl stats --json` key "latency", percentiles in the
text output) and `cachefs-ctl metrics` (Prometheus exposition text) on real mounts."""

from __future__ import annotations

import mmap
import os
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import CTL, wait_until
from tests.mount.test_lifetime_stats import _read_direct

# These count the reads the daemon answers: FUSE passthrough reads never reach it.
pytestmark = [pytest.mark.fuse, pytest.mark.no_passthrough]

SIZE = 1 << 20


def _ctl(*args: str) -> str:
    out = subprocess.run([*CTL, *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _bucket_total(h: dict) -> int:
    return sum(n for _, _, n in h["buckets"])


def test_histograms_move_on_misses_hits_writes_and_fsync(make_mount, mode):
    m = make_mount("--mode", mode, "--promote-after", "1")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    lat = m.stats()["latency"]
    assert all(h["count"] == 0 and h["buckets"] == [] for h in lat.values())
    assert _read_direct(m.path("f"), SIZE) == data             # misses, promoted
    wait_until(lambda: m.stats()["extents_cached"] >= 1, 20, m.proc, "the promotion")
    s = m.stats()
    miss = s["latency"]["backing_miss"]
    assert miss["count"] == s["miss_ops"] > 0
    assert _bucket_total(miss) == miss["count"] and miss["sum_ns"] > 0
    assert miss["p50_ns"] <= miss["p90_ns"] <= miss["p99_ns"] <= miss["p99.9_ns"]
    hits_before = s["latency"]["ssd_hit"]["count"]
    assert _read_direct(m.path("f"), SIZE) == data             # hits
    s = m.stats()
    hit = s["latency"]["ssd_hit"]
    assert hit["count"] == s["hit_ops"] > hits_before
    assert _bucket_total(hit) == hit["count"]
    for lo, hi, n in hit["buckets"]:
        assert 0 <= lo < hi and n > 0

    fd = os.open(m.path("g"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        buf = mmap.mmap(-1, 65536)
        buf.write(os.urandom(65536))
        os.pwritev(fd, [buf], 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    s = m.stats()
    assert s["latency"]["write"]["count"] >= 1
    assert s["latency"]["fsync"]["count"] >= 1
    if mode == "write-back":
        wait_until(lambda: m.stats()["latency"]["destage"]["count"] >= 1, 30, m.proc,
                   "a destage")

    text = _ctl("stats", str(m.mnt))
    assert "latency" in text and "SSD hit" in text and "BACKING miss" in text


def test_bypass_histogram_moves_on_a_sequential_stream(make_mount):
    m = make_mount("--mode", "write-through", "--sequential-cutoff", "256K")
    data = os.urandom(4 * SIZE)
    (m.backing / "f").write_bytes(data)
    assert _read_direct(m.path("f"), len(data)) == data
    s = m.stats()
    bypass = s["latency"]["bypass"]
    assert bypass["count"] == s["bypass_ops"] > 0
    assert s["latency"]["backing_miss"]["count"] == s["miss_ops"] > 0
    assert _bucket_total(bypass) == bypass["count"]


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_exposition_parses_with_labels(make_mount):
    m = make_mount("--mode", "write-back", "--promote-after", "1")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    assert _read_direct(m.path("f"), SIZE) == data
    # every extent: a promotion still going on moves cache_used between `s` and the metrics
    wait_until(lambda: m.stats()["extents_cached"] >= SIZE >> 16, 20, m.proc, "the promotion")
    assert _read_direct(m.path("f"), SIZE) == data
    s = m.stats()
    fams = _families(_ctl("metrics", str(m.mnt)))
    labels = {"mount": str(m.mnt), "backing": str(m.backing)}
    for name in ("cachefs_read_ops", "cachefs_read_bytes", "cachefs_latency_seconds",
                 "cachefs_dirty_bytes", "cachefs_cache_used_bytes", "cachefs_write_ops",
                 "cachefs_dropped_extents", "cachefs_evictions"):
        assert name in fams, sorted(fams)
    ops = {smp.labels["tier"]: smp.value for smp in fams["cachefs_read_ops"].samples
           if smp.name == "cachefs_read_ops_total"}
    assert ops == {"ssd": s["hit_ops"], "backing": s["miss_ops"], "bypass": s["bypass_ops"]}
    for smp in fams["cachefs_read_ops"].samples:
        assert {k: smp.labels[k] for k in labels} == labels
    assert fams["cachefs_read_ops"].type == "counter"
    assert fams["cachefs_cache_used_bytes"].type == "gauge"
    assert fams["cachefs_cache_used_bytes"].samples[0].value == s["cache_used"] > 0
    lat = fams["cachefs_latency_seconds"]
    assert lat.type == "histogram"
    hit = [smp for smp in lat.samples if smp.labels["tier"] == "ssd_hit"]
    count = [smp.value for smp in hit if smp.name == "cachefs_latency_seconds_count"]
    inf = [smp.value for smp in hit if smp.name == "cachefs_latency_seconds_bucket"
           and smp.labels["le"] == "+Inf"]
    assert count == inf == [s["latency"]["ssd_hit"]["count"]] and count[0] > 0
    cum = [smp.value for smp in hit if smp.name == "cachefs_latency_seconds_bucket"]
    assert cum == sorted(cum)
    assert {smp.labels["tier"] for smp in lat.samples} == {
        "ssd_hit", "backing_miss", "bypass", "write", "fsync", "destage"}


def test_two_mounts_have_distinct_label_sets(make_mount):
    a = make_mount("--mode", "write-through", name="a")
    b = make_mount("--mode", "write-through", name="b")
    seen = []
    for m in (a, b):
        fams = _families(_ctl("metrics", str(m.mnt)))
        seen.append({(smp.labels["mount"], smp.labels["backing"])
                     for smp in fams["cachefs_cache_used_bytes"].samples})
    assert seen == [{(str(a.mnt), str(a.backing))}, {(str(b.mnt), str(b.backing))}]
