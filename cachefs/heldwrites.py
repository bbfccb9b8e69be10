"""Writes to files the kernel reads by itself (FUSE passthrough opens and their mappings:
openmode.Held): the cache file must hold every acknowledged write at once and in BACKING's
order, and a shared writable mapping may change it behind the engine's back.

Owns `HeldWrites`, the base of writepath.WritePath: these methods use its state (the
engine's parts, set by WritePath.__init__), and WritePath's own paths call them for held
files (`_write_through_held`, `_write_around_held`, `_mirror`); openmode calls `dirty_all`
and `sync_back`.
"""

from __future__ import annotations

import errno
import logging
import os

from . import backingpaths as bp
from .cachefiles import pwrite_all
from .extentmap import spans
from .config import BLK_SIZE, EXT_SIZE
from .extents import EXT_SHIFT, CachedFile, covered_mask
from .hit import OpenFile
from .room import NO_SPACE
from .state import MAPPED

log = logging.getLogger("cachefs.writepath")

_ZEROS = bytes(EXT_SIZE)
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


class HeldWrites:
    async def _write_through_held(self, of: OpenFile, off: int, data: bytes) -> int:
        """Write-through to a held file: its cache file is read by the kernel directly, so
        it must hold every acknowledged write at once and in BACKING's order: one write at
        a time (the file's lock), BACKING first, then the cache file (_mirror)."""
        async with self._s.file_lock(of.cfile):
            return await self._write_held(of, off, data, of.direct_fd)

    async def _write_held(self, of: OpenFile, off: int, data: bytes, direct_fd: int) -> int:
        """BACKING, then the cache file (the file's lock held by the caller)."""
        cf = of.cfile
        end = off + len(data)
        await self._wait_punched(cf, min(off, cf.size), end)
        await self._reserve_held(cf, min(off, cf.size), end)
        old_size = cf.size
        cf.clobber(off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT)
        cf.writes_inflight += 1
        cf.backing_unsynced = True              # write-back (around the cache): see fsync
        try:
            written, st = await self.backing.pwrite_stat(of.backing_fd, direct_fd, data, off)
        except BaseException:
            self._unreserve(cf, min(off, old_size), end)
            raise
        finally:
            cf.writes_inflight -= 1
        self.stats.write_ops += 1
        self.stats.write_bytes += written
        self.stats.backing_write_ops += 1
        self.stats.backing_write_bytes += written
        self._c.own_change(cf, st, size_exact=False)
        # A commit may have started punching holes of extents removed earlier (a truncate,
        # an eviction) while BACKING wrote: blocks added there now would be zeroed, and the
        # map refuses them (the daemon died on it, InvariantError).
        await self._wait_punched(cf, min(off, old_size), end)
        grew = off > old_size and cf.held is not None and self._fill_gap(cf, old_size, off)
        self._mirror(cf, off, memoryview(data)[:written])
        if grew:
            await self.persister.persist(durable=True)
        return written

    async def _reserve_held(self, cf: CachedFile, off: int, end: int) -> None:
        """Room in a held file's cache file for [off, end), allocated before anything else
        changes (fallocate, the size kept): the kernel reads that file by itself, so a write
        it cannot take would leave passthrough readers stale bytes (and in write-back it
        held the only copy of dirty data: detaching it lost them). No room even after
        evicting clean data and releasing its space: ENOSPC for this write, nothing
        changed, nothing dropped. (A cache filesystem without fallocate: not reserved.)"""
        if end <= off:
            return
        for attempt in (1, 2):
            try:
                bp.fallocate(self.cachefiles.fd(cf), _FALLOC_FL_KEEP_SIZE, off, end - off)
                return
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    return              # EOPNOTSUPP; an SSD error shows in the write itself
                self._unreserve(cf, off, end)
                self._s.ssd_failed(exc, "making room in a file in passthrough")
                if attempt == 2:
                    raise OSError(errno.ENOSPC, "no room on the cache filesystem for a file "
                                  "read in passthrough") from None
            await self.persister.persist(durable=False)     # evicted space is released

    def _unreserve(self, cf: CachedFile, off: int, end: int) -> None:
        """Give back what a reservation of [off, end) holds past the cache file's end: a
        fallocate that failed keeps the blocks it got (ext4), and a write that failed after
        its reservation never reached them. There no eviction or punch would ever release
        them (a helper's run: a 2 MiB cache file holding 65 MiB, the filesystem full for
        good)."""
        try:
            fd = self.cachefiles.fd(cf)
            size = os.fstat(fd).st_size
            if end > max(off, size):
                # ext4 frees blocks past the end at a truncate to the same size (and ignores a
                # punch there); other filesystems take the punch.
                os.ftruncate(fd, size)
                bp.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, max(off, size),
                             end - max(off, size))
        except OSError:
            pass

    async def _wait_punched(self, cf: CachedFile, off: int, end: int) -> None:
        """Wait while the hole of an extent in [off, end) is being punched (it was evicted
        or truncated away): bytes put there now would be zeroed."""
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        while any(self.persister.punching((cf.ino, e)) for e in range(first, last + 1)):
            self.stats.punch_waits += 1
            await self.persister.wait_punched()

    def _mirror(self, cf: CachedFile, off: int, data) -> None:
        """Put bytes BACKING now holds into a held file's cache file; the blocks they cover
        turn valid (extents are added even past the pool's size: held data cannot be
        evicted, and the kernel reads the cache file whatever the map says). On an SSD error
        the cache file stops being the file's: it is detached."""
        end = off + len(data)
        if end > cf.size:
            cf.size = end
        try:
            pwrite_all(self.cachefiles.fd(cf), data, off)
        except OSError as exc:
            self._s.ssd_failed(exc, "a write to a file in passthrough")
            self.stats.drop_cache_error += len(cf.extents)
            self._s.drop_file(cf)
            return
        for e, s, t, m in spans(off, end):
            x = cf.extents.get(e)
            if x is None:
                self._s.make_room(1)
                x = self._s.map.add(cf, e)
            base = e << EXT_SHIFT
            self._s.map.rewritten(cf, x, m)     # valid (partial, dirty) blocks it wrote into
            self._s.map.fill(cf, x, covered_mask(s - base, t - base, cf.size - base)
                             & ~x.dirty)
        self._s.persist_identity(cf)

    def _fill_gap(self, cf: CachedFile, start: int, end: int) -> bool:
        """A held file grows from `start` to `end` with no bytes written there (a truncate
        up, a write past the end): the cache file gets the zeros the file has there and the
        blocks turn valid. Every block of a held file is valid: the kernel reads, and a
        shared writable mapping writes, the cache file whatever the map says, and a read
        through cachefs of a block not valid would fill BACKING's zeros over what a mapping
        wrote there (nor would a write-back mapping's bytes there be destaged). The caller
        waited for holes being punched in the range. Returns whether a mapping may write the
        new blocks: their map is then to be made durable (a mount after a crash takes what
        the map holds of a mapped file as written)."""
        lo = (start + BLK_SIZE - 1) & ~(BLK_SIZE - 1)   # the block holding `start` is valid
        parts = spans(lo, end) if lo < end else []
        try:
            fd = self.cachefiles.fd(cf)
            if os.fstat(fd).st_size > start:
                os.ftruncate(fd, start)             # nothing but zeros past the old end
            for _, s, t, _ in parts:                # written, not holes: valid blocks hold
                pwrite_all(fd, _ZEROS[:t - s], s)   # bytes (recovery forgets holes, I5)
            os.ftruncate(fd, end)
        except OSError as exc:
            self._s.ssd_failed(exc, "extending a file in passthrough")
            if exc.errno in NO_SPACE and cf.dirty_exts:
                raise       # (the room was reserved: a truncate meanwhile) dirty data stays
            self.stats.drop_cache_error += len(cf.extents)
            self._s.drop_file(cf)
            return False
        for e, _, _, mask in parts:
            x = cf.extents.get(e)
            if x is None:
                self._s.make_room(1)
                self._s.map.add(cf, e, mask, _ZEROS, e << EXT_SHIFT)
            elif mask & ~x.valid:
                self._s.map.fill(cf, x, mask & ~x.valid, _ZEROS, e << EXT_SHIFT)
        self._s.persist_identity(cf)
        return cf.held.mapped_writable

    def dirty_all(self, of: OpenFile | None, why: str) -> None:
        """A shared writable mapping of a held file's cache file may change any block: the
        blocks' checksums are unknown until it is gone (sync_back). Write-back: every cached
        block counts as written (dirty), so the destager copies the cache file's bytes to
        BACKING; write-through copies at the end (sync_back). In both modes a mark (MAPPED,
        to be durable before the open is answered: Answer.durable) makes a mount after a
        crash take the whole file as dirty: the mapping may have written it since any
        destage."""
        cf = of.cfile if of is not None else None
        if cf is None:
            return
        self.store.queue_meta(f"{MAPPED}{cf.ino}", "1")
        for x in list(cf.extents.values()):
            self._s.map.unsummed(cf, x, known=False)
        if not self.write_back:
            return
        self._s.dirty_whole(cf, journal=True)
        if cf.wb_fd < 0 and of is not None and of.flags & os.O_ACCMODE != os.O_RDONLY:
            cf.wb_fd = os.dup(of.backing_fd)
        self.stats.passthrough_syncs += 1
        log.info("inode %d: all %d cached extents made dirty (%s may write its cache file "
                 "through a shared mapping)", cf.ino, len(cf.extents), why)

    async def sync_back(self, cf: CachedFile) -> None:
        """The end of a held file a shared writable mapping may have changed: write-back
        makes its blocks dirty again; write-through copies the cache file to BACKING."""
        self.stats.passthrough_syncs += 1
        for x in list(cf.extents.values()):
            self._s.map.unsummed(cf, x, known=True)     # as the mapping left them
        if self.write_back:
            self._s.dirty_whole(cf, journal=True)
            self.store.queue_meta(f"{MAPPED}{cf.ino}", None)     # with the dirty marks
            return
        async with self._s.file_lock(cf):
            size = cf.size
            cf.writes_inflight += 1
            try:
                st = await self.backing.write_call(_copy_back, self.cachefiles.path(cf.ino),
                                                   self.backing.root_fd, cf.path, cf.ino, size)
            finally:
                cf.writes_inflight -= 1
            self.store.queue_meta(f"{MAPPED}{cf.ino}", None)     # BACKING has it (or no file)
            if st is not None:
                self._c.own_change(cf, st, size_exact=False)
                self.stats.backing_write_ops += 1
                self.stats.backing_write_bytes += size
                log.info("inode %d: cache file copied to BACKING (%d bytes): a shared "
                         "mapping of it may have written it", cf.ino, size)

    async def _write_around_held(self, of: OpenFile, off: int, data: bytes) -> int:
        """_write_around for a held file (its lock held): BACKING, then the cache file, in
        that order, blocks dirty before stay dirty (their bytes are the newest now too)."""
        written = await self._write_held(of, off, data, -1)
        if of.cfile.dirty_exts:             # the destage of older data must not move it back
            self._s.written_now(of.cfile)
        if of.flags & (os.O_SYNC | os.O_DSYNC):
            await self.persister.persist(durable=True)
        return written


def _copy_back(cache_path: str, root: int, path: bytes | None, ino: int, size: int
               ) -> os.stat_result | None:
    """Copy a cache file's first `size` bytes over BACKING's file `ino` (at `path`, or found
    where it went: never another file that took its name) in a thread; its stat, or None if
    either file is gone."""
    try:
        cfd = os.open(cache_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        bfd = bp.open_by_ino(root, path, ino)
        if bfd < 0:
            return None
        try:
            off = 0
            while off < size:
                chunk = os.pread(cfd, min(1 << 20, size - off), off)
                if not chunk:
                    break
                pwrite_all(bfd, chunk, off)
                off += len(chunk)
            os.fsync(bfd)
            return os.fstat(bfd)
        finally:
            os.close(bfd)
    finally:
        os.close(cfd)
