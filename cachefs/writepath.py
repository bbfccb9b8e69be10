"""The write path: write-through (BACKING first, then the cached blocks), write-back (the
cache file, blocks turn dirty; flow control first), write-around (write-back when the SSD
cannot take it), truncate and fsync.

Owns `WritePath` (the writes to files the kernel reads by itself, in passthrough, are its
base `HeldWrites`, heldwrites.py; fallocate(2) is its base `Allocations`, allocate.py). Its
bracketing of awaits: promotions in flight are overtaken by writes and truncates
(`CachedFile.fills`), write-through updates the cached blocks no other write touched while
it was in flight, unless a truncate came meanwhile (`CachedFile.wtrack`, `trunc_seq`).
"""

from __future__ import annotations

import errno
import logging
import os

import trio

from . import backingpaths as bp
from .cachefiles import pwrite_all
from .coherence import Coherence
from .config import BLK_SIZE, EXT_SIZE
from .extentmap import spans
from .extents import BLK_SHIFT, EXT_SHIFT, CachedFile, block_mask, covered_mask, runs
from .allocate import Allocations
from .heldwrites import HeldWrites, read_by_kernel
from .hit import OpenFile
from .state import CUTS, CacheState
from .writeback import Destager


log = logging.getLogger("cachefs.writepath")

NO_ROOM, OVERTAKEN = "no room", "overtaken"     # why a fill for a partial write failed

