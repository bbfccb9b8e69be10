"""fallocate(2) through the cache: space reserved on BACKING, ranges punched or zeroed.

Owns `Allocations`, a base of writepath.WritePath (its methods use the engine's parts that
WritePath.__init__ sets). The kernel passes on FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE and
FALLOC_FL_ZERO_RANGE and refuses the other modes itself. BACKING does the work, always with
KEEP_SIZE: a size that grows goes through truncate afterwards, as the logical size of
write-back needs. The cache follows a punched or zeroed range as it follows a write that
goes around it (WritePath._write_around): clean cached blocks there turn invalid (BACKING's
zeros are read when wanted), dirty blocks (write-back) get the zeros in the cache file and
stay dirty. A file the kernel reads in passthrough (held: every block of its cache file
valid) gets the zeros through the write path instead. Never raises FUSEError.
"""

from __future__ import annotations

import errno
import os

from . import backingpaths as bp
from .cachefiles import pwrite_all
from .config import EXT_SIZE
from .extentmap import spans
from .extents import BLK_SHIFT, EXT_SHIFT, block_mask, covered_mask, runs
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
        if not mode & _ZEROING:
            await self._backing_fallocate(of, FALLOC_FL_KEEP_SIZE, off, size)
        elif cf.held is not None:
            await self._zero_held(of, off, min(end, cf.size))
        else:
            async with self._s.file_lock(cf):
                await self._zero_range(of, mode & _ZEROING, off, end)
        if not mode & FALLOC_FL_KEEP_SIZE and end > cf.size:
            await self.truncate(cf.ino, end, b"", of.backing_fd)     # through the fd

    async def _backing_fallocate(self, of: OpenFile, mode: int, off: int, size: int) -> None:
        """BACKING's fallocate, as an own change of the file (its times move)."""
        cf = of.cfile
        cf.writes_inflight += 1
        cf.backing_unsynced = True
        try:
            st = await self.backing.write_call(bp.fallocate_stat, of.backing_fd,
                                               mode | FALLOC_FL_KEEP_SIZE, off, size)
        finally:
            cf.writes_inflight -= 1
        self._c.own_change(cf, st, size_exact=False)

    async def _zero_range(self, of: OpenFile, mode: int, off: int, end: int) -> None:
        """Punch or zero [off, end) in BACKING, then in the cache (the file's lock held:
        no destage pass or write around the cache meanwhile)."""
        cf = of.cfile
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        cf.clobber(first, last)                 # promotions in flight read the old bytes
        cf.trunc_seq += 1                       # write-through writes in flight: theirs too
        self._forget_clean(cf, off, min(end, cf.size))  # readers go to BACKING meanwhile
        try:
            await self._backing_fallocate(of, mode, off, end - off)
        finally:
            cf.clobber(first, last)
            cf.trunc_seq += 1
        self._forget_clean(cf, off, min(end, cf.size))  # fills installed meanwhile
        self._zero_dirty(cf, off, min(end, cf.size))
        if cf.dirty_exts:                       # a later destage must not move the mtime
            self._s.written_now(cf)

    def _forget_clean(self, cf, off: int, end: int) -> None:
        for e, _, _, m in spans(off, end):
            x = cf.extents.get(e)
            if x is not None:
                self._s.map.invalidate(cf, x, m)

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
