"""The C hit (cachefs/_hit.c, pyfuse3's read hook) against the Python read_hit it copies.

Two identical handles over one cache file take the same random reads and changes: one is
served by hit.OpenFile.read_hit alone, as with --no-fast-hits; the other as a mount with
fast hits serves it, the C hook first and read_hit where the hook declines. Every answer and
every piece of state the hit touches (extent access counts, the stream detector, the
counters) must come out the same, and the hook must answer every 4 KiB hit that read_hit
answers, so that it is a faster read_hit, not another one.
"""

from __future__ import annotations

import os
import random

import pytest

from cachefs import integrity
from cachefs.extents import CachedFile, Extent
from cachefs.hit import OpenFile
from cachefs.integrity import Damaged, block_sum, resum
from cachefs.latency import NBUCKETS, Histogram, bucket_of
from cachefs.policy import SequentialDetector
from cachefs.stats import Stats

try:
    from cachefs import _hit
except ImportError as exc:          # make install builds it (setup.py; libxxhash-dev)
    pytest.fail(f"cachefs/_hit.c is not built: {exc}", pytrace=False)

BLK = 4096
NEXTS = 16
COUNTED = ("read_ops", "hit_ops", "read_bytes", "hit_bytes", "cache_errors")


def install(open_files: dict) -> None:
    _hit.install(open_files, integrity.CHECK_READS, SequentialDetector.SLACK, NBUCKETS, OpenFile,
                 CachedFile, Extent, SequentialDetector, Stats, Histogram)


def handle(fh: int, fd: int, size: int) -> OpenFile:
    cf = CachedFile(7, (1, size, 0, 0))
    cf.cache_fd = fd
    for e in range(NEXTS):
        x = cf.extents[e] = Extent(7, e, 0xFFFF)
        resum(fd, x, x.valid)
    return OpenFile(fh, cf, -1, os.O_RDONLY, Stats())


def python_read(of: OpenFile, off: int, size: int):
    try:
        return of.read_hit(off, size)
    except Damaged:
        return "damaged"


def state(of: OpenFile) -> tuple:
    cf = of.cfile
    return (tuple((e, x.freq, x.valid) for e, x in sorted(cf.extents.items())),
            of.seq.run, of.seq.next_off, tuple(getattr(of.stats, c) for c in COUNTED))


def test_the_c_hit_answers_as_read_hit_does(tmp_path):
    size = NEXTS * 65536 - 1000             # the last block is partly past the end
    path = tmp_path / "cache"
    path.write_bytes(os.urandom(NEXTS * 65536 - 3 * BLK))   # ... and past the cache file's
    fd = os.open(path, os.O_RDWR)
    bad_fd = os.open(path, os.O_WRONLY)     # a descriptor pread fails on: an SSD error
    saved = integrity.CHECK_READS[0]
    try:
        ref, fast = handle(1, fd, size), handle(2, fd, size)
        install({2: fast})
        rng = random.Random(16)
        answered = damaged = 0
        for step in range(20000):
            off = rng.choice([rng.randrange(NEXTS * 16) * BLK, rng.randrange(NEXTS * 65536),
                              (ref.seq.next_off if ref.seq.next_off >= 0 else 0)])
            size_ = BLK if rng.random() < 0.9 else rng.choice([1, 512, 2 * BLK, 3 * BLK + 7])
            c = _hit.read(2, off, size_)
            got = c if c is not None else python_read(fast, off, size_)
            want = python_read(ref, off, size_)
            assert got == want, (step, off, size_)
            if (size_ == BLK and not off % BLK and off + BLK <= ref.cfile.size
                    and isinstance(want, bytes)):
                assert c == want, (step, off)           # the hook declines no plain hit
                answered += 1
            damaged += want == "damaged"
            assert state(fast) == state(ref), (step, off, size_)
            assert fast.stats.lat_hit.count == answered
            # Change both the same way, as the engine would.
            r = rng.random()
            e = rng.randrange(NEXTS)
            b = rng.randrange(16)
            if r < 0.03:                                # a block stops being valid
                for of in (ref, fast):
                    if e in of.cfile.extents:
                        of.cfile.extents[e].valid &= ~(1 << b)
            elif r < 0.05:                              # it comes back
                for of in (ref, fast):
                    x = of.cfile.extents.get(e)
                    if x is not None:
                        x.valid |= 1 << b
                        resum(fd, x, 1 << b)
            elif r < 0.06:                              # an extent is evicted, then refilled
                for of in (ref, fast):
                    of.cfile.extents.pop(e, None)
            elif r < 0.07:
                for of in (ref, fast):
                    x = of.cfile.extents[e] = Extent(7, e, 0xFFFF)
                    resum(fd, x, x.valid)
            elif r < 0.073:                             # a checksum goes wrong (damage)
                for of in (ref, fast):
                    x = of.cfile.extents.get(e)
                    if x is not None and x.summed >> b & 1:
                        x.sums[b] ^= 1
            elif r < 0.085:
                integrity.CHECK_READS[0] = not integrity.CHECK_READS[0]
            elif r < 0.09:                              # the file shrinks or grows
                new = rng.choice([size, rng.randrange(NEXTS * 65536)])
                for of in (ref, fast):
                    of.cfile.size = new
            elif r < 0.093 or ref.cfile.cache_fd == bad_fd:   # the SSD fails, for a while
                failing = r < 0.093 or rng.random() < 0.8
                for of in (ref, fast):
                    of.cfile.cache_fd = bad_fd if failing else fd
        assert answered > 2000 and damaged > 10     # (3,370 and 52 with this seed)
        assert ref.stats.cache_errors > 0
    finally:
        integrity.CHECK_READS[0] = saved
        install({})
        os.close(fd)
        os.close(bad_fd)


def test_the_c_hit_takes_the_same_checksum_and_latency_bucket():
    rng = random.Random(3)
    for _ in range(200):
        buf = rng.randbytes(BLK)
        assert _hit.block_sum(buf) == block_sum(buf)
    install({})
    values = [0, 1, 3, 4, 7, 8, 15, 16, 17, 1000, 4095, 4096, 123456789, 2**40, 2**41 + 5]
    values += [rng.randrange(2**rng.randrange(1, 45)) for _ in range(2000)]
    for ns in values:
        assert _hit.bucket_of(ns) == bucket_of(ns), ns


def test_the_c_hit_declines_objects_of_other_types(tmp_path):
    path = tmp_path / "cache"
    path.write_bytes(os.urandom(65536))
    fd = os.open(path, os.O_RDONLY)
    try:
        of = handle(1, fd, 65536)
        install({1: of, 2: object(), 3: "not a handle"})
        assert _hit.read(1, 0, BLK) == os.pread(fd, BLK, 0)
        assert _hit.read(2, 0, BLK) is None and _hit.read(3, 0, BLK) is None
        assert _hit.read(4, 0, BLK) is None                 # no such handle
        of.cfile.extents[0] = {"valid": 0xFFFF}             # not an Extent
        assert _hit.read(1, 0, BLK) is None
    finally:
        install({})
        os.close(fd)


def test_objects_without_the_slots_the_c_hit_reads_are_refused_at_install():
    class NoSlots:
        pass
    with pytest.raises(TypeError, match="is not a slot"):
        _hit.install({}, integrity.CHECK_READS, SequentialDetector.SLACK, NBUCKETS, OpenFile,
                     CachedFile, NoSlots, SequentialDetector, Stats, Histogram)