class WritePath(HeldWrites, Allocations):
    def __init__(self, state: CacheState, coherence: Coherence, destager: Destager):
        self._s = state
        self._c = coherence
        self._destager = destager
        self.files = state.files
        self.pool = state.pool
        self.dirty = state.dirty
        self.cachefiles = state.cachefiles
        self.persister = state.persister
        self.store = state.store
        self.stats = state.stats
        self.backing = state.backing
        self.write_back = state.write_back

    async def write(self, of: OpenFile, off: int, data: bytes) -> int:
        cf = of.cfile
        if off + len(data) <= cf.size:
            return await self._write(of, off, data)
        # Past the end: until it is answered the kernel keeps the file's old size, and a
        # getattr meanwhile must say so (Coherence.logical_size). It said the new one
        # (the engine's, or BACKING's in write-through): fstat(2) gave a program that
        # size, the kernel did not have it, and a mapping of it died of SIGBUS at the
        # pages past the kernel's end (a helper's hunt: readers mapping a file appended to).
        if not cf.extending:
            cf.shown_size = cf.size
        cf.extending += 1
        try:
            n = await self._write(of, off, data)
            cf.shown_size = max(cf.shown_size, off + n)     # the kernel's size once answered
            return n
        finally:
            cf.extending -= 1

    async def _write(self, of: OpenFile, off: int, data: bytes) -> int:
        if self.write_back:
            return await self._write_back(of, off, data)
        if read_by_kernel(of.cfile):
            return await self._write_through_held(of, off, data)
        return await self._write_through(of, off, data)

    async def _write_back(self, of: OpenFile, off: int, data: bytes) -> int:
        """Write-back: the write lands in the cache file, its blocks turn dirty, done.

        Checkpoints: flow control (above --dirty-high), waiting for room while the pool is
        full of dirty data, and filling a partly written block that BACKING holds bytes of.
        After the last checkpoint everything is synchronous, hence atomic. When the SSD is
        out of space, a partly written block cannot be read from BACKING (a write-only
        handle BACKING would not reopen read-write), or the write needs room while destaging
        fails, the write goes around the cache.
        """
        await self._destager.throttle(len(data))
        reserved: list[int] = []     # [start] once room is reserved in a held cache file
        try:
            return await self._write_back_cached(of, off, data, reserved)
        except BaseException:
            if reserved:            # failed or cancelled: what the write did not use goes back
                self._unreserve(of.cfile, reserved[0], off + len(data))
            raise

    async def _write_back_cached(self, of: OpenFile, off: int, data: bytes,
                                 reserved: list[int]) -> int:
        cf = of.cfile
        end = off + len(data)
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        overtaken = filled = 0
        while True:
            if self._s.ssd_full():
                return await self._write_around(of, off, data)
            if cf.shrinking is not None:
                await cf.shrinking.wait()           # a truncate is committing its new end
                continue
            if read_by_kernel(cf) and not reserved:
                # Room in the cache file the kernel reads first (ENOSPC: nothing changed).
                start = min(off, cf.size)
                if await self._reserve_held(cf, start, end) < end:
                    # Its cache file stopped growing (heldwrites._freeze): BACKING takes it.
                    self._unreserve(cf, start, end)
                    return await self._write_around(of, off, data)
                reserved.append(start)
                continue
            low = first if cf.held is None else min(first, cf.size >> EXT_SHIFT)   # _fill_gap
            if (self.persister.punching((cf.ino, first)) if low == last else
                    any(self.persister.punching((cf.ino, e)) for e in range(low, last + 1))):
                # The hole of an extent this write needs is being punched (it was evicted
                # and its space is being released): data put there now would be zeroed.
                self.stats.punch_waits += 1
                await self.persister.wait_punched()
                continue
            gaps = self._partial_gaps(cf, off, end)
            if gaps:
                if not of.readable:
                    return await self._write_around(of, off, data)
                why = await self._fill_for_write(of, cf, gaps)
                if why == NO_ROOM and not self._s.ssd_full():
                    if self._destager.failing() or not self._room_may_come():
                        return await self._write_around(of, off, data)
                    await self._destager.wait_room()
                elif why == OVERTAKEN:
                    # A promotion of the same extent installed it first, or a truncate or
                    # an eviction got in: look again at once (a few times, then go around).
                    overtaken += 1
                    if overtaken > 3:
                        return await self._write_around(of, off, data)
                else:
                    # Filled, yet a partial block is still not valid: in a pool full of dirty
                    # data, installing the extent of one end of the write evicted the other
                    # end's, or BACKING returned less than cachefs takes its size to be.
                    # BACKING takes the write (writes_around) rather than this loop spinning
                    # (it did: a write-back model test hung, every await a bare checkpoint).
                    filled += 1
                    if filled > 1:
                        log.debug("inode %d: the fills of a partial-block write at %d did "
                                  "not stay; it goes to BACKING", cf.ino, off)
                        return await self._write_around(of, off, data)
                continue
            if first == last:
                missing = 0 if first in cf.extents else 1
            else:
                missing = sum(1 for e in range(first, last + 1) if e not in cf.extents)
            if missing and not self._s.make_room(missing):
                self.stats.throttled_writes += 1
                if self._destager.failing() or not self._room_may_come():
                    # No room, and destaging fails (BACKING errors) or cannot free any (the
                    # pool is full of files the kernel reads in passthrough, or pinned):
                    # BACKING takes this write or says why, rather than a wait for room
                    # that may never come.
                    return await self._write_around(of, off, data)
                await self._destager.wait_room()          # the pool is full of dirty data
                continue
            if missing and self._partial_gaps(cf, off, end):
                continue                # making room evicted a block this write fills
            break
        limit = cf.held_limit()
        if limit is not None and end > limit:
            # Its cache file stopped growing while this write waited (another write froze
            # it): no block past the limit may turn valid, or a later write there, which
            # goes around the cache, would be overwritten by this one's destage.
            return await self._write_around(of, off, data)
        grew = False
        try:
            if read_by_kernel(cf) and off > cf.size:
                grew = self._fill_gap(cf, cf.size, off)
            self._write_dirty(cf, off, data)
        except OSError as exc:
            # Full or failing (EIO): the write is not stored safely on the SSD, so it is
            # not acknowledged from there; BACKING takes it (or the write fails).
            self._s.ssd_failed(exc, "a write-back write")
            return await self._write_around(of, off, data)
        self._s.written_now(cf)                 # the mtime BACKING gets after the destage
        if cf.wb_fd < 0:
            cf.wb_fd = os.dup(of.backing_fd)    # the destager's writable BACKING fd
            self._s.persist_birth(cf)           # with the file's first dirty data
        self.stats.write_ops += 1
        self.stats.write_bytes += len(data)
        if grew or of.flags & (os.O_SYNC | os.O_DSYNC):
            await self.persister.persist(durable=True)
        return len(data)

    def _room_may_come(self) -> bool:
        """Whether destaging can free a cache slot: only dirty extents of files not
        protected (pinned, or held by passthrough) can be evicted once clean."""
        protected = self._s.pool.protected
        return any(ino not in protected for ino, _ in self.dirty)

    def _write_dirty(self, cf: CachedFile, off: int, data: bytes) -> None:
        """Put a write-back write into the cache file and mark its blocks dirty (sync).

        Extents whose clean blocks are overwritten in place are journaled first (a crash
        must not leave new bytes in blocks the database calls clean). On an SSD error the
        map is unchanged; blocks partly written hold either version of clean bytes, and the
        caller writes the same bytes to BACKING (_write_around), so both agree again.
        """
        end = off + len(data)
        parts = spans(off, end)
        for e, _, _, m in parts:
            x = cf.extents.get(e)
            if x is not None and x.valid & ~x.dirty & m:
                self.persister.journal_dirtying(x.key)      # before clean data changes
        fd = self.cachefiles.fd(cf)
        head, tail = self._zero_pads(cf, off, end)
        if cf.held is not None:      # the kernel reads a held cache file to its end
            tail = max(0, min(tail, cf.size - end))
        if head:
            pwrite_all(fd, bytes(head), off - head)
        if tail:
            pwrite_all(fd, bytes(tail), end)
        pwrite_all(fd, data, off)
        if end > cf.size:
            cf.size = end
        for e, s, t, m in parts:
            x = cf.extents.get(e)
            if x is None:
                x = self._s.map.add(cf, e)
            base = e << EXT_SHIFT
            self._s.map.write(cf, x, m, whole=covered_mask(s - base, t - base, cf.size - base),
                              data=data, data_off=off)
        self._s.persist_identity(cf)

    async def _write_around(self, of: OpenFile, off: int, data: bytes) -> int:
        """A write-back write that cannot be cached goes to BACKING at once (write-through).

        Then blocks it touched that hold dirty data get the new bytes in the cache file too
        (they are allocated, so this needs no new SSD space) and stay dirty: the destager
        later writes the merged blocks. Clean blocks it touched turn invalid. BACKING first:
        a write BACKING refuses, or takes only part of (full), changes nothing more in the
        cache. The file's lock keeps the destager out meanwhile: a destage pass that read a
        block before this write must not land after it.
        """
        cf = of.cfile
        first, last = off >> EXT_SHIFT, (off + len(data) - 1) >> EXT_SHIFT
        self.stats.writes_around += 1
        evicted = self._s.db_dirty_evicted
        if evicted and any((cf.ino, e) in evicted for e in range(first, last + 1)):
            # The database still calls an extent here dirty (destaged and evicted since the
            # last commit): it learns first, or after an unclean stop recovery would destage
            # the cache file's older bytes over this write. (A commit that fails: EIO.)
            await self.persister.persist(durable=True)
        async with self._s.file_lock(cf):
            if read_by_kernel(cf):
                return await self._write_around_held(of, off, data)
            cf.clobber(first, last)
            cf.writes_inflight += 1
            cf.backing_unsynced = True          # an fsync must sync BACKING for this write
            try:
                written, st = await self.backing.pwrite_stat(of.backing_fd, -1, data, off)
            finally:
                cf.writes_inflight -= 1
            cf.clobber(first, last)
            end = off + written
            view = memoryview(data)
            for e, s, t, m in spans(off, end):
                x = cf.extents.get(e)
                if x is None:
                    continue
                base = e << EXT_SHIFT
                for b0, b1 in runs(x.dirty & m):
                    bs = max(s, base + (b0 << BLK_SHIFT))
                    bt = min(t, base + (b1 << BLK_SHIFT))
                    try:
                        pwrite_all(self.cachefiles.fd(cf), view[bs - off:bt - off], bs)
                    except OSError as exc:
                        # The SSD is failing, or gone: its errno (ENOENT) would tell the
                        # program that the file is gone.
                        self._s.ssd_failed(exc, "a write into dirty blocks")
                        raise OSError(errno.EIO, "the cache SSD failed a write into dirty "
                                      "blocks") from None
                    self._s.map.write(cf, x, block_mask(bs - base, bt - base),
                                      whole=covered_mask(bs - base, bt - base, cf.size - base))
                self._s.map.invalidate(cf, x, m)
        self.stats.write_ops += 1
        self.stats.write_bytes += written
        self.stats.backing_write_ops += 1
        self.stats.backing_write_bytes += written
        self._c.own_change(cf, st, size_exact=False)
        if cf.dirty_exts:                   # the destage of older data must not move it back
            self._s.written_now(cf)
        if end > cf.size:
            cf.size = end
            self._s.persist_identity(cf)
        if of.flags & (os.O_SYNC | os.O_DSYNC):     # BACKING's fd has O_SYNC itself
            await self.persister.persist(durable=True)
        return written

    def _zero_pads(self, cf: CachedFile, off: int, end: int) -> tuple[int, int]:
        """Bytes to zero before and after a write in its partly written first and last
        blocks when those are not valid (past BACKING's end, so their other bytes are zeros;
        the cache file may still hold an evicted extent's old bytes there)."""
        if not (off | end) & (BLK_SIZE - 1):
            return 0, 0                     # block-aligned, the common case: nothing to pad
        pads = []
        for pos, before in ((off, True), (end, False)):
            part = pos & (BLK_SIZE - 1)
            if not part:
                pads.append(0)
                continue
            blk_start = pos - part
            x = cf.extents.get(blk_start >> EXT_SHIFT)
            bit = 1 << ((blk_start & (EXT_SIZE - 1)) >> BLK_SHIFT)
            if x is not None and x.valid & bit:
                pads.append(0)
            else:
                pads.append(part if before else BLK_SIZE - part)
        return pads[0], pads[1]             # (within one block: its two sides)

    def _partial_gaps(self, cf: CachedFile, off: int, end: int) -> list[int]:
        """Extents whose partly written first/last block holds BACKING bytes not cached."""
        if not (off | end) & (BLK_SIZE - 1):
            return []                       # block-aligned, the common case: no partial block
        backing_size = cf.identity[1] if cf.identity else 0
        gaps = []
        for pos, partial in ((off, off & (BLK_SIZE - 1)), (end, end & (BLK_SIZE - 1))):
            if not partial:
                continue
            blk_start = pos & ~(BLK_SIZE - 1)
            if blk_start >= backing_size:
                continue                        # past BACKING's end: zeros on both sides
            x = cf.extents.get(blk_start >> EXT_SHIFT)
            bit = 1 << ((blk_start & (EXT_SIZE - 1)) >> BLK_SHIFT)
            if x is None or not x.valid & bit:
                e = blk_start >> EXT_SHIFT
                if e not in gaps:
                    gaps.append(e)
        return gaps

    async def _fill_for_write(self, of: OpenFile, cf: CachedFile, exts: list[int]
                              ) -> str | None:
        """Read extents from BACKING into the cache so a sub-block write can be merged.
        None when they are in; NO_ROOM when the pool has no room for them (nothing read);
        OVERTAKEN when an install was refused for another reason (a promotion of the same
        extent came first, a truncate, an eviction): worth another look at once, whereas
        room comes only from the destager."""
        need = sum(1 for e in exts if e not in cf.extents)
        if need and not self._s.make_room(need):
            return NO_ROOM
        self.stats.partial_block_fills += 1
        for e in exts:
            cf.fills.setdefault(e, False)
        why = None
        for e in exts:
            try:
                chunk = await self._s.backing_read(of.backing_fd, EXT_SIZE, e << EXT_SHIFT)
            except BaseException:
                cf.fills.pop(e, None)
                raise
            if not self._s.install(cf, e, chunk):
                why = OVERTAKEN
        return why

    async def _write_through(self, of: OpenFile, off: int, data: bytes) -> int:
        """Write-through: BACKING first, then the cached blocks the write touches.

        While the BACKING write is in flight the touched blocks are invalid (readers go to
        BACKING). Afterwards the bytes go into the blocks no other write touched meanwhile
        (a block two writes touched at once has an unknown last writer in BACKING: it stays
        invalid), unless a truncate came meanwhile; fills that overlapped are dropped.
        Concurrent writes to other blocks of the same extent do not matter.
        """
        cf = of.cfile
        end = off + len(data)
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        cf.clobber(first, last)
        mine = []
        for e, _, _, m in spans(off, end):
            track = cf.wtrack.get(e)
            if track is None:
                track = cf.wtrack[e] = {}
            token = [m, 0]
            for other in track.values():
                both = other[0] & m
                if both:
                    other[1] |= both
                    token[1] |= both
            track[id(token)] = token
            mine.append((e, token))
            x = cf.extents.get(e)
            if x is not None:
                self._s.map.invalidate(cf, x, m)
        trunc_seq = cf.trunc_seq
        cf.writes_inflight += 1
        try:
            written, st = await self.backing.pwrite_stat(of.backing_fd, of.direct_fd, data, off)
        finally:
            cf.writes_inflight -= 1
            alone = {}
            for e, token in mine:
                track = cf.wtrack[e]
                alone[e] = token[0] & ~token[1]
                del track[id(token)]
                if not track:
                    del cf.wtrack[e]
        cf.clobber(first, last)       # fills that may have read BACKING before our write
        self.stats.write_ops += 1
        self.stats.write_bytes += written
        self.stats.backing_write_ops += 1
        self.stats.backing_write_bytes += written
        self._c.own_change(cf, st, size_exact=False)
        if trunc_seq == cf.trunc_seq:       # (a short write: the rest stays invalid)
            self._update_cached(cf, off, data if written == len(data) else data[:written],
                                alone)
        return written

    def _update_cached(self, cf: CachedFile, off: int, data: bytes,
                       alone: dict[int, int]) -> None:
        """Put a completed write's bytes into the cached blocks it was alone on (`alone`:
        extent -> block mask); the other blocks it touched stay invalid."""
        view = memoryview(data)
        for e, s, t, m in spans(off, off + len(data)):
            x = cf.extents.get(e)
            if x is None:
                continue
            ok = alone[e] & m
            if ok != m:
                self._s.map.invalidate(cf, x, m & ~ok)
            if not ok:
                continue
            base = e << EXT_SHIFT
            try:
                for b0, b1 in runs(ok):
                    bs = max(s, base + (b0 << BLK_SHIFT))
                    bt = min(t, base + (b1 << BLK_SHIFT))
                    pwrite_all(self.cachefiles.fd(cf), view[bs - off:bt - off], bs)
            except OSError as exc:
                self._s.ssd_failed(exc, "a write-through update")
                self.stats.drop_cache_error += 1
                self._s.map.remove(cf, x)
                continue
            # Blocks filled during the write hold our bytes now and BACKING's elsewhere.
            whole = covered_mask(s - base, t - base, cf.size - base) & ok
            # Partial blocks a fill made valid meanwhile hold our bytes and BACKING's.
            self._s.map.rewritten(cf, x, ok & ~whole, data, off)
            self._s.map.fill(cf, x, whole, data, off)

    async def truncate(self, ino: int, size: int, path: bytes, fd: int | None
                       ) -> os.stat_result:
        """Change a file's size in BACKING, dropping cached blocks past the new end."""
        cf = self.files.get(ino)
        if cf is not None and cf.caps is not None:
            self._s.set_caps(cf, None)  # BACKING's truncate drops the capability, as ext4's
        if cf is None:
            st = await self.backing.write_call(bp.truncate_stat, self.backing.root_fd, path,
                                               fd, size, ino)
            if self.write_back:     # no state to remember it for the next fsync: sync now
                if fd is not None:
                    await self.backing.write_call(os.fdatasync, fd)
                else:
                    await self.backing.write_call(bp.fsync_path, self.backing.root_fd, path,
                                                  True)
            return st
        if fd is None:      # by path: before the cache is cut, the path must still be this file
            bp.same_inode(await self.backing.read_call("truncate", bp.lstat,
                                                       self.backing.root_fd, path), ino)
        async with self._s.file_lock(cf):
            st = await self._truncate_locked(cf, size, path, fd)
        if cf.dirty_exts:                       # a later destage must not move the mtime
            self._s.written_now(cf)             # (the writes' clock: never before them)
        return st

    def _trim(self, cf: CachedFile, size: int, cut_file: bool = True) -> None:
        """Drop cached blocks past a new size (dirty ones too) and, with `cut_file`, zero
        the cache file there, as BACKING will be. The cache file is cut only once BACKING
        is truncated (and, in write-back, the trimmed map is durable): a crash before that
        must find the bytes the stored map still calls valid (invariant I5)."""
        cf.clobber(size >> EXT_SHIFT, 1 << 62)
        cf.trunc_seq += 1
        if self.write_back or cf.held is not None:
            # keep the block holding the new end: it may be dirty, or written by a mapping
            # (every block of a held file stays valid: its cache file is the file)
            keep_below = (size + BLK_SIZE - 1) & ~(BLK_SIZE - 1)
        else:                     # drop it: a racing read must not see early zeros
            keep_below = size & ~(BLK_SIZE - 1)
        for x in list(cf.extents.values()):
            base = x.ext << EXT_SHIFT
            if base >= keep_below:
                self._s.map.remove(cf, x)
            elif base + EXT_SIZE > keep_below:
                self._s.map.trim(cf, x, block_mask(0, keep_below - base))
        if not cut_file:
            return
        limit = cf.held_limit()
        if limit is not None:
            if size > limit:
                return      # its cache file ends before (past its limit the file is BACKING's)
            cf.held.limit = None    # the cache file holds the whole file again (zeros past it)
        try:
            self.cachefiles.truncate(cf, size)
        except FileNotFoundError:
            return
        x = cf.extents.get(size >> EXT_SHIFT)
        bit = 1 << ((size & (EXT_SIZE - 1)) >> BLK_SHIFT)
        if size & (BLK_SIZE - 1) and x is not None and x.valid & bit:
            self._s.map.fill(cf, x, bit)        # the block holding the end: zeros past it now

    async def _truncate_locked(self, cf: CachedFile, size: int, path: bytes, fd: int | None
                               ) -> os.stat_result:
        old_size = cf.size
        if size > old_size and read_by_kernel(cf):
            await self._reserve_held(cf, old_size, size)    # (up to its limit, if any)
        self._trim(cf, min(size, cf.size), cut_file=False)
        shrinking = None
        if self.write_back and size < cf.size:
            # Shrinking: the new logical size and the dirty blocks gone past it are durable
            # before BACKING shrinks, so that after a crash the file is never longer than
            # BACKING's truncate left it with older dirty data past the end (the database
            # may still call such data dirty even when memory no longer does).
            # Until the cache file is cut, its bytes past the new end are the old ones, and
            # until BACKING is cut, its are: writes to the file wait for the whole shrink (a
            # write past the end would expose them in the block holding it; one taken
            # during BACKING's call, which an O_TRUNC open makes with no lock of the
            # kernel's held, was trimmed away by its end: a helper's hunt). So the cut can
            # follow the commit (invariant I5 after a crash), and writes follow the cut.
            # A mount after a crash completes the cut it finds recorded (CacheState
            # ._complete_cut): the file never comes back at its old length with the dirty
            # blocks past the new end gone, nor shorter than the new size.
            cf.size = size
            cf.cutting = True
            self._s.persist_identity(cf)
            where = (path or cf.path or b"").hex()
            self.store.queue_meta(f"{CUTS}{cf.ino}", f"{size} {where}")
            shrinking = cf.shrinking = trio.Event()
        try:
            if shrinking is not None:
                await self.persister.persist(durable=True)
                self._trim(cf, size)        # again: promotions may have come meanwhile
            try:
                st = await self._truncate_backing(cf, size, old_size, path, fd)
            except OSError:
                # BACKING refused it (the caller gets the error): no later mount may cut
                # what the file gets after this.
                if shrinking is not None:
                    self.store.queue_meta(f"{CUTS}{cf.ino}", None)
                raise
            if shrinking is not None:
                self.store.queue_meta(f"{CUTS}{cf.ino}", None)      # BACKING is cut
            if cf.extending:
                cf.shown_size = size        # the kernel's size once this is answered
            return st
        finally:
            if shrinking is not None:
                shrinking.set()
                cf.shrinking = None

    async def _truncate_backing(self, cf: CachedFile, size: int, old_size: int, path: bytes,
                                fd: int | None) -> os.stat_result:
        cf.writes_inflight += 1
        cf.backing_unsynced = True
        try:
            st = await self.backing.write_call(bp.truncate_stat, self.backing.root_fd, path,
                                               fd, size, None if fd is not None else cf.ino)
        except BaseException:
            if size > old_size and cf.held is not None:
                self._unreserve(cf, old_size, size)     # the room reserved above
            raise
        finally:
            cf.writes_inflight -= 1
            cf.cutting = False
            # Fills that read the old contents during the call may have been installed.
            self._trim(cf, min(size, cf.size), cut_file=False)
        self._c.own_change(cf, st, size_exact=True)
        if size > old_size and cf.held is not None:
            await self._wait_punched(cf, old_size, size)
        self._trim(cf, size)                   # the cache file as long as the file again
        if size > old_size and read_by_kernel(cf) and self._fill_gap(cf, old_size, size):
            await self.persister.persist(durable=True)
        return st

    async def fsync(self, of: OpenFile, datasync: bool) -> None:
        """Write-back: data and the metadata naming it durable on the SSD, and what cachefs
        did to BACKING's file itself since the last fsync (its creation, writes that went
        around the cache, truncates, attributes): BACKING's fsync too. Write-through:
        BACKING's fsync."""
        if self.write_back:
            await self.persister.persist(durable=True)
            cf = of.cfile
            if not cf.backing_unsynced:
                return
            cf.backing_unsynced = False
            try:
                await self.backing.write_call(os.fdatasync if datasync else os.fsync,
                                              of.backing_fd)
            except BaseException:
                cf.backing_unsynced = True
                raise
        else:
            await self.backing.write_call(os.fdatasync if datasync else os.fsync,
                                          of.backing_fd)
