"""Latency histograms: one per tier (SSD hit, BACKING miss, sequential bypass, write, fsync,
destage write), log-linear buckets counted with integer increments.

Owns `Histogram` and the bucket layout. A bucket index comes from the nanoseconds with
`int.bit_length()`: below 4 ns one bucket per nanosecond; above, each power of two splits into
4 linear sub-buckets (relative error at most 25 %). `add` indexes a preallocated list: no
allocation on the hit path beyond the ints themselves. Percentiles (the upper bound of the
bucket holding the rank, so never an underestimate) are computed only in `snapshot()`.
"""

from __future__ import annotations

from typing import Sequence

NBUCKETS = 160                  # the last holds everything from 2**40 ns (about 18 minutes) up
TIERS = ("ssd_hit", "backing_miss", "bypass", "write", "fsync", "destage")
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999))


def bucket_of(ns: int) -> int:
    b = ns.bit_length()
    if b <= 3:
        return ns if ns > 0 else 0
    i = ((b - 3) << 2) + (ns >> (b - 3))
    return i if i < NBUCKETS else NBUCKETS - 1


def bucket_bounds(i: int) -> tuple[int, int]:
    """[lower, upper) in nanoseconds of bucket i."""
    if i < 4:
        return i, i + 1
    shift = (i >> 2) - 1
    top = (i & 3) + 4
    return top << shift, (top + 1) << shift


def percentile_of(counts: Sequence[int], total: int, q: float) -> int | None:
    """The upper bound of the bucket holding rank ceil(q * total) in bucket `counts` (a
    histogram's, or the difference of two of its copies); None when `total` is 0."""
    if not total:
        return None
    rank = max(1, -int(-q * total // 1))
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return bucket_bounds(i)[1]
    return bucket_bounds(NBUCKETS - 1)[1]


class Histogram:
    __slots__ = ("counts", "count", "sum_ns")

    def __init__(self):
        self.counts = [0] * NBUCKETS
        self.count = 0
        self.sum_ns = 0

    def add(self, ns: int) -> None:
        b = ns.bit_length()
        if b <= 3:
            i = ns if ns > 0 else 0
        else:
            i = ((b - 3) << 2) + (ns >> (b - 3))
            if i >= NBUCKETS:
                i = NBUCKETS - 1
        self.counts[i] += 1
        self.count += 1
        self.sum_ns += ns

    def percentile_ns(self, q: float) -> int | None:
        """The upper bound of the bucket holding rank ceil(q * count); None when empty."""
        return percentile_of(self.counts, self.count, q)

    def snapshot(self) -> dict:
        out: dict = {"count": self.count, "sum_ns": self.sum_ns}
        for name, q in QUANTILES:
            out[name + "_ns"] = self.percentile_ns(q)
        out["buckets"] = [[*bucket_bounds(i), n] for i, n in enumerate(self.counts) if n]
        return out
