"""The read path past a hit: the read miss, sequential streams and read-ahead, the overlay
of dirty blocks on BACKING's bytes, and promotion (admission, then the promoter task that
installs extents off the request path).

Owns `ReadPath`: the promotion queue (back-pressure when full), the read-ahead nursery and
its in-flight count. Extent installs and evictions are the cache state's.
"""

from __future__ import annotations

import errno
import os

import trio

from . import readahead
from .config import EXT_SIZE
from .extentmap import spans
from .extents import BLK_SHIFT, EXT_SHIFT, CachedFile, Extent, runs
from .hit import OpenFile
from .integrity import Damaged, read_checked
from .state import CacheState


def slice_ext(data: bytes, off: int, e: int) -> bytes:
    """Extent `e`'s bytes out of `data` read at `off`."""
    lo = (e << EXT_SHIFT) - off
    return data[lo:lo + EXT_SIZE]


class ReadPath:
    def __init__(self, state: CacheState):
        self._s = state
        self.files = state.files
        self.pool = state.pool
        self.admission = state.admission
        self.dirty = state.dirty
        self.cachefiles = state.cachefiles
        self.stats = state.stats
        self.cfg = state.cfg
        self.backing = state.backing
        self._promote_send, self._promote_recv = trio.open_memory_channel(64)
        self._nursery: trio.Nursery | None = None  # read-ahead tasks (run_readahead)
        self._ahead_inflight = 0                   # read-ahead reads in worker threads
        self._ahead_max = max(1, state.cfg.backing_threads * 3 // 4)   # threads for the rest

    def filling(self) -> bool:
        """True while the pool has free room (below --promote-all-below): then every miss is
        cached on first touch, sequential streams included. An empty pool costs nothing to
        fill, and one-touch data is the first to go (S3-FIFO's small queue)."""
        return len(self.pool) < self._s.capacity_exts * self.cfg.promote_all_below

    async def read_damaged(self, of: OpenFile, off: int, size: int, exc: Damaged) -> bytes:
        """A read that met cached blocks failing their checksums: clean ones are dropped
        and read from BACKING; a dirty one fails the read with EIO (its data is lost)."""
        for _ in range(8):                      # each round drops what it found
            if self._s.damage.found(exc.cf, exc.bad, "read"):
                raise OSError(errno.EIO, "dirty data damaged on the cache SSD")
            try:
                return await self.read_miss(of, off, size)
            except Damaged as again:
                exc = again
        raise OSError(errno.EIO, "cached data keeps failing its checksums")

    async def read_miss(self, of: OpenFile, off: int, size: int) -> bytes:
        """Answer a read from BACKING; start promotion of extents that earned it.

        Write-back: the file's size is the engine's (`cf.size`), not BACKING's, and BACKING
        may be shorter: past BACKING's end, where no dirty block says otherwise, the file has
        zeros (an extending write's hole; dirty data cut off by a truncate since). Those are
        added here whatever happened during the BACKING reads (a truncate that took the last
        dirty block left the overlay nothing to pad for). While a truncate that shrank the file
        has not cut BACKING yet (`cutting`), the kernel, its setattr not answered, still
        reads at the old size: what BACKING holds past the new end is no longer the file's
        (older bytes of blocks that were dirty), so such reads end at the new end."""
        cf = of.cfile
        if not self._s.write_back:
            return await self._read_miss(of, off, size)
        if cf.cutting:
            size = min(off + size, cf.size) - off
            if size <= 0:
                self.stats.read_ops += 1
                return b""
        data = await self._read_miss(of, off, size)
        end = min(off + size, cf.size)
        if len(data) < end - off:
            data += bytes(end - off - len(data))
        return data

    async def _read_miss(self, of: OpenFile, off: int, size: int) -> bytes:
        cf = of.cfile
        st = self.stats
        if cf.extents:
            data = await self._read_mixed(of, off, size)   # BACKING's errors: the reader's
            if data is not None:
                return data
        st.read_ops += 1
        cutoff = self.cfg.sequential_cutoff
        before = self._dirty_blocks(cf, off, size)      # write-back: newer than BACKING
        if cutoff and of.seq.note(off, size) > cutoff:
            data = await self._stream_read(of, off, size)
            if before or cf.dirty_exts:
                data = await self._overlay_dirty(of, off, size, data, before)
            st.bypass_ops += 1
            st.bypass_bytes += len(data)
            st.read_bytes += len(data)
            of.miss_lat = st.lat_bypass     # no await before fs.read times it
            return data
        st.miss_ops += 1
        promote = []
        if self._s.capacity_exts and not self._s.ssd_full():
            filling = self.filling()
            for e in range((off >> EXT_SHIFT), ((off + size - 1) >> EXT_SHIFT) + 1):
                if e in cf.fills:
                    continue
                if e in cf.extents:             # partly valid: complete it
                    promote.append(e)
                    continue
                if filling:
                    promote.append(e)
                    continue
                if e == of.last_miss_ext:
                    continue
                key = (cf.ino, e)
                if self.admission.note_miss(key, self.pool.in_ghost(key)):
                    promote.append(e)
            of.last_miss_ext = (off + size - 1) >> EXT_SHIFT
        if not promote:
            data = await self._s.backing_read(of.backing_fd, size, off)
        else:
            start = min(off, promote[0] << EXT_SHIFT)
            end = max(off + size, (promote[-1] + 1) << EXT_SHIFT)
            for e in promote:
                cf.fills[e] = False
            try:
                whole = await self._s.backing_read(of.backing_fd, end - start, start)
            except BaseException:
                for e in promote:
                    cf.fills.pop(e, None)
                raise
            data = whole[off - start:off - start + size]
            await self._promote(cf, [(e, whole[(e << EXT_SHIFT) - start:
                                               (e << EXT_SHIFT) - start + EXT_SIZE])
                                     for e in promote])
        if before or cf.dirty_exts:
            data = await self._overlay_dirty(of, off, size, data, before)
        st.miss_bytes += len(data)
        st.read_bytes += len(data)
        of.miss_lat = st.lat_miss
        return data

    async def _read_mixed(self, of: OpenFile, off: int, size: int) -> bytes | None:
        """A read partly in the cache (a stream over a file with a few blocks invalid, as
        concurrent writes leave them): the extents wholly valid over the range come from the
        SSD, only the others from BACKING, whole, and those that are in the cache are
        completed. None when no extent of the range is wholly valid, or when one of them
        left the cache during the BACKING reads (the caller then reads as for any miss)."""
        cf = of.cfile
        end = min(off + size, cf.size)
        if end <= off:
            return None
        need, have = [], 0
        for e, _, _, m in spans(off, end):
            x = cf.extents.get(e)
            if x is None or x.valid & m != m:
                need.append(e)
            else:
                have += 1
        if not have or not need:
            return None
        groups: list[list[int]] = []              # runs of consecutive extents to read
        for e in need:
            if groups and groups[-1][-1] == e - 1:
                groups[-1].append(e)
            else:
                groups.append([e])
        complete = self._s.capacity_exts and not self._s.ssd_full()
        filling = self.filling()
        parts: dict[int, tuple[int, bytes]] = {}  # first ext -> (offset, bytes)
        for group in groups:
            g_off = group[0] << EXT_SHIFT
            g_size = min((group[-1] + 1) << EXT_SHIFT, cf.size) - g_off
            if g_size <= 0:     # a truncate during an earlier group's read ended the file
                return None     # before this group: read as for any miss
            fill = [e for e in group if complete and e not in cf.fills
                    and (e in cf.extents or filling)]
            for e in fill:
                cf.fills[e] = False
            before = self._dirty_blocks(cf, g_off, g_size)
            try:
                data = await self._s.backing_read(of.backing_fd, g_size, g_off)
            except BaseException:
                for e in fill:
                    cf.fills.pop(e, None)
                raise
            if fill:
                await self._promote(cf, [(e, slice_ext(data, g_off, e)) for e in fill])
            if before or cf.dirty_exts:
                data = await self._overlay_dirty(of, g_off, g_size, data, before)
            elif len(data) < g_size:            # past BACKING's end: zeros up to the size
                data += bytes(g_size - len(data))
            parts[group[0]] = (g_off, data)
        # No await from here: the SSD extents are read as the map says they are now.
        out = bytearray()
        from_ssd = 0
        try:
            fd = cf.cache_fd if cf.cache_fd >= 0 else self.cachefiles.fd(cf)
            for e, s, t, m in spans(off, end):
                part = None
                for g_off, data in parts.values():
                    if g_off <= s and t <= g_off + len(data):
                        part = data[s - g_off:t - g_off]
                        break
                if part is None:
                    from_ssd += t - s
                    x = cf.extents.get(e)
                    if x is None or x.valid & m != m:
                        return None             # evicted or written meanwhile
                    part = read_checked(cf, fd, s, t)      # raises Damaged
                out += part
        except OSError:                         # the SSD failed the read: BACKING has it
            self.stats.cache_errors += 1
            return None
        of.seq.note(off, size)
        st = self.stats
        st.read_ops += 1                        # a miss that read BACKING, for the ratios
        st.miss_ops += 1                        # ... though most of its bytes were hits
        st.mixed_ops += 1
        st.mixed_bytes += len(out)
        st.read_bytes += len(out)
        st.hit_bytes += from_ssd
        st.miss_bytes += len(out) - from_ssd
        of.miss_lat = st.lat_miss
        return bytes(out)

    async def _promote(self, cf: CachedFile, chunks: list[tuple[int, bytes]]) -> None:
        """Hand extents read from BACKING (their fills marked) to the promoter. A full queue
        holds the reader a moment (back-pressure) rather than losing the promotion."""
        for e, chunk in chunks:
            try:
                self._promote_send.send_nowait((cf, e, chunk))
            except trio.WouldBlock:
                self.stats.promotion_waits += 1
                await self._promote_send.send((cf, e, chunk))

    async def _stream_read(self, of: OpenFile, off: int, size: int) -> bytes:
        """A read of a sequential stream: taken from what was read ahead if still valid;
        starts reading the next requests ahead (cachefs/readahead.py). While the pool is
        filling, the whole extents it covers are promoted too."""
        cf = of.cfile
        ahead = of.ahead.pop(off, None)
        for o in [o for o in of.ahead if o < off]:    # the stream moved on without them
            del of.ahead[o]
        self._read_ahead(of, max(off + size, of.seq.next_off), size)   # past the furthest
        if ahead is not None and ahead.size == size:
            await ahead.done.wait()
            if readahead.usable(ahead, cf):
                exts = self._stream_promotions(cf, off, len(ahead.data))   # whole ones
                await self._promote(cf, [(e, slice_ext(ahead.data, off, e)) for e in exts])
                return ahead.data
        exts = self._stream_promotions(cf, off, size)
        try:
            data = await self._s.backing_read(of.backing_fd, size, off)
        except BaseException:
            for e in exts:
                cf.fills.pop(e, None)
            raise
        end = off + len(data)
        eof = len(data) < size                  # then an extent cut by EOF is complete
        for e in [e for e in exts if ((e + 1) << EXT_SHIFT) > end
                  and not (eof and (e << EXT_SHIFT) < end)]:
            cf.fills.pop(e, None)               # the read did not cover it
            exts.remove(e)
        await self._promote(cf, [(e, slice_ext(data, off, e)) for e in exts])
        return data

    def _stream_promotions(self, cf: CachedFile, off: int, size: int) -> list[int]:
        """Extents wholly inside a stream's read that are worth caching while the pool is
        filling; their fills are marked (a write meanwhile overtakes them)."""
        if not self._s.capacity_exts or self._s.ssd_full() or not self.filling():
            return []
        first = (off + EXT_SIZE - 1) >> EXT_SHIFT
        out = []
        for e in range(first, (off + size) >> EXT_SHIFT):
            if e not in cf.fills and e not in cf.extents:
                cf.fills[e] = False
                out.append(e)
        return out

    def _read_ahead(self, of: OpenFile, nxt: int, size: int) -> None:
        cf = of.cfile
        if self._nursery is None or cf.writes_inflight:
            return
        backing_size = cf.identity[1] if cf.identity else cf.size
        tok = readahead.token(cf)
        for i in range(readahead.depth(size)):
            o = nxt + i * size
            if o >= backing_size:
                break
            if o in of.ahead:
                continue
            if self._ahead_inflight >= self._ahead_max:
                return
            try:
                fd = os.dup(of.backing_fd)
            except OSError:                 # out of descriptors: no read-ahead, no error
                return
            ahead = of.ahead[o] = readahead.Ahead(o, size, tok)
            self._ahead_inflight += 1
            self._nursery.start_soon(self._fetch_ahead, ahead, fd)

    async def _fetch_ahead(self, ahead: "readahead.Ahead", fd: int) -> None:
        try:
            ahead.data = await self.backing.read_call("read", readahead.pread_close, fd,
                                                      ahead.size, ahead.off)
            self.stats.backing_read_ops += 1
            self.stats.backing_read_bytes += len(ahead.data)
        except Exception:           # BACKING error or timeout: the request reads itself
            ahead.data = None
        finally:
            self._ahead_inflight -= 1
            ahead.done.set()

    @staticmethod
    def _dirty_blocks(cf: CachedFile, off: int, size: int) -> list[tuple[Extent, int]]:
        """The dirty blocks of [off, off + size) now, as (extent, mask) pairs."""
        if not cf.dirty_exts:
            return []
        out = []
        for e, _, _, m in spans(off, min(off + size, cf.size)):
            x = cf.extents.get(e)
            if x is not None and x.dirty & m:
                out.append((x, x.dirty & m))
        return out

    async def _overlay_dirty(self, of: OpenFile, off: int, size: int, data: bytes,
                             before: list[tuple[Extent, int]]) -> bytes:
        """Lay the cached blocks newer than BACKING over bytes read from BACKING, and
        extend them with zeros up to the logical size.

        Newer are the blocks dirty now, and those dirty when the BACKING read began
        (`before`): the destager may have written them to BACKING during the read, which
        then saw either version. Those are still valid in the cache (clean now, the same
        bytes), unless dropped meanwhile (destaged, then evicted): then BACKING has them
        durably and is read again."""
        cf = of.cfile
        while True:
            buf = self._overlay(cf, off, size, data, before)
            if buf is not None:
                return buf
            self.stats.overlay_rereads += 1
            before = self._dirty_blocks(cf, off, size)
            data = await self._s.backing_read(of.backing_fd, size, off)

    def _overlay(self, cf: CachedFile, off: int, size: int, data: bytes,
                 before: list[tuple[Extent, int]]) -> bytes | None:
        """_overlay_dirty's synchronous part; None if a block of `before` left the cache."""
        was = {}
        for x, m in before:
            if cf.extents.get(x.ext) is not x or x.valid & m != m:
                return None
            was[x.ext] = m
        end = min(off + size, cf.size)
        if end <= off:
            return data
        buf = bytearray(data)
        if len(buf) < end - off:
            buf.extend(bytes(end - off - len(buf)))
        try:
            fd = self.cachefiles.fd(cf)
        except OSError as exc:
            # Dirty blocks only the SSD has: its failure to open the cache file (EPERM of
            # an immutable file, EMFILE, ENOENT) is an EIO of this read.
            self.stats.cache_errors += 1
            raise OSError(errno.EIO, f"cache file unusable: {exc}") from None
        for e, s, t, m in spans(off, end):
            x = cf.extents.get(e)
            if x is None:
                continue
            base = e << EXT_SHIFT
            for b0, b1 in runs((x.dirty | was.get(e, 0)) & m):
                bs = max(s, base + (b0 << BLK_SHIFT))
                bt = min(t, base + (b1 << BLK_SHIFT))
                buf[bs - off:bt - off] = read_checked(cf, fd, bs, bt)   # raises Damaged
        self.cachefiles.close_idle(cf)
        return bytes(buf)

    async def run_readahead(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The service whose nursery runs read-ahead reads (until the mount ends)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def run_promoter(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Install promoted extents in the SSD, off the request path."""
        task_status.started()
        async for cf, e, chunk in self._promote_recv:
            self._s.install(cf, e, chunk)
            await trio.sleep(0)
