"""The read hit: an open file handle and `read_hit`, a synchronous `pread` on the SSD file.

Owns `OpenFile` (one FUSE file handle: its BACKING fds, its cache state and its sequential
stream). `read_hit` is the hot path (STYLE.md §1): a bitmap test, one `os.pread` on the cache
file's descriptor opened at `open()`, the blocks' checksums (integrity.read_checked: it
raises Damaged, which fs.read hands to the slow path), counters; no await, lock, SQL or
logging.
Everything else about reads is in readpath.py.
"""

from __future__ import annotations

from . import readahead
from .config import BLK_SIZE
from .extents import BLK_SHIFT, BLKS_PER_EXT, EXT_SHIFT, CachedFile
from .integrity import read_block, read_checked
from .policy import SequentialDetector
from .stats import Stats

BLK_MASK = BLK_SIZE - 1
BLK_IN_EXT = BLKS_PER_EXT - 1


class OpenFile:
    """One open file handle: BACKING fd, the file's cache state and its sequential stream."""

    __slots__ = ("fh", "ino", "cfile", "backing_fd", "flags", "seq", "stats", "last_miss_ext",
                 "direct_fd", "ahead", "readable", "miss_lat", "mode", "dio_align")

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

    def read_hit(self, off: int, size: int) -> bytes | None:
        """Serve a read from the SSD if every block is cached: sync, no await, no SQL."""
        cf = self.cfile
        end = off + size
        if end > cf.size:
            end = cf.size
        if off >= end:
            return None
        try:
            if end - off == BLK_SIZE and not off & BLK_MASK:
                # One whole block, the 4 KiB random read: its test inlined (covers() was
                # 1 us of the ~8 us a hit cost in Python; bench/daemon_hits.sh).
                x = cf.extents.get(off >> EXT_SHIFT)
                b = (off >> BLK_SHIFT) & BLK_IN_EXT
                if x is None or not x.valid >> b & 1:
                    return None
                if x.freq < 3:
                    x.freq += 1
                data = read_block(cf, cf.cache_fd, x, off)
            else:
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
