"""Where a file has data: fallocate(2) through the cache (space reserved on BACKING, ranges
punched or zeroed) and lseek(2)'s SEEK_DATA and SEEK_HOLE.

Owns `Allocations`, a base of writepath.WritePath (its methods use the engine's parts that
WritePath.__init__ sets). The kernel passes on FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE and
FALLOC_FL_ZERO_RANGE and refuses the other modes itself. BACKING does the work, always with
KEEP_SIZE: a size that grows goes through truncate afterwards, as the logical size of
write-back needs. The cache follows a punched or zeroed range as it follows a write that
goes around it (WritePath._write_around): clean cached blocks there turn invalid (BACKING's
zeros are read when wanted), dirty blocks (write-back) get the zeros in the cache file and
stay dirty. A file the kernel reads in passthrough (held: every block of its cache file
valid) gets the zeros through the write path instead. SEEK_DATA and SEEK_HOLE ask BACKING
and, in write-back, count dirty blocks as data (BACKING may have a hole there yet), within
the logical size. Never raises FUSEError.
"""

from __future__ import annotations

import errno
import os

from . import backingpaths as bp
from .cachefiles import pwrite_all
from .config import EXT_SIZE
from .extentmap import spans
from .extents import (BLK_SHIFT, BLKS_PER_EXT, EXT_SHIFT, CachedFile, block_mask,
                      covered_mask, runs)
from .hit import OpenFile

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
_ZEROING = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE
MODES = frozenset((0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                   FALLOC_FL_ZERO_RANGE, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE))
HELD_CHUNK = 1 << 20                    # zeros written at a time into a held file
_ZEROS = bytes(max(EXT_SIZE, HELD_CHUNK))


