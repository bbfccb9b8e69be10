"""The engine: cache hits, misses and fills, promotion, write-through writes, truncation,
coherence with BACKING, eviction and batched persistence.

Owns all extent state changes. Never imports pyfuse3: `fs.py` translates requests into calls
here. Extent state changes happen in synchronous code (atomic under trio); an `await` in the
middle of an operation is bracketed by a generation check (`Extent.gen`, `CachedFile.fills`)
so that data read or written before the await is never installed over newer data.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from typing import Callable

import trio

from . import backing as bk
from .backing import Backing
from .config import EXT_SIZE, Config
from .extents import EXT_SHIFT, CachedFile, Extent, block_mask, covered_mask
from .policy import Admission, S3Fifo, SequentialDetector
from .stats import Stats
from .store import MetadataStore

log = logging.getLogger("cachefs.cache")

_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_PUNCH = 0x01 | 0x02          # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_FLAGS_NOT_FOR_BACKING = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_APPEND | getattr(
    os, "O_DIRECT", 0)


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What makes cached data of a BACKING file valid: inode, size, mtime and ctime."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def punch_hole(fd: int, off: int, size: int) -> None:
    _libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
                                ctypes.c_longlong)
    if _libc.fallocate(fd, _FALLOC_PUNCH, off, size) != 0:
        err = ctypes.get_errno()
        if err != errno.EOPNOTSUPP:           # without hole punching the space stays used
            raise OSError(err, os.strerror(err))


class OpenFile:
    """One open file handle: BACKING fd, the file's cache state and its sequential stream."""

    __slots__ = ("fh", "ino", "cfile", "backing_fd", "flags", "seq", "stats", "last_miss_ext")

    def __init__(self, fh: int, cfile: CachedFile, backing_fd: int, flags: int, stats: Stats):
        self.fh = fh
        self.ino = cfile.ino
        self.cfile = cfile
        self.backing_fd = backing_fd
        self.flags = flags
        self.seq = SequentialDetector()
        self.stats = stats
        self.last_miss_ext = -1     # consecutive misses in one extent count as one access

    def read_hit(self, off: int, size: int) -> bytes | None:
        """Serve a read from the SSD if every block is cached: sync, no await, no SQL."""
        cf = self.cfile
        end = off + size
        if end > cf.size:
            end = cf.size
        if off >= end or not cf.extents or not cf.covers(off, end):
            return None
        try:
            data = os.pread(cf.cache_fd, end - off, off)
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


