"""The in-memory extent map: which 64 KiB extents of a BACKING file are cached, and which 4 KiB
blocks of each hold valid (equal to BACKING) data.

Owns: `Extent`, `CachedFile` (per BACKING inode: identity, logical size, extent dict) and the
bitmap arithmetic. Never does I/O: callers hold the file descriptors.

A block of an extent is *valid* when the cache file holds, at the same offset, exactly the bytes
BACKING holds there (bytes past the end of the file count as zeros). Invariant kept by the
engine: the cache file holds zeros past the file's size, so the block holding EOF stays valid
when the file grows.
"""

from __future__ import annotations

import os
import time

from .config import BLK_SIZE, EXT_SIZE

EXT_SHIFT = 16          # 64 KiB extents
BLK_SHIFT = 12          # 4 KiB blocks
BLKS_PER_EXT = EXT_SIZE // BLK_SIZE
FULL_MASK = (1 << BLKS_PER_EXT) - 1
KEEP_ATIME = -1         # CachedFile.times: leave BACKING's atime as it is


def block_mask(start: int, end: int) -> int:
    """Bitmask of the blocks touched by byte range [start, end) within one extent (0..64 KiB)."""
    if end <= start:
        return 0
    b0 = start >> BLK_SHIFT
    b1 = (end - 1) >> BLK_SHIFT
    return ((1 << (b1 + 1)) - 1) ^ ((1 << b0) - 1)


def covered_mask(start: int, end: int, eof_in_ext: int) -> int:
    """Blocks whose bytes below EOF all lie inside [start, end) (offsets within one extent).

    A block is covered when the range starts at or before the block and reaches its end or
    the end of the file, whichever comes first.
    """
    if not (start | end) & (BLK_SIZE - 1):
        return block_mask(start, end)       # block-aligned: every block it touches, whole
    mask = 0
    b = (start + BLK_SIZE - 1) >> BLK_SHIFT
    while b < BLKS_PER_EXT:
        bs = b << BLK_SHIFT
        be = min(bs + BLK_SIZE, max(eof_in_ext, bs + 1))
        if bs >= end or be > end:
            break
        mask |= 1 << b
        b += 1
    return mask


def popcount(mask: int) -> int:
    return bin(mask).count("1")


class Extent:
    """One cached 64 KiB extent: its valid and dirty block bitmaps and eviction bookkeeping."""

    __slots__ = ("ino", "ext", "valid", "dirty", "freq", "queue", "redirty", "sums", "summed",
                 "bad", "xsum", "db_dirty")

    def __init__(self, ino: int, ext: int, valid: int = 0, dirty: int = 0):
        self.ino = ino
        self.ext = ext
        self.valid = valid
        self.dirty = dirty
        self.freq = 0         # S3-FIFO access counter, 0..3
        self.queue = None     # which eviction queue holds it (policy's business)
        self.redirty = 0      # blocks written since the destager took its snapshot
        self.sums = None      # array('I') of 16 block checksums (integrity.py), or None
        self.summed = 0       # valid blocks whose checksum is known (a subset of valid)
        self.bad = 0          # dirty blocks found damaged on the SSD (never destaged)
        self.xsum = None      # checksum of the whole extent once its 16 blocks checked out
                              # (a whole-extent read: one hash, not 16); None after a change
        self.db_dirty = False  # the database's last committed record of it has dirty blocks
                               # (CacheState.committed)

    @property
    def key(self) -> tuple[int, int]:
        return (self.ino, self.ext)


