"""Bitmaps, admission, sequential detection and eviction order: pure logic, no I/O."""

import random

from cachefs.extents import FULL_MASK, CachedFile, Extent, block_mask, covered_mask
from cachefs.policy import Admission, Clock, S3Fifo, SequentialDetector


def test_block_mask():
    assert block_mask(0, 4096) == 0b1
    assert block_mask(0, 4097) == 0b11
    assert block_mask(4095, 4097) == 0b11
    assert block_mask(8192, 65536) == FULL_MASK & ~0b11
    assert block_mask(0, 65536) == FULL_MASK
    assert block_mask(100, 100) == 0


def test_covered_mask_needs_whole_blocks_or_eof():
    assert covered_mask(0, 4096, 65536) == 0b1
    assert covered_mask(1, 8192, 65536) == 0b10           # block 0 only partly written
    assert covered_mask(0, 6000, 65536) == 0b1            # block 1 partly
    assert covered_mask(4096, 6000, 6000) == 0b10         # block 1 ends at EOF: covered
    assert covered_mask(0, 65536, 65536) == FULL_MASK


def test_covered_mask_matches_its_definition_block_by_block():
    """The block-aligned shortcut gives what the definition gives, EOF anywhere (also
    before the range's end, a write extending the file)."""
    def reference(start, end, eof):
        mask = 0
        for b in range(16):
            bs = b * 4096
            if bs < start:
                continue
            if min(bs + 4096, max(eof, bs + 1)) > end:
                break
            mask |= 1 << b
        return mask
    rng = random.Random(11)
    for _ in range(20000):
        if rng.random() < 0.5:
            start = rng.randrange(16) * 4096
            end = rng.randrange(start // 4096 + 1, 17) * 4096
        else:
            start = rng.randrange(65536)
            end = rng.randrange(start + 1, 65537)
        eof = rng.choice([65536, rng.randrange(1, 65537), end, start + 1])
        assert covered_mask(start, end, eof) == reference(start, end, eof), (start, end, eof)


def test_covers_checks_every_block_and_counts_access():
    cf = CachedFile(5, (5, 200000, 1, 1))
    cf.extents[0] = Extent(5, 0, FULL_MASK)
    cf.extents[1] = Extent(5, 1, 0b0011)
    assert cf.covers(0, 65536)
    assert cf.covers(60000, 65536 + 8192)
    assert not cf.covers(60000, 65536 + 8193)
    assert not cf.covers(65536 * 2, 65536 * 2 + 1)          # extent 2 not cached
    assert cf.extents[0].freq == 3                         # capped at 3


def test_admission_counts_misses_and_ghost_hits():
    a = Admission(promote_after=3)
    key = (1, 7)
    assert not a.note_miss(key, False)
    assert not a.note_miss(key, False)
    assert a.note_miss(key, False)
    assert not a.note_miss(key, False)                      # counting starts again
    assert a.note_miss((1, 8), in_ghost=True)               # recently evicted: at once


def test_admission_window_is_bounded():
    a = Admission(promote_after=2, window=100)
    for i in range(1000):
        a.note_miss((1, i), False)
    assert len(a._seen) <= 100


class _CountedScans(dict):
    """A dict that counts the scans of all its keys."""
    scans = 0

    def __iter__(self):
        type(self).scans += 1
        return super().__iter__()


def test_forgetting_a_file_forgets_its_misses_without_a_scan_of_the_window():
    """Every unlink of a file's last name forgets its misses: it scanned the whole window
    (65,536 keys once reads filled it, ~10 ms of the event loop each; `rm -rf` of 100,000
    files ran ~100 files/s, a helper's hunt)."""
    a = Admission(promote_after=3, window=1000)
    a._seen = _CountedScans()
    for ino in range(1, 200):
        for e in range(4):
            a.note_miss((ino, e), False)
    a.note_miss((5, 0), False)                              # seen twice
    a.forget_file(5)
    a.forget_file(7)
    a.forget_file(12345)                                    # none of it seen
    assert _CountedScans.scans == 0
    assert not any(k[0] in (5, 7) for k in a._seen) and len(a._seen) == 197 * 4
    assert not a.note_miss((5, 0), False)                   # counting starts again
    assert not a.note_miss((5, 0), False)
    assert a.note_miss((5, 0), False)
    assert not a.note_miss((6, 1), False)                   # others keep their counts
    assert a.note_miss((6, 1), False)
    assert a.note_miss((6, 2), in_ghost=True)
    assert sorted(a._by_ino[6]) == [0, 3]                   # the index follows


def test_the_admission_index_follows_the_window():
    a = Admission(promote_after=2, window=100)
    for i in range(1000):
        a.note_miss((i % 7, i), False)
    assert {(ino, e) for ino, exts in a._by_ino.items() for e in exts} == set(a._seen)


def test_sequential_detector():
    d = SequentialDetector()
    run = 0
    for off in range(0, 8 << 20, 128 << 10):
        run = d.note(off, 128 << 10)
    assert run == 8 << 20
    assert d.note(100 << 20, 4096) == 4096                   # a jump starts a new stream


def _hit_ratio(policy_cls, seed=1):
    """A hot set that fits, interleaved with one-off scans larger than the cache."""
    cap = 100
    pol = policy_cls(cap)
    resident: dict[tuple, Extent] = {}
    rng = random.Random(seed)
    hits = total = 0
    scan = 10_000
    for step in range(40_000):
        if step % 4 == 0:
            key = (2, scan)
            scan += 1
        else:
            key = (1, rng.randrange(80))
            total += 1
        x = resident.get(key)
        if x is not None:
            if key[0] == 1:
                hits += 1
            x.freq = min(3, x.freq + 1)
            continue
        while len(pol) >= cap:
            v = pol.victim()
            del resident[v.key]
        x = Extent(*key)
        pol.insert(x)
        resident[key] = x
    return hits / total


def test_s3fifo_resists_scans_better_than_clock():
    s3, clock = _hit_ratio(S3Fifo), _hit_ratio(Clock)
    assert s3 > 0.9
    assert s3 > clock + 0.05, (s3, clock)


def test_dirty_extents_are_never_victims():
    pol = S3Fifo(10)
    xs = [Extent(1, i, FULL_MASK, dirty=1) for i in range(10)]
    for x in xs:
        pol.insert(x)
    assert pol.victim() is None
    xs[3].dirty = 0
    assert pol.victim() is xs[3]


def test_dirty_extents_in_the_small_queue_do_not_stop_eviction():
    """A dirty extent at the head of a small queue at its target size was put back there
    again and again until the search gave up, while clean extents waited in the main queue:
    writes waited for room and promotions were dropped with nothing dirty but that one."""
    for p in (S3Fifo(16), Clock(16)):
        clean = [Extent(1, i) for i in range(12)]
        for x in clean:
            p.insert_main(x)
        d = Extent(2, 0, valid=FULL_MASK, dirty=1)
        p.insert(d)
        victims = [p.victim() for _ in range(12)]
        assert sorted(x.ext for x in victims) == list(range(12)), type(p).__name__
        assert p.victim() is None                      # only the dirty one is left
        assert len(p) == 1


def test_all_valid_counts_no_access():
    cf = CachedFile(5, (5, 1 << 20, 1, 1))
    cf.extents[0] = Extent(5, 0, FULL_MASK)
    cf.extents[1] = Extent(5, 1, 0b1)
    assert cf.all_valid(100, 65536 + 4096)
    assert not cf.all_valid(100, 65536 + 4097)
    assert not cf.all_valid(2 << 16, (2 << 16) + 1)
    assert cf.extents[0].freq == 0


def test_spans_cover_the_range_extent_by_extent():
    """spans(): the one-extent shortcut and the general loop give the per-extent pieces of
    [off, end) (empty for an empty range), in order, their masks the blocks they touch."""
    from cachefs.extentmap import spans
    rng = random.Random(12)
    for _ in range(20000):
        off = rng.randrange(1 << 20)
        end = off + rng.choice([0, 1, 4096, 65536, rng.randrange(300000)])
        parts = list(spans(off, end))
        if end == off:
            assert parts == []
            continue
        assert parts[0][1] == off and parts[-1][2] == end
        for (e, s, t, m), nxt in zip(parts, parts[1:] + [None]):
            base = e * 65536
            assert base <= s < t <= base + 65536 and m == block_mask(s - base, t - base)
            if nxt is not None:
                assert nxt[0] == e + 1 and nxt[1] == t == base + 65536