class Cache:
    def __init__(self, cfg: Config, store: MetadataStore, backing: Backing, stats: Stats,
                 capacity_exts: int, on_stale: Callable[[int], None]):
        self.cfg = cfg
        self.store = store
        self.backing = backing
        self.stats = stats
        self.capacity_exts = capacity_exts
        self.files: dict[int, CachedFile] = {}
        self.pool = S3Fifo(capacity_exts)
        self.admission = Admission(cfg.promote_after)
        self._on_stale = on_stale
        self._data_dir = os.path.join(cfg.cache_dir, "data")
        self._promote_send, self._promote_recv = trio.open_memory_channel(64)
        self._written: set[int] = set()              # inos with cache data not yet fdatasync'd
        self._punch: dict[tuple[int, int], None] = {}          # evicted, not yet committed
        self._punch_committing: dict[tuple[int, int], None] = {}
        self._punching: set[tuple[int, int]] = set()           # holes being punched now

    # -- state -----------------------------------------------------------------------------

    def load(self) -> None:
        """Rebuild the in-memory map from the store (warm restart)."""
        files, extents = self.store.load()
        for ino, (size, mtime_ns, ctime_ns) in files.items():
            self.files[ino] = CachedFile(ino, (ino, size, mtime_ns, ctime_ns))
        dropped = 0
        for ino, ext, valid, dirty in extents:
            cf = self.files.get(ino)
            if cf is None or len(self.pool) >= self.capacity_exts or not valid:
                self.store.queue_drop_extent(ino, ext)
                dropped += 1
                continue
            x = Extent(ino, ext, valid, dirty)
            cf.extents[ext] = x
            self.pool.insert_main(x)
        if dropped:
            log.info("dropped %d extents beyond the cache size", dropped)

    def used_bytes(self) -> int:
        return len(self.pool) * EXT_SIZE

    def cache_path(self, ino: int) -> str:
        return os.path.join(self._data_dir, "%02x" % (ino & 0xFF), str(ino))

    def _cache_fd(self, cf: CachedFile) -> int:
        if cf.cache_fd < 0:
            path = self.cache_path(cf.ino)
            try:
                cf.cache_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                cf.cache_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return cf.cache_fd

    def _close_idle_fd(self, cf: CachedFile) -> None:
        if cf.open_count == 0 and cf.cache_fd >= 0:
            os.close(cf.cache_fd)
            cf.cache_fd = -1

    def _persist_identity(self, cf: CachedFile) -> None:
        if cf.extents:
            _, size, mtime_ns, ctime_ns = cf.identity
            self.store.queue_file(cf.ino, size, mtime_ns, ctime_ns)

    def _remove_extent(self, cf: CachedFile, x: Extent) -> None:
        self.pool.remove(x)
        x.gen += 1
        del cf.extents[x.ext]
        self.store.queue_drop_extent(cf.ino, x.ext)

    def drop_file(self, cf: CachedFile) -> None:
        """Forget every cached extent of a file (its BACKING identity changed)."""
        for x in list(cf.extents.values()):
            self.pool.remove(x)
            x.gen += 1
        cf.extents.clear()
        cf.clobber(0, 1 << 62)
        self.admission.forget_file(cf.ino)
        self.store.queue_drop_file(cf.ino)
        # Safe before the commit: the stored identity no longer matches BACKING.
        try:
            if cf.cache_fd >= 0:
                os.ftruncate(cf.cache_fd, 0)
            else:
                os.truncate(self.cache_path(cf.ino), 0)
        except OSError:          # missing or unwritable: the map no longer claims it anyway
            pass

    def revalidate(self, cf: CachedFile, st: os.stat_result) -> bool:
        """Compare BACKING's identity with the recorded one; drop stale data. True if same."""
        ident = identity(st)
        if cf.identity == ident:
            return True
        if cf.writes_inflight:          # our own write is changing it; its fstat follows
            return True
        if cf.identity is not None and (cf.extents or cf.fills):
            self.stats.stale_files += 1
            log.info("BACKING inode %d changed behind the cache (%s -> %s); dropping %d "
                     "cached extents", cf.ino, cf.identity[1:], ident[1:], len(cf.extents))
            self.drop_file(cf)
        cf.identity = ident
        cf.size = st.st_size
        return False

    def _own_change(self, cf: CachedFile, st: os.stat_result, size_exact: bool) -> None:
        """Record BACKING's identity after a change made by cachefs itself."""
        cf.identity = identity(st)
        cf.size = st.st_size if size_exact or not cf.writes_inflight else max(cf.size,
                                                                              st.st_size)
        self._persist_identity(cf)

    def attributes_seen(self, ino: int, st: os.stat_result) -> None:
        """getattr/lookup saw BACKING's attributes: revalidate, invalidate the kernel cache."""
        cf = self.files.get(ino)
        if cf is not None and not self.revalidate(cf, st):
            self._on_stale(ino)

    def own_metadata_change(self, ino: int, st: os.stat_result) -> None:
        """cachefs changed attributes (chmod, rename, link...): the ctime moved, data did not."""
        cf = self.files.get(ino)
        if cf is not None and cf.identity is not None and cf.identity[1] == st.st_size:
            cf.identity = identity(st)
            self._persist_identity(cf)

    def forget(self, ino: int) -> None:
        cf = self.files.get(ino)
        if cf is not None and cf.open_count == 0 and not cf.extents and not cf.fills:
            del self.files[ino]

    def last_link_removed(self, ino: int) -> None:
        """BACKING no longer has the file: its data goes now, or at the last release."""
        cf = self.files.get(ino)
        if cf is None:
            return
        if cf.open_count:
            cf.doomed = True
        else:
            self._discard(cf)

    def _discard(self, cf: CachedFile) -> None:
        self.drop_file(cf)
        self._close_idle_fd(cf)
        del self.files[cf.ino]
        try:
            os.unlink(self.cache_path(cf.ino))
        except FileNotFoundError:
            pass

    # -- open / release --------------------------------------------------------------------

    async def open(self, fh: int, ino: int, path: bytes, flags: int) -> tuple[OpenFile, bool]:
        """Open BACKING, revalidate cached data; returns the handle and whether the kernel may
        keep its page cache for the file."""
        bflags = (flags & ~_FLAGS_NOT_FOR_BACKING) | os.O_CLOEXEC
        if flags & os.O_TRUNC:
            fd, st = await self.backing.write_call(_open_fstat, path, bflags)
        else:
            fd, st = await self.backing.read_call("open", _open_fstat, path, bflags)
        cf = self.files.get(ino)
        if cf is None:
            cf = self.files[ino] = CachedFile(ino)
        unchanged = self.revalidate(cf, st) and cf.identity is not None
        cf.open_count += 1
        if cf.extents:
            try:
                self._cache_fd(cf)
            except OSError as exc:          # serve from BACKING rather than fail the open
                self.stats.cache_errors += 1
                log.warning("cannot open the cache file of inode %d: %s", ino, exc)
                self.drop_file(cf)
        return OpenFile(fh, cf, fd, flags, self.stats), unchanged

    async def create(self, fh: int, path: bytes, flags: int, mode: int, uid: int, gid: int,
                     parent: bytes, remember: Callable[[os.stat_result], int]
                     ) -> tuple[OpenFile, os.stat_result]:
        """Create and open a BACKING file owned by uid/gid; `remember` names its inode."""
        bflags = (flags & ~_FLAGS_NOT_FOR_BACKING) | (flags & os.O_EXCL) | os.O_CLOEXEC
        fd, st = await self.backing.write_call(bk.create, path, bflags, mode, uid, gid, parent)
        ino = remember(st)
        cf = self.files.get(ino)
        if cf is None:
            cf = self.files[ino] = CachedFile(ino)
        self.revalidate(cf, st)
        cf.open_count += 1
        return OpenFile(fh, cf, fd, flags, self.stats), st

    def release(self, of: OpenFile) -> int:
        """Drop a handle; returns the BACKING fd for the caller to close in a thread."""
        cf = of.cfile
        cf.open_count -= 1
        if cf.doomed and cf.open_count == 0 and self.files.get(cf.ino) is cf:
            self._discard(cf)
        self._close_idle_fd(cf)
        return of.backing_fd

    # -- reads -----------------------------------------------------------------------------

    async def read_miss(self, of: OpenFile, off: int, size: int) -> bytes:
        """Answer a read from BACKING; start promotion of extents that earned it."""
        cf = of.cfile
        st = self.stats
        st.read_ops += 1
        cutoff = self.cfg.sequential_cutoff
        if cutoff and of.seq.note(off, size) > cutoff:
            data = await self._backing_read(of.backing_fd, size, off)
            st.bypass_ops += 1
            st.bypass_bytes += len(data)
            st.read_bytes += len(data)
            return data
        st.miss_ops += 1
        promote = []
        if self.capacity_exts:
            for e in range((off >> EXT_SHIFT), ((off + size - 1) >> EXT_SHIFT) + 1):
                if e in cf.fills:
                    continue
                if e in cf.extents:             # partly valid: complete it
                    promote.append(e)
                    continue
                if e == of.last_miss_ext:
                    continue
                key = (cf.ino, e)
                if self.admission.note_miss(key, self.pool.in_ghost(key)):
                    promote.append(e)
            of.last_miss_ext = (off + size - 1) >> EXT_SHIFT
        if not promote:
            data = await self._backing_read(of.backing_fd, size, off)
        else:
            start = min(off, promote[0] << EXT_SHIFT)
            end = max(off + size, (promote[-1] + 1) << EXT_SHIFT)
            for e in promote:
                cf.fills[e] = False
            try:
                whole = await self._backing_read(of.backing_fd, end - start, start)
            except BaseException:
                for e in promote:
                    cf.fills.pop(e, None)
                raise
            for e in promote:
                lo = (e << EXT_SHIFT) - start
                chunk = whole[lo:lo + EXT_SIZE]
                try:
                    self._promote_send.send_nowait((cf, e, chunk))
                except trio.WouldBlock:
                    cf.fills.pop(e, None)
                    st.promotions_dropped += 1
            data = whole[off - start:off - start + size]
        st.miss_bytes += len(data)
        st.read_bytes += len(data)
        return data

    async def _backing_read(self, fd: int, size: int, off: int) -> bytes:
        try:
            data = await self.backing.pread(fd, size, off)
        except OSError:
            self.stats.backing_errors += 1
            raise
        self.stats.backing_read_ops += 1
        self.stats.backing_read_bytes += len(data)
        return data

    async def run_promoter(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Install promoted extents in the SSD, off the request path."""
        task_status.started()
        async for cf, e, chunk in self._promote_recv:
            self.install(cf, e, chunk)
            await trio.sleep(0)

    def install(self, cf: CachedFile, e: int, chunk: bytes) -> bool:
        """Write one extent read from BACKING into the cache, unless it was overtaken."""
        clobbered = cf.fills.pop(e, True)
        key = (cf.ino, e)
        if (clobbered or not chunk or self.files.get(cf.ino) is not cf
                or key in self._punching):
            self.stats.promotions_dropped += 1
            return False
        x = cf.extents.get(e)
        if x is None and not self._make_room():
            self.stats.promotions_dropped += 1
            return False
        try:
            os.pwrite(self._cache_fd(cf), chunk, e << EXT_SHIFT)
        except OSError as exc:
            self.stats.cache_errors += 1
            self.stats.promotions_dropped += 1
            log.warning("cannot write to the cache directory: %s", exc)
            if x is not None:
                self._remove_extent(cf, x)
            self._close_idle_fd(cf)
            return False
        valid = block_mask(0, len(chunk))
        if x is None:
            x = cf.extents[e] = Extent(cf.ino, e, valid)
            self.pool.insert(x)
            self._punch.pop(key, None)
            self._punch_committing.pop(key, None)
            if len(cf.extents) == 1:
                self._persist_identity(cf)
        else:
            x.valid |= valid
        self.store.queue_extent(cf.ino, e, x.valid, x.dirty)
        self._written.add(cf.ino)
        self.stats.promotions += 1
        self._close_idle_fd(cf)
        return True

    def _make_room(self) -> bool:
        while len(self.pool) >= self.capacity_exts:
            x = self.pool.victim()
            if x is None:
                return False
            cf = self.files[x.ino]
            x.gen += 1
            del cf.extents[x.ext]
            self.store.queue_drop_extent(x.ino, x.ext)
            self._punch[x.key] = None
            self.stats.evictions += 1
            if not cf.extents:
                self.store.queue_drop_file(cf.ino)
        return True

    # -- writes ----------------------------------------------------------------------------

    async def write(self, of: OpenFile, off: int, data: bytes) -> int:
        """Write-through: BACKING first, then the cached blocks the write touches."""
        cf = of.cfile
        end = off + len(data)
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        cf.clobber(first, last)
        touched = []
        for e in range(first, last + 1):
            x = cf.extents.get(e)
            if x is not None:
                base = e << EXT_SHIFT
                x.gen += 1
                touched.append((x, x.gen, x.valid))
                x.valid &= ~block_mask(max(off, base) - base, min(end, base + EXT_SIZE) - base)
        cf.writes_inflight += 1
        try:
            written, st = await self.backing.pwrite_stat(of.backing_fd, data, off)
        except OSError:
            self.stats.backing_errors += 1
            for x, _, _ in touched:
                self.store.queue_extent(cf.ino, x.ext, x.valid, x.dirty)
            raise
        finally:
            cf.writes_inflight -= 1
        self.stats.write_ops += 1
        self.stats.write_bytes += written
        self.stats.backing_write_ops += 1
        self.stats.backing_write_bytes += written
        self._own_change(cf, st, size_exact=False)
        if touched:
            self._update_cached(cf, off, data, touched)
        return written

    def _update_cached(self, cf: CachedFile, off: int, data: bytes, touched: list) -> None:
        end = off + len(data)
        view = memoryview(data)
        for x, gen, old_valid in touched:
            if x.gen != gen or cf.extents.get(x.ext) is not x:
                continue                  # overtaken by another write, truncate or eviction
            base = x.ext << EXT_SHIFT
            s, t = max(off, base), min(end, base + EXT_SIZE)
            try:
                os.pwrite(self._cache_fd(cf), view[s - off:t - off], s)
            except OSError as exc:
                self.stats.cache_errors += 1
                log.warning("cannot update the cache directory: %s", exc)
                self._remove_extent(cf, x)
                continue
            x.valid = old_valid | covered_mask(s - base, t - base, cf.size - base)
            self.store.queue_extent(cf.ino, x.ext, x.valid, x.dirty)
            self._written.add(cf.ino)

    async def truncate(self, ino: int, size: int, path: bytes, fd: int | None
                       ) -> os.stat_result:
        """Change a file's size in BACKING, dropping cached blocks past the new end."""
        cf = self.files.get(ino)
        if cf is not None:
            cf.clobber(size >> EXT_SHIFT, 1 << 62)
            keep_below = size & ~0xFFF            # the block holding the new end is dropped
            for x in list(cf.extents.values()):
                base = x.ext << EXT_SHIFT
                if base >= keep_below:
                    self._remove_extent(cf, x)
                elif base + EXT_SIZE > keep_below:
                    x.gen += 1
                    x.valid &= block_mask(0, keep_below - base)
                    self.store.queue_extent(ino, x.ext, x.valid, x.dirty)
            try:
                if cf.cache_fd >= 0:
                    os.ftruncate(cf.cache_fd, size)
                elif cf.extents:
                    os.truncate(self.cache_path(ino), size)
            except FileNotFoundError:
                pass
            cf.writes_inflight += 1
        try:
            st = await self.backing.write_call(_truncate_stat, path, fd, size)
        finally:
            if cf is not None:
                cf.writes_inflight -= 1
        if cf is not None:
            self._own_change(cf, st, size_exact=True)
        return st

    # -- operator commands -------------------------------------------------------------------

    def drop_clean(self) -> int:
        """Evict every clean extent (cachefs-ctl drop); returns how many."""
        n = 0
        for cf in list(self.files.values()):
            cf.clobber(0, 1 << 62)
            for x in list(cf.extents.values()):
                if not x.dirty:
                    self._remove_extent(cf, x)
                    self._punch[x.key] = None
                    n += 1
            if not cf.extents:
                self.store.queue_drop_file(cf.ino)
        return n

    def status(self) -> dict:
        return {
            "cache_size": self.capacity_exts * EXT_SIZE,
            "cache_used": self.used_bytes(),
            "extents_cached": len(self.pool),
            "files_cached": sum(1 for cf in self.files.values() if cf.extents),
            "metadata_pending": self.store.pending(),
            "metadata_commits": self.store.commits,
        }

    # -- persistence -------------------------------------------------------------------------

    async def run_persister(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Commit queued metadata in batches, every commit interval."""
        task_status.started()
        while True:
            await trio.sleep(self.cfg.commit_interval_s)
            await self.persist()

    async def persist(self, durable: bool = False) -> None:
        """fdatasync cache data, commit the metadata claiming it, then release evicted space."""
        if not self.store.pending() and not self._punch:
            return
        batch = self.store.take_batch()
        self._punch_committing.update(self._punch)
        self._punch = {}
        written = [self.cache_path(ino) for ino in self._written]
        self._written = set()
        if written:
            await trio.to_thread.run_sync(_fdatasync_paths, written)
        self.store.commit(batch, durable or bool(self._punch_committing))
        if self._punch_committing:
            keys = list(self._punch_committing)
            self._punch_committing = {}
            self._punching = set(keys)
            try:
                await trio.to_thread.run_sync(self._punch_holes, keys)
            finally:
                self._punching = set()

    def _punch_holes(self, keys: list[tuple[int, int]]) -> None:
        """Release the SSD space of evicted extents (runs in a thread: SSD syscalls only)."""
        by_ino: dict[int, list[int]] = {}
        for ino, ext in keys:
            by_ino.setdefault(ino, []).append(ext)
        for ino, exts in by_ino.items():
            try:
                fd = os.open(self.cache_path(ino), os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                for ext in exts:
                    punch_hole(fd, ext << EXT_SHIFT, EXT_SIZE)
            finally:
                os.close(fd)


def _open_fstat(path: bytes, flags: int) -> tuple[int, os.stat_result]:
    fd = os.open(path, flags)
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def _truncate_stat(path: bytes, fd: int | None, size: int) -> os.stat_result:
    if fd is not None:
        os.ftruncate(fd, size)
        return os.fstat(fd)
    os.truncate(path, size)
    return os.stat(path)


def _fdatasync_paths(paths: list[str]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
