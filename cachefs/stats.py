"""Counters of the engine. Plain integer attributes so the hit path counts with `+= 1`;
`snapshot()` derives ratios and gauges for `cachefs-ctl stats`.

Lifetime totals span remounts: the store keeps each counter's total over all earlier
mounts (the base, loaded at mount); the lifetime figure is base + this mount's counter, so
the hit path counts once, in place. The store saves base + current at every commit interval
and at unmount (a kill -9 loses at most the last interval)."""

from __future__ import annotations

import time

from .latency import TIERS, Histogram

COUNTERS = (
    "read_ops", "read_bytes",              # every read request answered
    "hit_ops", "hit_bytes",                # answered from the SSD
    "miss_ops", "miss_bytes",              # answered from BACKING (not sequential)
    "bypass_ops", "bypass_bytes",          # sequential stream past the cutoff, from BACKING
    "mixed_ops", "mixed_bytes",            # partly from the SSD, the rest from BACKING
    "write_ops", "write_bytes",
    "fallocate_ops", "zeroed_bytes",       # fallocate(2); bytes punched or zeroed by it
    "backing_read_ops", "backing_read_bytes", "backing_write_ops", "backing_write_bytes",
    "promotions", "promotions_dropped", "evictions",
    "promotion_waits",                     # reads held until the promoter took their extents
    "stale_files", "backing_errors", "cache_errors",
    "cache_files_restored",                # removed behind us while open, written again
    "conflicts",                           # BACKING changed while we held dirty data
    "partial_block_fills",                 # write-back: sub-block writes that read BACKING
    "punch_waits",                         # writes that waited for an evicted hole's release
    "overlay_rereads",                     # BACKING re-read: a dirty block left mid-read
    "writes_around",                       # write-back writes sent to BACKING (SSD full...)
    "cache_full_events",                   # SSD writes that failed for lack of space
    "metadata_errors",                     # failed metadata commits (retried)
    "internal_errors",                     # reads failed (EIO) and metadata rows left out
                                           # by a bug in cachefs (logged)
    "destage_ops", "destaged_bytes", "destage_errors",
    "throttled_writes", "throttle_delay_ns",   # flow control: writes slowed, delay added
    # cached extents dropped, by reason (evictions are counted above)
    "drop_coherence",                      # BACKING changed behind the cache
    "drop_recovery",                       # clean extents of a file changed since an unclean stop
    "drop_capacity",                       # beyond the pool size at mount
    "drop_operator",                       # cachefs-ctl drop
    "drop_cache_error",                    # the SSD failed a read or write of the extent
    "drop_checksum",                       # extents with clean blocks failing their checksums
    "drop_orphan",                         # of a file with dirty data BACKING no longer has
    # integrity.py: cached blocks failing their checksums, and blocks checked by verify/scrub
    "checksum_errors", "checksum_dirty_errors", "verified_blocks", "scrubs",
    "prefetched_bytes",                    # loaded by cachefs-ctl prefetch/pin and pin re-loads
    "pin_reloads",                         # pinned files re-loaded after their data was dropped
    "pins_lost",                           # pins removed because the file was unlinked or gone
    "dropped_pinned",                      # pinned extents dropped by cachefs-ctl drop --pinned
    # FUSE passthrough (openmode.py)
    "passthrough_opens",                   # opens the kernel serves from the cache file
    "passthrough_joined",                  # opens of a file in passthrough, answered with
                                           # passthrough + direct I/O (reads/writes reach us)
    "passthrough_failed",                  # the kernel refused a cache file as backing file
    "passthrough_detached",                # held cache files unlinked rather than emptied
    "passthrough_frozen",                  # held cache files that stopped growing: the file
                                           # grew past what the cache may hold for it
    "passthrough_refreshed",               # held cache files read again from BACKING after
                                           # it changed behind them (before an open)
    "passthrough_syncs",                   # held files a shared mapping may have written:
                                           # made dirty (write-back) or copied to BACKING
    "drop_skipped_passthrough",            # extents cachefs-ctl drop left: held by passthrough
)
DROP_REASONS = ("coherence", "recovery", "capacity", "operator", "cache_error", "checksum",
                "orphan")


class Stats:
    # Slots: the hit path (hit.py and _hit.c) adds to four counters per request.
    __slots__ = COUNTERS + ("started_s", "lat_hit", "lat_miss", "lat_bypass", "lat_write",
                            "lat_fsync", "lat_destage", "latency", "killpriv_v2",
                            "direct_io_mmap", "fast_hits",
                            "lifetime_base", "lifetime_since")

    def __init__(self):
        for name in COUNTERS:
            setattr(self, name, 0)
        self.started_s = time.monotonic()
        # latency per tier (latency.py): attributes for the request paths, the dict for output
        self.lat_hit, self.lat_miss, self.lat_bypass, self.lat_write, self.lat_fsync, \
            self.lat_destage = hists = tuple(Histogram() for _ in TIERS)
        self.latency = dict(zip(TIERS, hists))
        self.killpriv_v2 = 0        # FUSE_HANDLE_KILLPRIV_V2 in effect (fs.init): not a counter
        self.direct_io_mmap = 0     # FUSE_CAP_DIRECT_IO_ALLOW_MMAP in effect (fs.init): ditto
        self.fast_hits = 0          # 4 KiB hits answered in C (hit.install_fast_hits): ditto
        self.lifetime_base: dict[str, int] = {}     # totals of all earlier mounts
        self.lifetime_since: float | None = None    # wall time the totals started

    def set_lifetime_base(self, base: dict[str, int], since: float) -> None:
        self.lifetime_base = dict(base)
        self.lifetime_since = since

    def lifetime(self) -> dict[str, int]:
        """Every counter summed over all mounts of this cache directory, this one included."""
        base = self.lifetime_base
        return {name: base.get(name, 0) + getattr(self, name) for name in COUNTERS}

    def lifetime_snapshot(self) -> dict:
        out: dict = self.lifetime()
        out["hit_ratio"] = _ratio(out["hit_ops"], out["read_ops"])
        out["byte_hit_ratio"] = _ratio(out["hit_bytes"], out["read_bytes"])
        out["since"] = self.lifetime_since
        return out

    def snapshot(self) -> dict:
        out = {name: getattr(self, name) for name in COUNTERS}
        out["hit_ratio"] = _ratio(self.hit_ops, self.read_ops)
        out["byte_hit_ratio"] = _ratio(self.hit_bytes, self.read_bytes)
        out["drops"] = {r: getattr(self, "drop_" + r) for r in DROP_REASONS}
        out["uptime_s"] = round(time.monotonic() - self.started_s, 1)
        out["killpriv_v2"] = "on" if self.killpriv_v2 else "off"
        out["killpriv_v2_on"] = self.killpriv_v2
        out["direct_io_mmap_on"] = self.direct_io_mmap
        out["fast_hits"] = "on" if self.fast_hits else "off"
        out["fast_hits_on"] = self.fast_hits
        out["latency"] = {tier: h.snapshot() for tier, h in self.latency.items()}
        return out


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0