class CachedFile:
    """Cache state of one BACKING inode.

    `identity` is (st_ino, size, mtime_ns, ctime_ns) of BACKING as last seen by cachefs; the
    cached extents are valid for that identity only. `size` is the file's size as known to the
    engine (the hit path clips reads to it).
    """

    __slots__ = ("ino", "_identity", "racy", "size", "extents", "cache_fd", "open_count",
                 "fills", "writes_inflight", "meta_inflight", "doomed", "path", "wb_fd",
                 "lock", "dirty_exts",
                 "wtrack", "trunc_seq", "change_seq", "ctime_pending", "recovered",
                 "shrinking", "cutting", "held", "verified", "times", "backing_unsynced",
                 "kernel_stale", "attrs_stale", "atime_read", "caps", "birth", "open_st",
                 "extending", "shown_size")

    @property
    def identity(self) -> tuple[int, int, int, int] | None:
        return self._identity

    @identity.setter
    def identity(self, ident: tuple[int, int, int, int] | None) -> None:
        """Also whether it is `racy` (seen in the second of the file's last change on a
        BACKING with 1-second timestamps: Coherence.revalidate)."""
        self._identity = ident
        self.racy = ident is not None and racy(ident, time.time_ns())

    def __init__(self, ino: int, identity: tuple[int, int, int, int] | None = None):
        self.ino = ino
        self.identity = identity
        self.size = identity[1] if identity else 0
        self.extents: dict[int, Extent] = {}
        self.cache_fd = -1
        self.open_count = 0
        self.fills: dict[int, bool] = {}   # ext -> clobbered, for promotions in flight
        self.writes_inflight = 0
        self.meta_inflight = 0             # own changes in flight (rename, chmod, destage)
        self.doomed = False                # last link removed: drop at the last release
        self.path: bytes | None = None     # BACKING path hint, for destaging after a restart
        self.wb_fd = -1                    # writable BACKING fd the destager uses
        self.lock = None                   # trio.Lock: destage vs truncate of this file
        self.dirty_exts = 0                # extents with dirty blocks
        self.atime_read: tuple[int, int, int] | None = None  # cache.atime_due's last
        self.caps: bytes | None = None     # security.capability set after the last write
        self.birth = 0                     # BACKING's birth time of the file (ns), 0: unknown
        # BACKING's stat last seen while handles are open (from the open on): what getattr
        # answers for them while BACKING does not answer (fs.getattr)
        self.open_st: os.stat_result | None = None
        # writes past the end in flight, and the size the kernel knows meanwhile (that
        # before them, moved by each one answered): what getattr says (WritePath.write)
        self.extending = 0
        self.shown_size = 0
        # ext -> {id: [block mask, tainted mask]} of write-through writes in flight: a block
        # two of them touched at once has an unknown last writer in BACKING (tainted)
        self.wtrack: dict[int, dict[int, list[int]]] = {}
        self.trunc_seq = 0                 # bumped by every truncation
        self.change_seq = 0                # bumped by every change cachefs makes to BACKING
        self.ctime_pending = False         # an own change moved BACKING's ctime, stat unknown
        self.recovered = False             # loaded after an unclean stop, not yet revalidated
        self.shrinking = None              # trio.Event while a write-back truncate commits
        self.cutting = False               # write-back: shrunk, BACKING not cut yet (its
                                           # bytes past `size` are no longer the file's)
        self.held = None                   # openmode.Held while the kernel may read the
                                           # cache file itself (passthrough opens, mappings)
        self.verified = True               # every block checked or written by this mount
                                           # (False when loaded: verify.py before passthrough)
        self.times = None                  # write-back: (atime_ns, mtime_ns) BACKING gets
                                           # after the dirty data (state.set_times), put
                                           # back on BACKING by destaging while dirty
        # write-back: BACKING itself was changed (created, written around the cache,
        # truncated, attributes set) since the last fsync, which must then sync BACKING too
        self.backing_unsynced = False
        # a getattr or lookup found BACKING changed: the kernel's pages of the file are old,
        # and its next open must not let the kernel keep them (its invalidation is queued)
        self.kernel_stale = False
        # an open found BACKING changed: the kernel's attributes of the file (its size) are
        # old, and are to be invalidated before that open is answered (fs._open_file)
        self.attrs_stale = False

    def held_limit(self) -> int | None:
        """Where the cache file the kernel reads stopped growing (openmode.Held.limit), or
        None: not held, detached since, or whole."""
        h = self.held
        return h.limit if h is not None and h.current else None

    def covers(self, off: int, end: int) -> bool:
        """True if every block of [off, end) is valid; counts the access for eviction."""
        e = off >> EXT_SHIFT
        last = (end - 1) >> EXT_SHIFT
        extents = self.extents
        while e <= last:
            x = extents.get(e)
            if x is None:
                return False
            base = e << EXT_SHIFT
            s = off - base if off > base else 0
            t = end - base if end - base < EXT_SIZE else EXT_SIZE
            m = block_mask(s, t)
            if x.valid & m != m:
                return False
            if x.freq < 3:
                x.freq += 1
            e += 1
        return True

    def all_valid(self, off: int, end: int) -> bool:
        """True if every block of [off, end) is valid (no access is counted)."""
        for e in range(off >> EXT_SHIFT, ((end - 1) >> EXT_SHIFT) + 1):
            x = self.extents.get(e)
            base = e << EXT_SHIFT
            m = block_mask(max(off, base) - base, min(end - base, EXT_SIZE))
            if x is None or x.valid & m != m:
                return False
        return True

    def clobber(self, first_ext: int, last_ext: int) -> None:
        """Mark promotions in flight for extents first..last (inclusive) as overtaken."""
        if self.fills:
            for e in self.fills:
                if first_ext <= e <= last_ext:
                    self.fills[e] = True

    def cached_bytes(self) -> int:
        return len(self.extents) * EXT_SIZE


SECOND_NS = 1_000_000_000


def racy(ident: tuple[int, int, int, int], seen_ns: int) -> bool:
    """Whether an identity seen at `seen_ns` (our clock) may miss a change: BACKING keeps
    whole seconds (ext3, ext4 with 128-byte inodes, NFSv3 and SMB servers, FAT: mtime and
    ctime both on a second) and the file changed in that second or the one before (a clock
    of BACKING's a little behind ours), so a same-size rewrite later in it leaves
    (size, mtime, ctime) as they are ("racy git")."""
    ctime, mtime = ident[3], ident[2]
    return not ctime % SECOND_NS and not mtime % SECOND_NS and seen_ns < ctime + 2 * SECOND_NS


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What makes cached data of a BACKING file valid: inode, size, mtime and ctime."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def runs(mask: int) -> list[tuple[int, int]]:
    """Runs of set bits in a block mask: [(first, end), ...] in block numbers."""
    out = []
    b = 0
    while mask >> b:
        if (mask >> b) & 1:
            start = b
            while (mask >> b) & 1:
                b += 1
            out.append((start, b))
        else:
            b += 1
    return out
