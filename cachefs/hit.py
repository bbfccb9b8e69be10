"""The read hit: an open file handle and `read_hit`, a synchronous `pread` on the SSD file.

Owns `OpenFile` (one FUSE file handle: its BACKING fds, its cache state and its sequential
stream). `read_hit` is the hot path (STYLE.md §1): a bitmap test, one `os.pread` on the cache
file's descriptor opened at `open()`, the blocks' checksums (integrity.read_checked: it
raises Damaged, which fs.read hands to the slow path), counters; no await, lock, SQL or
logging.
Everything else about reads is in readpath.py.
"""

from __future__ import annotations

import logging
import os

import pyfuse3

from . import readahead
from .config import BLK_SIZE
from .extents import BLK_SHIFT, BLKS_PER_EXT, EXT_SHIFT, CachedFile, Extent
from .integrity import CHECK_READS, Damaged, block_sum, read_checked
from .latency import NBUCKETS, Histogram
from .policy import SequentialDetector
from .stats import Stats

BLK_MASK = BLK_SIZE - 1
BLK_IN_EXT = BLKS_PER_EXT - 1
SEQ_SLACK = SequentialDetector.SLACK

log = logging.getLogger("cachefs.hit")


class OpenFile:
    """One open file handle: BACKING fd, the file's cache state and its sequential stream."""

    __slots__ = ("fh", "ino", "cfile", "backing_fd", "flags", "seq", "stats", "last_miss_ext",
                 "direct_fd", "ahead", "readable", "miss_lat", "mode", "dio_align", "opener")

    def __init__(self, fh: int, cfile: CachedFile, backing_fd: int, flags: int, stats: Stats):
        self.fh = fh
        self.ino = cfile.ino
        self.cfile = cfile
        self.backing_fd = backing_fd
        self.flags = flags
        self.seq = SequentialDetector()
        self.stats = stats
        self.last_miss_ext = -1     # consecutive misses in one extent count as one access
        self.direct_fd = -1         # O_DIRECT twin of backing_fd for write-through (aio.py)
        self.ahead: dict[int, readahead.Ahead] = {}     # offset -> read ahead of the stream
        self.readable = True        # backing_fd can read (write-back fills of partial blocks)
        self.miss_lat = stats.lat_miss  # the histogram of the last miss: miss or bypass
        self.mode = ""              # how the open was answered (openmode.py)
        self.dio_align = (0, 0)     # O_DIRECT read-only opens: BACKING's alignment rules
        self.opener = (0, -1, -1)   # (pid, uid, gid) of the open's caller (its writes' too)

    def read_hit(self, off: int, size: int) -> bytes | None:
        """Serve a read from the SSD if every block is cached: sync, no await, no SQL."""
        cf = self.cfile
        if size == BLK_SIZE and not off & BLK_MASK and off + BLK_SIZE <= cf.size:
            # One whole block, the 4 KiB random read, in one frame: the block's bit, the
            # pread, its checksum (integrity.read_block's check), the stream note and the
            # counters inlined (the calls were ~1 us of a ~4 us hit in Python;
            # bench/ab_trees.sh).
            x = cf.extents.get(off >> EXT_SHIFT)
            if x is None:
                return None
            b = (off >> BLK_SHIFT) & BLK_IN_EXT
            if not x.valid >> b & 1:
                return None
            if x.freq < 3:
                x.freq += 1
            try:
                data = os.pread(cf.cache_fd, BLK_SIZE, off)
            except OSError:                 # the SSD failed us: BACKING still has the data
                self.stats.cache_errors += 1
                return None
            if len(data) < BLK_SIZE:        # past the cache file's end: zeros, as in a hole
                data += bytes(BLK_SIZE - len(data))
            if x.summed >> b & 1 and CHECK_READS[0] and block_sum(data) != x.sums[b]:
                raise Damaged(cf, [(x, 1 << b)])
            seq = self.seq                  # SequentialDetector.note, inlined
            if seq.next_off >= 0 and -SEQ_SLACK <= off - seq.next_off <= SEQ_SLACK:
                seq.run += BLK_SIZE
                if off + BLK_SIZE > seq.next_off:
                    seq.next_off = off + BLK_SIZE
            else:
                seq.run = BLK_SIZE
                seq.next_off = off + BLK_SIZE
            st = self.stats
            st.read_ops += 1
            st.hit_ops += 1
            st.read_bytes += BLK_SIZE
            st.hit_bytes += BLK_SIZE
            return data
        end = off + size
        if end > cf.size:
            end = cf.size
        if off >= end:
            return None
        try:
            if not cf.extents or not cf.covers(off, end):
                return None
            data = read_checked(cf, cf.cache_fd, off, end)
        except OSError:                     # the SSD failed us: BACKING still has the data
            self.stats.cache_errors += 1
            return None
        self.seq.note(off, size)            # a stream stays a stream across cached parts
        st = self.stats
        st.read_ops += 1
        st.hit_ops += 1
        st.read_bytes += len(data)
        st.hit_bytes += len(data)
        return data


def install_fast_hits(open_files: dict[int, OpenFile]) -> str | None:
    """Let _hit.c answer 4 KiB hits before Operations.read (pyfuse3's read hook).

    The C hook is read_hit's one-block branch on the same objects; every other read, and
    every block it is not sure of, goes to Operations.read. Returns None when installed,
    else why not (cachefs then serves every hit in Python, as before).
    """
    if not hasattr(pyfuse3, "set_read_hook"):
        return "pyfuse3 without deps/passthrough/pyfuse3-read-hook.patch"
    try:
        from . import _hit
    except ImportError as exc:
        return f"the C module cachefs/_hit.c is not built ({exc})"
    if (_hit.BLK_SIZE, _hit.EXT_SHIFT) != (BLK_SIZE, EXT_SHIFT):
        return "cachefs/_hit.c was built for another block or extent size"
    if _hit.block_sum(b"cachefs") != block_sum(b"cachefs"):
        return "cachefs/_hit.c's xxh3 differs from the xxhash package's"
    try:
        capsule = _hit.install(open_files, CHECK_READS, SEQ_SLACK, NBUCKETS, OpenFile,
                               CachedFile, Extent, SequentialDetector, Stats, Histogram)
    except (TypeError, ValueError) as exc:      # a slot renamed or gone: _hit.c is behind
        return f"cachefs/_hit.c does not fit the engine's objects ({exc})"
    pyfuse3.set_read_hook(capsule, None, BLK_SIZE)
    return None
