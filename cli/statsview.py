"""The stats of a mount as rows of text: `cachefs-ctl stats` (render) and `cachefs-ctl top`
take their rows from here. Pure functions of the daemon's stats dict; no I/O."""

from __future__ import annotations

import time

from cachefs.config import format_size
from cachefs.health import summary as health_summary


def passthrough_summary(s: dict) -> str:
    """FUSE passthrough in one line: off and why, or what the kernel serves now."""
    if s.get("passthrough") != "on":
        return f"off: {s.get('passthrough_off_reason') or 'unknown'}"
    return (f"on; {s['passthrough_open_handles']} opens of {s['passthrough_open_files']} "
            f"files now, {s['passthrough_held_files']} files held "
            f"({format_size(s['passthrough_held_bytes'])}); {s['passthrough_opens']} "
            f"passthrough and {s['passthrough_joined']} joined opens since mount"
            + (f"; {s['passthrough_frozen']} grown past the room for them (their passthrough "
               "readers see them end early)" if s.get("passthrough_frozen") else ""))


def _uptime(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 2 * 86400:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    return f"{seconds // 86400} days {seconds % 86400 // 3600} h"


def render(s: dict) -> str:
    used, size = s["cache_used"], s["cache_size"]
    rows = [
        ("mount", f"{s['mountpoint']} <- {s['backing']} ({s['mode']})"),
        ("cache", f"{s['cache_dir']}: {format_size(used)} of {format_size(size)} used "
                  f"({100 * used / size if size else 0:.1f} %), {s['extents_cached']} extents "
                  f"in {s['files_cached']} files"),
        ("daemon", f"pid {s['pid']}, up {_uptime(s.get('uptime_s', 0))}, "
                   f"{format_size(s['resident_bytes']) if s.get('resident_bytes') else '?'} "
                   "resident memory"),
        ("reads", f"{s['read_ops']} ops, {format_size(s['read_bytes'])}; hit ratio "
                  f"{100 * s['hit_ratio']:.1f} % ({100 * s['byte_hit_ratio']:.1f} % of bytes)"),
        ("  from SSD", f"{s['hit_ops']} ops, {format_size(s['hit_bytes'])}"),
        ("  from BACKING", f"{s['miss_ops']} ops, {format_size(s['miss_bytes'])}"),
        ("  sequential bypass", f"{s['bypass_ops']} ops, {format_size(s['bypass_bytes'])}"),
        ("writes", f"{s['write_ops']} ops, {format_size(s['write_bytes'])}; fallocate "
                   f"{s.get('fallocate_ops', 0)} ops, {format_size(s.get('zeroed_bytes', 0))} "
                   "punched or zeroed"),
        *window_rows(s.get("windows")),
        *_writeback_rows(s),
        *latency_rows(s.get("latency")),
        ("promotions", f"{s['promotions']} (+{s['promotions_dropped']} dropped, "
                       f"{s.get('promotion_waits', 0)} waited), evictions {s['evictions']}"),
        ("coherence", f"{s['stale_files']} files changed behind the cache"),
        ("dropped extents", ", ".join(f"{reason.replace('_', ' ')} {n}"
                                      for reason, n in s.get("drops", {}).items())),
        ("pinned", f"{s['pinned_files']} files, {format_size(s['pinned_bytes'])} resident "
                   f"(limit {format_size(s['pinned_limit'])}); prefetched "
                   f"{format_size(s['prefetched_bytes'])}"),
        ("passthrough", passthrough_summary(s)),
        ("killpriv v2", {"on": "on (no security.capability request before each write)",
                         "off": "off (the kernel asks for security.capability before each "
                                "write)"}.get(s.get("killpriv_v2"), "unknown")),
        ("fast hits", {"on": "on (4 KiB hits answered in C, before the Python handler)",
                       "off": "off (every hit goes through the Python read handler)"}
                      .get(s.get("fast_hits"), "unknown")),
        ("integrity", integrity_summary(s)),
        ("BACKING health", health_summary(s.get("backing_health"))),
        ("errors", f"BACKING {s['backing_errors']}, cache {s['cache_errors']} (full "
                   f"{s.get('cache_full_events', 0)}), metadata commits "
                   f"{s.get('metadata_errors', 0)}, internal {s.get('internal_errors', 0)}; "
                   f"writes around the cache {s.get('writes_around', 0)}"),
        *_lifetime_rows(s.get("lifetime")),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def integrity_summary(s: dict) -> str:
    """Checksum failures seen, and the dirty data damaged on the SSD (named)."""
    text = (f"{s.get('checksum_errors', 0)} clean blocks failed their checksums (dropped), "
            f"{s.get('checksum_dirty_errors', 0)} dirty; {s.get('verified_blocks', 0)} blocks "
            "verified")
    lost = s.get("lost") or []
    if s.get("lost_dirty_blocks"):
        text += (f"; LOST: {s['lost_dirty_blocks']} dirty blocks damaged on the SSD ("
                 + ", ".join(f"{x['path']}@{x['offset']}" for x in lost[:5])
                 + (", ..." if len(lost) > 5 else "") + ")")
    return text


def _writeback_rows(s: dict) -> list[tuple[str, str]]:
    if s["mode"] != "write-back" and not s["dirty_bytes"]:
        return []
    eta = s["eta_s"]
    return [
        ("dirty", f"{format_size(s['dirty_bytes'])} in {s['dirty_extents']} extents (high "
                  f"{format_size(s['dirty_high'])}, low {format_size(s['dirty_low'])}); oldest "
                  f"{s['oldest_dirty_age_s']:.1f} s"),
        ("destage", f"{format_size(s['destaged_bytes'])} in {s['destage_ops']} passes, "
                    f"{format_size(s['destage_rate'])}/s, ETA "
                    f"{'-' if eta is None else f'{eta:.0f} s'}, errors {s['destage_errors']}"),
        ("flow control", f"{'THROTTLING' if s['throttling'] else 'off'}; "
                         f"{s['throttled_writes']} writes delayed "
                         f"{s['throttle_delay_s']:.1f} s in all"),
        ("conflicts", f"{s['conflicts']} (BACKING changed while dirty here)"),
    ]


RATE_NAMES = {"1s": "1 s", "10s": "10 s", "1m": "1 min"}
DECAY_NAMES = {"1m": "1 min", "5m": "5 min", "1h": "1 h", "1d": "1 day"}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def window_rows(w: dict | None, rates: tuple[str, ...] = ("1s", "10s", "1m")) \
        -> list[tuple[str, str]]:
    """Rates over the last `rates` windows and the decaying hit ratios (the daemon's
    history.py)."""
    if not w:
        return []
    r = [w["rates"].get(name) for name in rates]
    zero = {"read_iops": 0, "read_bytes_per_s": 0, "write_iops": 0, "write_bytes_per_s": 0}
    r = [x or zero for x in r]

    def figs(key: str, fmt) -> str:
        return " / ".join(fmt(x[key]) for x in r)

    def iops(v: float) -> str:
        return f"{v:.0f}"

    def bps(v: float) -> str:
        return f"{format_size(v)}/s"

    d = w["hit_ratio"]
    return [
        ("rates", "last " + " / ".join(RATE_NAMES.get(n, n) for n in rates)),
        ("  reads", f"{figs('read_iops', iops)} IOPS; {figs('read_bytes_per_s', bps)}"),
        ("  writes", f"{figs('write_iops', iops)} IOPS; {figs('write_bytes_per_s', bps)}"),
        ("hit ratio, decaying", ", ".join(f"{DECAY_NAMES.get(k, k)} {_pct(v['ops'])}"
                                          for k, v in d.items())
         + " (bytes: " + ", ".join(_pct(v["bytes"]) for v in d.values()) + ")"),
    ]


LATENCY_NAMES = {"ssd_hit": "SSD hit", "backing_miss": "BACKING miss",
                 "bypass": "sequential bypass", "write": "write", "fsync": "fsync",
                 "destage": "destage write"}


def latency_rows(lat: dict | None) -> list[tuple[str, str]]:
    """p50/p90/p99/p99.9 per tier: upper bounds of log-linear buckets (at most 25 % over)."""
    if not lat:
        return []
    rows = [("latency", "p50 / p90 / p99 / p99.9 (bucket upper bounds)")]
    for tier, h in lat.items():
        if not h["count"]:
            continue
        figs = " / ".join(_duration(h[q + "_ns"]) for q in ("p50", "p90", "p99", "p99.9"))
        rows.append((f"  {LATENCY_NAMES.get(tier, tier)}", f"{figs}  ({h['count']} ops)"))
    return rows


def _duration(ns: int) -> str:
    if ns < 10_000:
        return f"{ns / 1e3:.2f} us"
    if ns < 10_000_000:
        return f"{ns / 1e3:.0f} us"
    if ns < 10_000_000_000:
        return f"{ns / 1e6:.0f} ms"
    return f"{ns / 1e9:.0f} s"


def _lifetime_rows(t: dict | None) -> list[tuple[str, str]]:
    """The totals over every mount of this cache directory (saved each commit interval)."""
    if not t:
        return []
    since = time.strftime("%Y-%m-%d %H:%M", time.localtime(t["since"])) if t["since"] else "?"
    return [
        ("lifetime", f"since {since}, all mounts of this cache directory"),
        ("  reads", f"{t['read_ops']} ops, {format_size(t['read_bytes'])}; hit ratio "
                    f"{100 * t['hit_ratio']:.1f} % ({100 * t['byte_hit_ratio']:.1f} % of "
                    "bytes)"),
        ("  from SSD", f"{t['hit_ops']} ops, {format_size(t['hit_bytes'])}"),
        ("  from BACKING", f"{t['miss_ops'] + t['bypass_ops']} ops, "
                           f"{format_size(t['miss_bytes'] + t['bypass_bytes'])}"),
        ("  writes", f"{t['write_ops']} ops, {format_size(t['write_bytes'])}; destaged "
                     f"{format_size(t['destaged_bytes'])}"),
        ("  promotions", f"{t['promotions']} (+{t['promotions_dropped']} dropped), "
                         f"evictions {t['evictions']}, stale files {t['stale_files']}"),
    ]
