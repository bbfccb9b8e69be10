"""Counters of the engine. Plain integer attributes so the hit path counts with `+= 1`;
`snapshot()` derives ratios and gauges for `cachefs-ctl stats`."""

from __future__ import annotations

import time

COUNTERS = (
    "read_ops", "read_bytes",              # every read request answered
    "hit_ops", "hit_bytes",                # answered from the SSD
    "miss_ops", "miss_bytes",              # answered from BACKING (not sequential)
    "bypass_ops", "bypass_bytes",          # sequential stream past the cutoff, from BACKING
    "write_ops", "write_bytes",
    "backing_read_ops", "backing_read_bytes", "backing_write_ops", "backing_write_bytes",
    "promotions", "promotions_dropped", "evictions",
    "promotion_waits",                     # reads held until the promoter took their extents
    "stale_files", "backing_errors", "cache_errors",
    "conflicts",                           # BACKING changed while we held dirty data
    "partial_block_fills",                 # write-back: sub-block writes that read BACKING
    "writes_around",                       # write-back writes sent to BACKING (SSD full...)
    "cache_full_events",                   # SSD writes that failed for lack of space
    "metadata_errors",                     # failed metadata commits (retried)
    "destage_ops", "destaged_bytes", "destage_errors",
    "throttled_writes", "throttle_delay_ns",   # flow control: writes slowed, delay added
    # cached extents dropped, by reason (evictions are counted above)
    "drop_coherence",                      # BACKING changed behind the cache
    "drop_recovery",                       # clean extents of a file changed since an unclean stop
    "drop_capacity",                       # beyond the pool size at mount
    "drop_operator",                       # cachefs-ctl drop
    "drop_cache_error",                    # the SSD failed a read or write of the extent
    "prefetched_bytes",                    # loaded by cachefs-ctl prefetch/pin and pin re-loads
    "pin_reloads",                         # pinned files re-loaded after their data was dropped
    "pins_lost",                           # pins removed because the file was unlinked or gone
    "dropped_pinned",                      # pinned extents dropped by cachefs-ctl drop --pinned
)
DROP_REASONS = ("coherence", "recovery", "capacity", "operator", "cache_error")


class Stats:
    def __init__(self):
        for name in COUNTERS:
            setattr(self, name, 0)
        self.started_s = time.monotonic()

    def snapshot(self) -> dict:
        out = {name: getattr(self, name) for name in COUNTERS}
        out["hit_ratio"] = round(self.hit_ops / self.read_ops, 4) if self.read_ops else 0.0
        out["byte_hit_ratio"] = (round(self.hit_bytes / self.read_bytes, 4)
                                 if self.read_bytes else 0.0)
        out["drops"] = {r: getattr(self, "drop_" + r) for r in DROP_REASONS}
        out["uptime_s"] = round(time.monotonic() - self.started_s, 1)
        return out
