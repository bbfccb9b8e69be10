"""The 4 KiB hit inlined in OpenFile.read_hit (hit.py) against the code it copies: the stream
note must leave SequentialDetector exactly as SequentialDetector.note would."""

from __future__ import annotations

import os
import random

from cachefs.extents import CachedFile, Extent
from cachefs.hit import OpenFile
from cachefs.integrity import resum
from cachefs.policy import SequentialDetector
from cachefs.stats import Stats

BLK = 4096


def test_the_inlined_stream_note_matches_sequential_detector(tmp_path):
    nexts = 64
    path = tmp_path / "cache"
    path.write_bytes(os.urandom(nexts * 65536))
    fd = os.open(path, os.O_RDONLY)
    try:
        cf = CachedFile(7, (1, nexts * 65536, 0, 0))
        cf.cache_fd = fd
        for e in range(nexts):
            x = cf.extents[e] = Extent(7, e, 0xFFFF)
            resum(fd, x, x.valid)
        of = OpenFile(1, cf, -1, os.O_RDONLY, Stats())
        ref = SequentialDetector()
        rng = random.Random(5)
        off = 0
        for _ in range(3000):
            # Streams, small jumps within the slack, backward steps and random jumps.
            off = rng.choice([off + BLK, off + BLK, off - 2 * BLK, off + 40 * BLK,
                              rng.randrange(nexts * 16) * BLK])
            off = min(max(off, 0), (nexts * 16 - 1) * BLK)
            data = of.read_hit(off, BLK)
            assert data == os.pread(fd, BLK, off)
            ref.note(off, BLK)
            assert (of.seq.run, of.seq.next_off) == (ref.run, ref.next_off), off
    finally:
        os.close(fd)