class Allocations:
    async def fallocate(self, of: OpenFile, mode: int, off: int, size: int) -> None:
        """fallocate(2) of [off, off + size) through the open file `of`. Raises OSError
        (EOPNOTSUPP for a mode cachefs or BACKING does not have)."""
        if mode not in MODES:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        if off < 0 or size <= 0:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        cf = of.cfile
        end = off + size
        self.stats.fallocate_ops += 1
        if mode & _ZEROING:
            self.stats.zeroed_bytes += max(0, min(end, cf.size) - off)
        if not mode & _ZEROING:
            moved, _ = await self._backing_fallocate(of, FALLOC_FL_KEEP_SIZE, off, size)
            if moved and cf.dirty_exts:
                # BACKING's mtime moved (ext4's does), and the mount shows the time its
                # dirty data is to get: that one moves too, or the next destage would put
                # the older one back (rsync -a and make miss the change: a helper's hunt).
                self._s.written_now(cf)
        elif cf.held is not None:
            await self._zero_held(of, off, min(end, cf.size))
        else:
            async with self._s.file_lock(cf):
                await self._zero_range(of, mode & _ZEROING, off, end)
        if not mode & FALLOC_FL_KEEP_SIZE and end > cf.size:
            await self.truncate(cf.ino, end, b"", of.backing_fd)     # through the fd

    async def _backing_fallocate(self, of: OpenFile, mode: int, off: int, size: int
                                 ) -> tuple[bool, int]:
        """BACKING's fallocate, as an own change of the file (its times move): (whether
        BACKING's mtime is not the one known before, BACKING's size after it)."""
        cf = of.cfile
        known = cf.identity
        cf.writes_inflight += 1
        cf.backing_unsynced = True
        try:
            st = await self.backing.write_call(bp.fallocate_stat, of.backing_fd,
                                               mode | FALLOC_FL_KEEP_SIZE, off, size)
        finally:
            cf.writes_inflight -= 1
        self._c.own_change(cf, st, size_exact=False)
        return known is None or st.st_mtime_ns != known[2], st.st_size

    async def _zero_range(self, of: OpenFile, mode: int, off: int, end: int) -> None:
        """Punch or zero [off, end) in BACKING, then in the cache (the file's lock held:
        no destage pass or write around the cache meanwhile)."""
        cf = of.cfile
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        cf.clobber(first, last)                 # promotions in flight read the old bytes
        cf.trunc_seq += 1                       # write-through writes in flight: theirs too
        self._forget_clean(cf, off, min(end, cf.size))  # readers go to BACKING meanwhile
        try:
            _, backing_size = await self._backing_fallocate(of, mode, off, end - off)
            top = min(end, cf.size)
            if backing_size < top and self._dirty_whole(cf, max(off, backing_size), top):
                # Dirty blocks past BACKING's end (written here, not destaged yet: the
                # common case, generic/539): BACKING is made as long as the range first,
                # the new part a hole, so that they can go from the cache too.
                backing_size = await self._extend_backing(of, top)
            whole = min(end, cf.size, backing_size)
            if self._dirty_whole(cf, off, whole):
                # Dirty blocks wholly in the range, within BACKING's file: BACKING has their
                # new bytes (zeros, a hole) once its fallocate is durable, so they go from
                # the cache instead of turning into dirty zeros: BACKING keeps its hole (the
                # destage of those zeros filled it) and SEEK_HOLE finds it (generic/539).
                try:
                    await self.backing.write_call(os.fdatasync, of.backing_fd)
                except OSError:
                    pass                        # they get zeros and are destaged, as before
                else:
                    self._forget_dirty(cf, off, whole)
        finally:
            cf.clobber(first, last)
            cf.trunc_seq += 1
        self._forget_clean(cf, off, min(end, cf.size))  # fills installed meanwhile
        self._zero_dirty(cf, off, min(end, cf.size))    # the dirty blocks left: zeros
        if cf.dirty_exts:                       # a later destage must not move the mtime
            self._s.written_now(cf)

    async def _extend_backing(self, of: OpenFile, size: int) -> int:
        """Write-back: BACKING's file, shorter than the file is here, made `size` long (a
        hole), as an own change that keeps the file's size here; BACKING's size after it."""
        cf = of.cfile
        cf.writes_inflight += 1
        cf.backing_unsynced = True
        try:
            st = await self.backing.write_call(bp.truncate_stat, self.backing.root_fd, b"",
                                               of.backing_fd, size)
        finally:
            cf.writes_inflight -= 1
        self._c.own_change(cf, st, size_exact=False)    # (dirty data: the size stays)
        return st.st_size

    def _forget_clean(self, cf, off: int, end: int) -> None:
        for e, _, _, m in spans(off, end):
            x = cf.extents.get(e)
            if x is not None:
                self._s.map.invalidate(cf, x, m)

    @staticmethod
    def _whole(cf, off: int, end: int):
        """(extent, blocks of it wholly inside [off, end)) for each extent of the range."""
        for e, s, t, _ in spans(off, end):
            x = cf.extents.get(e)
            if x is not None:
                base = e << EXT_SHIFT
                yield x, covered_mask(s - base, t - base, cf.size - base)

    def _dirty_whole(self, cf, off: int, end: int) -> bool:
        return off < end and any(x.dirty & m for x, m in self._whole(cf, off, end))

    def _forget_dirty(self, cf, off: int, end: int) -> None:
        """Forget the blocks wholly inside [off, end), dirty ones too: BACKING has their
        bytes (durably: the caller synced it)."""
        for x, m in list(self._whole(cf, off, end)):
            if x.valid & m:
                self._s.map.trim(cf, x, x.valid & ~m)

    def _zero_dirty(self, cf, off: int, end: int) -> None:
        """Dirty blocks of [off, end) get zeros in the cache file and stay dirty (the
        destager writes them to BACKING, which has zeros there already); sync."""
        view = memoryview(_ZEROS)
        for e, s, t, m in spans(off, end):
            x = cf.extents.get(e)
            if x is None or not x.dirty & m:
                continue
            base = e << EXT_SHIFT
            for b0, b1 in runs(x.dirty & m):
                bs = max(s, base + (b0 << BLK_SHIFT))
                bt = min(t, base + (b1 << BLK_SHIFT))
                pwrite_all(self.cachefiles.fd(cf), view[:bt - bs], bs)
                self._s.map.write(cf, x, block_mask(bs - base, bt - base),
                                  whole=covered_mask(bs - base, bt - base, cf.size - base))

    async def _zero_held(self, of: OpenFile, off: int, end: int) -> None:
        """A held file: zeros through the write path (BACKING and the cache file in order),
        so that every block of its cache file stays valid for the kernel's own reads."""
        while off < end:
            n = min(HELD_CHUNK, end - off)
            await self.write(of, off, _ZEROS[:n])
            off += n

    # -- SEEK_DATA, SEEK_HOLE ------------------------------------------------------------

    async def seek(self, of: OpenFile, off: int, whence: int) -> int:
        """lseek(2) with SEEK_DATA or SEEK_HOLE from `off`: BACKING's answer, with dirty
        blocks as data. Raises OSError (ENXIO: `off` at or past the end, or no data after
        it)."""
        if whence not in (os.SEEK_DATA, os.SEEK_HOLE):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        cf = of.cfile
        backing_size = (await self.backing.read_call("stat", os.fstat, of.backing_fd)).st_size
        size = self._c.logical_size(cf.ino, backing_size)
        if off < 0 or off >= size:
            raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
        dirty = cf.dirty_exts > 0
        if whence == os.SEEK_DATA:
            found = await self._backing_seek(of, off, os.SEEK_DATA, backing_size)
            if dirty:
                d = _next_dirty(cf, off)
                if d is not None and (found is None or d < found):
                    found = d
            if found is None or found >= size:
                raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
            return found
        pos = off
        while True:
            hole = await self._backing_seek(of, pos, os.SEEK_HOLE, backing_size)
            if hole is None:                    # past BACKING's end: a hole, unless dirty
                hole = pos
            run_end = _dirty_run_end(cf, hole) if dirty else None
            if run_end is None:
                return min(hole, size)
            if run_end >= size:
                return size
            pos = run_end

    async def _backing_seek(self, of: OpenFile, off: int, whence: int, backing_size: int
                            ) -> int | None:
        """BACKING's lseek; None where BACKING has nothing to say (past its end: ENXIO)."""
        if off >= backing_size:
            return None
        try:
            return await self.backing.read_call("stat", os.lseek, of.backing_fd, off, whence)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            return None


def _next_dirty(cf: CachedFile, off: int) -> int | None:
    """The first byte at or after `off` in a dirty block of `cf`, or None."""
    first = off >> EXT_SHIFT
    best = None
    for e, x in cf.extents.items():
        d = x.dirty
        if e < first or not d:
            continue
        if e == first:
            d &= ~((1 << ((off >> BLK_SHIFT) & (BLKS_PER_EXT - 1))) - 1)   # from off's block
            if not d:
                continue
        pos = max(off, (e << EXT_SHIFT) + (((d & -d).bit_length() - 1) << BLK_SHIFT))
        if best is None or pos < best:
            best = pos
    return best


def _dirty_run_end(cf: CachedFile, pos: int) -> int | None:
    """If the block holding `pos` is dirty: where the run of dirty blocks from it ends."""
    b = pos >> BLK_SHIFT
    end = None
    while True:
        x = cf.extents.get(b // BLKS_PER_EXT)
        if x is None or not (x.dirty >> (b % BLKS_PER_EXT)) & 1:
            return end
        b += 1
        end = b << BLK_SHIFT
