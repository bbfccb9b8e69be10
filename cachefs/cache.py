"""The engine: cache hits, misses and fills, promotion, write-through writes, truncation,
coherence with BACKING, eviction and batched persistence.

Owns all extent state changes. Never imports pyfuse3: `fs.py` translates requests into calls
here. Extent state changes happen in synchronous code (atomic under trio); an `await` in the
middle of an operation is bracketed so that bytes read or written before it are never taken
for newer data: promotions in flight are marked overtaken (`CachedFile.fills`) by writes and
truncates, write-through writes update the cache only if no other write or truncate touched
the extent meanwhile (`CachedFile.wtrack`, `trunc_seq`), destaging cleans only blocks not
rewritten since its snapshot (`Extent.redirty`), and stats taken before one of our own
changes are not mistaken for a change behind our back (`change_seq`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Awaitable, Callable, TypeVar

import trio

from . import aio
from . import backing as bk
from . import readahead
from .backing import Backing
from .cachefiles import CacheFiles, pwrite_all
from .config import BLK_SIZE, EXT_SIZE, Config, format_size
from .dirty import DirtyIndex
from .extents import BLK_SHIFT, EXT_SHIFT, CachedFile, Extent, block_mask, covered_mask
from .hit import OpenFile
from .persist import NO_SPACE, Persister
from .policy import Admission, Clock, S3Fifo
from .stats import Stats
from .store import MetadataStore
from .writeback import Destager

log = logging.getLogger("cachefs.cache")

# Destage: join two dirty runs across a gap of clean valid blocks up to this long. Writing
# the gap costs link time (gap / bandwidth); a separate request costs a random access, but
# BACKING serves several at once, so about latency x bandwidth / parallel requests: 5 ms x
# 110 MB/s / 8 = 69 KB on the emulator. Measured there (write-back, 1 GiB): 256K -> 64K took
# hitachi-sql from 2,092 to 2,988 IOPS and flashsoft-70-30 from 12.1k to 14.0k; 16K lost
# 21 % on flashsoft-70-30.
MERGE_GAP = 64 << 10
T = TypeVar("T")
UNLINKING = "unlinking:"     # meta key prefix of an unlink intent (see store.py)
SSD_FULL_HOLD_S = 2.0       # after an out-of-space error: no promotions, writes go around
# O_APPEND: the kernel passes the offset; O_DIRECT: Python buffers are not aligned;
# O_TRUNC: truncation goes through the engine, which must drop cached (and dirty) data.
_FLAGS_NOT_FOR_BACKING = (os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_APPEND | os.O_TRUNC
                          | getattr(os, "O_DIRECT", 0))


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What makes cached data of a BACKING file valid: inode, size, mtime and ctime."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _older(a: tuple[int, int, int, int], b: tuple[int, int, int, int],
           size_counts: bool = True) -> bool:
    """True if identity `a` was taken before `b`: by ctime, then mtime (a file's timestamps
    never go back); within one timestamp tick, by size if `size_counts` (writes never shrink
    a file; a truncate's own stat is taken as the newer one)."""
    if (a[3], a[2]) != (b[3], b[2]):
        return (a[3], a[2]) < (b[3], b[2])
    return size_counts and a[1] < b[1]


class Cache:
    def __init__(self, cfg: Config, store: MetadataStore, backing: Backing, stats: Stats,
                 capacity_exts: int):
        self.cfg = cfg
        self.store = store
        self.backing = backing
        self.stats = stats
        self.capacity_exts = capacity_exts
        self.files: dict[int, CachedFile] = {}
        self.pool = (S3Fifo if cfg.eviction == "s3-fifo" else Clock)(capacity_exts)
        self.admission = Admission(cfg.promote_after)
        # inodes whose data changed behind us: fs.Operations.run_invalidator reads them
        self._stale_send, self.stale_inodes = trio.open_memory_channel(1024)
        self.cachefiles = CacheFiles(cfg.cache_dir)
        self._promote_send, self._promote_recv = trio.open_memory_channel(64)
        self.persister = Persister(store, self.cachefiles, stats, self, cfg.commit_interval_s)
        # write-back state
        self.write_back = cfg.mode == "write-back"
        self.dirty = DirtyIndex()                # write-back: extents newer than BACKING
        self.change_seq = 0                      # bumped by every change cachefs makes
        self.destager = Destager(self, backing, cfg, stats)
        self._nursery: trio.Nursery | None = None  # read-ahead tasks (run_readahead)
        self._ahead_inflight = 0                   # read-ahead reads in worker threads
        self._ahead_max = max(1, cfg.backing_threads * 3 // 4)   # leave threads for the rest
        self.target_exts = capacity_exts         # the pool size asked for (capacity may shrink)
        self._ssd_full_until = 0.0
        self._shrink_at_s = -1e9
        self._ssd_warned_s = -1e9
        self.pins = None                           # warm.Warm: told of unlinks and renames

    # -- state -----------------------------------------------------------------------------

    def load(self, clean_stop: bool) -> None:
        """Rebuild the in-memory map from the store (warm restart, or recovery).

        After an unclean stop, every valid block of an extent in the doubt journal is
        treated as dirty: it may hold data newer than BACKING.
        """
        files, extents = self.store.load()
        for ino, (size, mtime_ns, ctime_ns, path, lsize) in files.items():
            cf = self.files[ino] = CachedFile(ino, (ino, size, mtime_ns, ctime_ns))
            cf.path = path
            cf.size = lsize
            cf.recovered = not clean_stop
        doubt = set() if clean_stop else self.store.read_journal()
        over = 0
        for ino, ext, valid, dirty in extents:
            cf = self.files.get(ino)
            if (ino, ext) in doubt:
                dirty |= valid
            if cf is None or not valid:
                self.store.queue_drop_extent(ino, ext)        # names no cached data
                continue
            if not dirty and len(self.pool) >= self.capacity_exts:
                self.store.queue_drop_extent(ino, ext)
                self.persister.evicted((ino, ext))
                over += 1
                continue
            x = cf.extents[ext] = Extent(ino, ext, valid, 0)
            self.pool.insert_main(x)
            if dirty:
                self.dirty.set(cf, x, dirty)
        for key in self.store.meta_keys(UNLINKING):
            self.store.queue_meta(key, None)
            cf = self.files.get(int(key[len(UNLINKING):]))
            if cf is not None and not self._survived_unlink(cf):
                log.warning("BACKING inode %d (last seen as %s) was being unlinked at an "
                            "unclean stop and is gone; discarding its %d cached extents",
                            cf.ino, os.fsdecode(cf.path or b"?"), len(cf.extents))
                self.drop_file(cf)
                del self.files[cf.ino]
        if over:
            self.stats.drop_capacity += over
            log.warning("dropped %d cached extents beyond the cache size of %s (reason: "
                        "capacity)", over, format_size(self.capacity_exts * EXT_SIZE))
        if doubt:
            log.warning("unclean stop: %d extents in doubt are treated as dirty", len(doubt))

    def _survived_unlink(self, cf: CachedFile) -> bool:
        """After a crash during an unlink: does BACKING still have this very file (same
        inode at its path, with the identity recorded right before the unlink)?"""
        try:
            st = bk.lstat(self.backing.root_fd, cf.path) if cf.path else None
        except OSError:
            return False
        return st is not None and identity(st) == cf.identity

    def needs_unlink_guard(self, ino: int | None) -> bool:
        cf = self.files.get(ino) if ino is not None else None
        return self.write_back and cf is not None and bool(cf.extents)

    async def unlink_guarded(self, ino: int | None, unlink: Callable[[], Awaitable[T]]) -> T:
        """Run `unlink`, which removes the last BACKING name of inode `ino`.

        Write-back, with cached data: first a durable intent (and the file's identity), so
        that after a crash mid-way the data is never taken for a new file that reuses the
        inode number (recovery in load()); the intent goes in the batch that drops the
        file. The destager is kept out meanwhile, so the identity stays as recorded."""
        cf = self.files.get(ino) if ino is not None else None
        if not self.write_back or cf is None or not cf.extents:
            return await unlink()
        key = UNLINKING + str(cf.ino)
        async with self.file_lock(cf):
            self._persist_identity(cf)
            self.store.queue_meta(key, "1")
            await self.persist(durable=True)
            try:
                return await unlink()
            except BaseException:
                self.store.queue_meta(key, None)
                raise
        # On success the intent stays until the file's data is dropped (drop_file: at once,
        # or at the last release of a file still open), in the batch that drops it.

    def unlink_intent_clear(self, ino: int) -> None:
        """The guarded unlink left the file another name after all (a link made meanwhile)."""
        self.store.queue_meta(UNLINKING + str(ino), None)

    # -- dirty accounting --------------------------------------------------------------------

    def dirty_bytes(self) -> int:
        return self.dirty.bytes()

    def oldest_dirty_age_s(self) -> float:
        return self.dirty.oldest_age_s()

    def used_bytes(self) -> int:
        return len(self.pool) * EXT_SIZE

    def cache_path(self, ino: int) -> str:
        return self.cachefiles.path(ino)

    def _persist_identity(self, cf: CachedFile) -> None:
        if cf.extents and cf.identity is not None:
            _, size, mtime_ns, ctime_ns = cf.identity
            self.store.queue_file(cf.ino, size, mtime_ns, ctime_ns, cf.path, cf.size)

    def _remove_extent(self, cf: CachedFile, x: Extent) -> None:
        """Forget an extent, dirty blocks included (truncated, unlinked or unusable)."""
        self.dirty.clear(cf, x, x.dirty)
        self.pool.remove(x)
        del cf.extents[x.ext]
        self.store.queue_drop_extent(cf.ino, x.ext)

    def drop_file(self, cf: CachedFile) -> None:
        """Forget every cached extent of a file, dirty ones included."""
        for x in list(cf.extents.values()):
            self.dirty.clear(cf, x, x.dirty)
            self.pool.remove(x)
        cf.extents.clear()
        cf.clobber(0, 1 << 62)
        self.admission.forget_file(cf.ino)
        self.store.queue_drop_file(cf.ino)
        self.store.queue_meta(UNLINKING + str(cf.ino), None)
        # Safe before the commit: the stored identity no longer matches BACKING.
        try:
            self.cachefiles.truncate(cf, 0)
        except OSError:          # missing or unwritable: the map no longer claims it anyway
            pass

    def stat_token(self, ino: int | None) -> tuple:
        """Taken before a BACKING stat: lets revalidate() ignore a stat that our own change
        overtook while it was in flight (its attributes would look like a change behind us)."""
        if ino is None:
            return (None, self.change_seq)
        cf = self.files.get(ino)
        return (cf, cf.change_seq if cf is not None else 0)

    def _overtaken(self, cf: CachedFile, token: tuple | None) -> bool:
        if token is None:
            return False
        if token[0] is None:
            return token[1] != self.change_seq
        return token[0] is not cf or token[1] != cf.change_seq

    def revalidate(self, cf: CachedFile, st: os.stat_result, token: tuple | None = None
                   ) -> bool:
        """Compare BACKING's identity with the recorded one; drop stale data. True if same."""
        ident = identity(st)
        if cf.identity == ident:
            return True
        if cf.identity is None:
            cf.identity = ident
            cf.size = st.st_size
            return False
        if cf.writes_inflight or self._overtaken(cf, token):
            return True                 # our own change is in flight or overtook the stat
        if cf.ctime_pending and ident[:3] == cf.identity[:3]:
            # Our own metadata change (the unlink of another hard link) moved only the ctime.
            cf.ctime_pending = False
            cf.identity = ident
            self._persist_identity(cf)
            return True
        if cf.dirty_exts:
            self._conflict(cf, ident)
            cf.identity = ident
            cf.size = max(cf.size, st.st_size)
            self._persist_identity(cf)
            return False
        if cf.identity is not None and (cf.extents or cf.fills):
            self.stats.stale_files += 1
            self.stats.drop_coherence += len(cf.extents)
            log.info("BACKING inode %d changed behind the cache (size, mtime, ctime %s -> %s); "
                     "dropping %d cached extents (reason: coherence)", cf.ino, cf.identity[1:],
                     ident[1:], len(cf.extents))
            self.drop_file(cf)
        cf.identity = ident
        cf.size = st.st_size
        cf.recovered = False
        return False

    def _conflict(self, cf: CachedFile, ident: tuple[int, int, int, int]) -> None:
        """BACKING changed while we hold dirty data: keep the dirty blocks (they are the
        newest acknowledged writes), drop the clean ones (they may be stale), report it.

        After an unclean stop, BACKING's identity may differ only because our own destaging
        and truncates ran after the last commit: then it is not reported as a conflict."""
        clean = sum(1 for x in cf.extents.values() if not x.dirty)
        if cf.recovered:
            cf.recovered = False
            log.info("BACKING inode %d (%s) changed since the last commit before an unclean "
                     "stop; keeping its dirty data, dropping %d clean extents (reason: "
                     "recovery)", cf.ino, os.fsdecode(cf.path or b"?"), clean)
            self.stats.drop_recovery += clean
        else:
            self.stats.conflicts += 1
            self.stats.drop_coherence += clean
            log.warning("conflict: BACKING inode %d (%s) changed behind the cache while %d "
                        "extents hold dirty data; the dirty data will overwrite it; dropping "
                        "%d clean extents (reason: coherence)", cf.ino,
                        os.fsdecode(cf.path or b"?"), cf.dirty_exts, clean)
        cf.clobber(0, 1 << 62)
        for x in list(cf.extents.values()):
            if not x.dirty:
                self._remove_extent(cf, x)
            elif x.valid != x.dirty:
                x.valid = x.dirty
                self.store.queue_extent(cf.ino, x.ext, x.valid, x.dirty)

    def _own_change(self, cf: CachedFile, st: os.stat_result, size_exact: bool) -> None:
        """Record BACKING's identity after a change made by cachefs itself.

        Own operations on one file overlap (several writes in flight) and their results
        arrive in any order, so a stat taken earlier may be processed later: the recorded
        identity only moves forward, to the stat with the latest (ctime, mtime, size). The
        latest stat was taken after every completed own operation, so once none is in
        flight the recorded identity is BACKING's state after all of them."""
        cf.change_seq += 1
        self.change_seq += 1
        ident = identity(st)
        if cf.identity is not None and cf.identity[0] == ident[0] and _older(
                ident, cf.identity, size_counts=not size_exact):
            return                      # a later state of ours is known already
        cf.identity = ident
        if size_exact:
            cf.size = st.st_size
        elif cf.writes_inflight or cf.dirty_exts:
            cf.size = max(cf.size, st.st_size)
        else:
            cf.size = st.st_size
        self._persist_identity(cf)

    def logical_size(self, ino: int, backing_size: int) -> int:
        """The size programs see: BACKING's, or larger while extending writes are dirty."""
        cf = self.files.get(ino)
        if cf is None or not cf.dirty_exts:
            return backing_size
        return cf.size

    def renamed(self, ino: int, new_path: bytes) -> None:
        if self.pins is not None:
            self.pins.renamed(ino, new_path)
        cf = self.files.get(ino)
        if cf is not None and cf.dirty_exts:
            cf.path = new_path
            self._persist_identity(cf)

    def attributes_seen(self, ino: int, st: os.stat_result, token: tuple) -> None:
        """getattr/lookup saw BACKING's attributes: revalidate, invalidate the kernel cache."""
        cf = self.files.get(ino)
        if cf is not None and not self.revalidate(cf, st, token):
            try:
                self._stale_send.send_nowait(ino)
            except trio.WouldBlock:
                log.warning("kernel invalidation queue full; inode %d may be cached until "
                            "its attribute timeout", ino)

    def own_metadata_change(self, ino: int, st: os.stat_result | None,
                            times_set: bool = False) -> None:
        """cachefs changed attributes (chmod, xattrs, rename, link...): the ctime moved, the
        data did not. `st` is BACKING's stat right after the change (None: not known, e.g.
        the unlink of another hard link: the next ctime-only change is taken as ours).

        Only a ctime change is adopted (and an mtime change the caller set itself): a
        different size or mtime means someone else changed the data before our change, and
        the next revalidation must still see that. With own writes in flight, the stat may
        include them: it is merged like theirs."""
        cf = self.files.get(ino)
        if cf is None or cf.identity is None:
            return
        if st is None:
            cf.ctime_pending = True
            return
        ident = identity(st)
        if cf.writes_inflight:
            self._own_change(cf, st, size_exact=False)
        elif ident[0] == cf.identity[0] and ident[1] == cf.identity[1] and (
                times_set or ident[2] == cf.identity[2]):
            cf.change_seq += 1
            self.change_seq += 1
            cf.identity = ident
            self._persist_identity(cf)

    def forget(self, ino: int) -> None:
        cf = self.files.get(ino)
        if cf is not None and cf.open_count == 0 and not cf.extents and not cf.fills:
            del self.files[ino]

    def last_link_removed(self, ino: int) -> None:
        """BACKING no longer has the file: its data goes now, or at the last release."""
        if self.pins is not None:
            self.pins.unlinked(ino)
        cf = self.files.get(ino)
        if cf is None:
            return
        if cf.open_count:
            cf.doomed = True
            cf.ctime_pending = True     # the unlink moved BACKING's ctime (nlink 0)
        else:
            self._discard(cf)

    def _discard(self, cf: CachedFile) -> None:
        self.drop_file(cf)
        self.cachefiles.close_idle(cf)
        if cf.wb_fd >= 0 and not (cf.lock is not None and cf.lock.locked()):
            os.close(cf.wb_fd)          # unlinked: no BACKING flush to wait for
            cf.wb_fd = -1               # (while destaging, the destager closes it after)
        del self.files[cf.ino]
        self.cachefiles.remove(cf.ino)

    def _file_for(self, ino: int) -> CachedFile:
        """The cache state of inode `ino`; a fresh one if the old file of that number was
        deleted and its last handle is still to be released (the kernel reuses numbers, and
        RELEASE may arrive after the next CREATE)."""
        cf = self.files.get(ino)
        if cf is not None and cf.doomed:
            self.drop_file(cf)                  # its old handles now read BACKING's old inode
            cf = None
        if cf is None:
            cf = self.files[ino] = CachedFile(ino)
        return cf

    # -- open / release --------------------------------------------------------------------

    async def open(self, fh: int, ino: int, path: bytes, flags: int) -> tuple[OpenFile, bool]:
        """Open BACKING, revalidate cached data; returns the handle and whether the kernel may
        keep its page cache for the file."""
        bflags = (flags & ~_FLAGS_NOT_FOR_BACKING) | os.O_CLOEXEC
        token = self.stat_token(ino)
        want_direct = not self.write_back and flags & os.O_ACCMODE != os.O_RDONLY
        readable = True
        opened = None
        if self.write_back and flags & os.O_ACCMODE == os.O_WRONLY:
            # A sub-block write-back write into a block not cached reads BACKING's bytes
            # of that block: open BACKING read-write if BACKING lets us (else such writes
            # go around the cache, see _write_around).
            try:
                opened = await self.backing.read_call(
                    "open", _open_fstat, self.backing.root_fd, path,
                    (bflags & ~os.O_ACCMODE) | os.O_RDWR, False)
            except PermissionError:
                readable = False
        if opened is None:
            opened = await self.backing.read_call("open", _open_fstat, self.backing.root_fd,
                                                  path, bflags, want_direct)
        fd, st, dfd = opened
        cf = self._file_for(ino)
        unchanged = self.revalidate(cf, st, token)
        cf.path = path
        cf.open_count += 1
        if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
            try:
                await self.truncate(ino, 0, path, fd)
            except BaseException:
                cf.open_count -= 1
                os.close(fd)
                if dfd >= 0:
                    os.close(dfd)
                raise
            unchanged = False
        if self.write_back and cf.dirty_exts and cf.wb_fd < 0:
            # Dirty data from before a remount: the destager writes through a descriptor of
            # this open file, which reaches it even once its last name is gone.
            wfd = await self.backing.write_call(_writable_twin, fd, flags)
            if wfd >= 0 and cf.wb_fd < 0 and self.files.get(ino) is cf:
                cf.wb_fd = wfd
            elif wfd >= 0:
                os.close(wfd)               # not written through: closes at once
        if cf.extents:
            try:
                self.cachefiles.fd(cf)
            except OSError as exc:          # serve from BACKING rather than fail the open
                self.stats.cache_errors += 1
                log.warning("cannot open the cache file of inode %d: %s", ino, exc)
                self.drop_file(cf)
        of = OpenFile(fh, cf, fd, flags, self.stats)
        of.direct_fd = dfd
        of.readable = readable
        return of, unchanged

    async def create(self, fh: int, path: bytes, flags: int, mode: int, uid: int, gid: int,
                     parent: bytes, remember: Callable[[os.stat_result], int]
                     ) -> tuple[OpenFile, os.stat_result]:
        """Create and open a BACKING file owned by uid/gid; `remember` names its inode."""
        bflags = (flags & ~_FLAGS_NOT_FOR_BACKING) | (flags & os.O_EXCL) | os.O_CLOEXEC
        readable = flags & os.O_ACCMODE != os.O_WRONLY
        opened = None
        if self.write_back and not readable:
            try:                # as in open(): fills of sub-block writes read through it
                opened = await self.backing.write_call(
                    bk.create, self.backing.root_fd, path,
                    (bflags & ~os.O_ACCMODE) | os.O_RDWR, mode, uid, gid, parent)
                readable = True
            except PermissionError:
                pass
        if opened is None:
            opened = await self.backing.write_call(bk.create, self.backing.root_fd, path,
                                                   bflags, mode, uid, gid, parent)
        fd, st = opened
        ino = remember(st)
        cf = self._file_for(ino)
        self.revalidate(cf, st)
        cf.path = path
        cf.open_count += 1
        if flags & os.O_TRUNC and (st.st_size or cf.size):     # it existed: truncate it
            try:
                st = await self.truncate(ino, 0, path, fd)
            except BaseException:
                cf.open_count -= 1
                os.close(fd)
                raise
        of = OpenFile(fh, cf, fd, flags, self.stats)
        of.readable = readable
        if not self.write_back:
            of.direct_fd = await self.backing.write_call(aio.open_direct, fd)
        return of, st

    def release(self, of: OpenFile) -> list[int]:
        """Drop a handle; returns the BACKING fds for the caller to close in a thread."""
        cf = of.cfile
        cf.open_count -= 1
        if cf.doomed and cf.open_count == 0 and self.files.get(cf.ino) is cf:
            self._discard(cf)
        self.cachefiles.close_idle(cf)
        return [of.backing_fd] if of.direct_fd < 0 else [of.backing_fd, of.direct_fd]

    # -- reads -----------------------------------------------------------------------------

    def filling(self) -> bool:
        """True while the pool has free room (below --promote-all-below): then every miss is
        cached on first touch, sequential streams included. An empty pool costs nothing to
        fill, and one-touch data is the first to go (S3-FIFO's small queue)."""
        return len(self.pool) < self.capacity_exts * self.cfg.promote_all_below

    async def read_miss(self, of: OpenFile, off: int, size: int) -> bytes:
        """Answer a read from BACKING; start promotion of extents that earned it."""
        cf = of.cfile
        st = self.stats
        st.read_ops += 1
        cutoff = self.cfg.sequential_cutoff
        if cutoff and of.seq.note(off, size) > cutoff:
            data = await self._stream_read(of, off, size)
            if cf.dirty_exts:           # write-back: dirty blocks are newer than BACKING
                data = self._overlay_dirty(cf, off, size, data)
            st.bypass_ops += 1
            st.bypass_bytes += len(data)
            st.read_bytes += len(data)
            return data
        st.miss_ops += 1
        promote = []
        if self.capacity_exts and not self.ssd_full():
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
            data = whole[off - start:off - start + size]
            await self._promote(cf, [(e, whole[(e << EXT_SHIFT) - start:
                                               (e << EXT_SHIFT) - start + EXT_SIZE])
                                     for e in promote])
        if cf.dirty_exts:
            data = self._overlay_dirty(cf, off, size, data)
        st.miss_bytes += len(data)
        st.read_bytes += len(data)
        return data

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
                await self._promote(cf, [(e, _slice_ext(ahead.data, off, e)) for e in exts])
                return ahead.data
        exts = self._stream_promotions(cf, off, size)
        try:
            data = await self._backing_read(of.backing_fd, size, off)
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
        await self._promote(cf, [(e, _slice_ext(data, off, e)) for e in exts])
        return data

    def _stream_promotions(self, cf: CachedFile, off: int, size: int) -> list[int]:
        """Extents wholly inside a stream's read that are worth caching while the pool is
        filling; their fills are marked (a write meanwhile overtakes them)."""
        if not self.capacity_exts or self.ssd_full() or not self.filling():
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

    def _overlay_dirty(self, cf: CachedFile, off: int, size: int, data: bytes) -> bytes:
        """Lay the dirty blocks (newer than BACKING) over data read from BACKING, and extend
        it with zeros up to the logical size."""
        end = min(off + size, cf.size)
        if end <= off:
            return data
        buf = bytearray(data)
        if len(buf) < end - off:
            buf.extend(bytes(end - off - len(buf)))
        fd = self.cachefiles.fd(cf)
        for e in range(off >> EXT_SHIFT, ((end - 1) >> EXT_SHIFT) + 1):
            x = cf.extents.get(e)
            if x is None or not x.dirty:
                continue
            base = e << EXT_SHIFT
            for b0, b1 in _runs(x.dirty & block_mask(max(off, base) - base,
                                                     min(end, base + EXT_SIZE) - base)):
                s = max(off, base + (b0 << BLK_SHIFT))
                t = min(end, base + (b1 << BLK_SHIFT))
                buf[s - off:t - off] = os.pread(fd, t - s, s)
        self.cachefiles.close_idle(cf)
        return bytes(buf)

    async def _backing_read(self, fd: int, size: int, off: int) -> bytes:
        try:
            data = await self.backing.pread(fd, size, off)
        except OSError:
            self.stats.backing_errors += 1
            raise
        self.stats.backing_read_ops += 1
        self.stats.backing_read_bytes += len(data)
        return data

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
            self.install(cf, e, chunk)
            await trio.sleep(0)

    def install(self, cf: CachedFile, e: int, chunk: bytes) -> bool:
        """Write one extent read from BACKING into the cache, unless it was overtaken."""
        clobbered = cf.fills.pop(e, True)
        key = (cf.ino, e)
        if (clobbered or not chunk or self.files.get(cf.ino) is not cf
                or self.persister.punching(key) or self.ssd_full()):
            self.stats.promotions_dropped += 1
            return False
        x = cf.extents.get(e)
        if x is None and not self._make_room(1):
            self.stats.promotions_dropped += 1
            return False
        valid = block_mask(0, len(chunk))
        fill = valid & ~x.valid if x is not None else valid   # valid blocks are as new or newer
        base = e << EXT_SHIFT
        if len(chunk) & (BLK_SIZE - 1):
            # BACKING ended inside this block: the rest of it is zeros, in the cache file too
            # (it may still hold bytes of an evicted extent whose hole is not punched yet).
            chunk = bytes(chunk) + bytes(BLK_SIZE - (len(chunk) & (BLK_SIZE - 1)))
        try:
            fd = self.cachefiles.fd(cf)
            if fill == valid:
                pwrite_all(fd, chunk, base)
            else:
                view = memoryview(chunk)
                for b0, b1 in _runs(fill):
                    pwrite_all(fd, view[b0 << BLK_SHIFT:b1 << BLK_SHIFT],
                               base + (b0 << BLK_SHIFT))
        except OSError as exc:
            self.stats.promotions_dropped += 1
            self.ssd_failed(exc, "a promotion")   # only invalid blocks were written: the
            self.cachefiles.close_idle(cf)               # map is unchanged and still true
            return False
        if x is None:
            x = cf.extents[e] = Extent(cf.ino, e, valid)
            self.pool.insert(x)
            self.persister.reused(key)
            if len(cf.extents) == 1:
                self._persist_identity(cf)
        else:
            x.valid |= valid
        self.store.queue_extent(cf.ino, e, x.valid, x.dirty)
        self.persister.written(cf.ino)
        self.stats.promotions += 1
        self.cachefiles.close_idle(cf)
        return True

    def _make_room(self, n: int = 1) -> bool:
        """Evict clean extents until `n` more fit; False if dirty data fills the pool."""
        while len(self.pool) + n > self.capacity_exts:
            x = self.pool.victim()
            if x is None:
                return False
            self._evict(self.files[x.ino], x)
            self.stats.evictions += 1
        return True

    def _evict(self, cf: CachedFile, x: Extent) -> None:
        """Forget a clean extent; its SSD space is released after the next durable commit."""
        self._remove_extent(cf, x)
        self.persister.evicted(x.key)
        if not cf.extents:
            self.store.queue_drop_file(cf.ino)

    # -- writes ----------------------------------------------------------------------------

    async def write(self, of: OpenFile, off: int, data: bytes) -> int:
        if self.write_back:
            return await self._write_back(of, off, data)
        return await self._write_through(of, off, data)

    async def _write_back(self, of: OpenFile, off: int, data: bytes) -> int:
        """Write-back: the write lands in the cache file, its blocks turn dirty, done.

        Checkpoints: flow control (above --dirty-high), waiting for room while the pool is
        full of dirty data, and filling a partly written block that BACKING holds bytes of.
        After the last checkpoint everything is synchronous, hence atomic. When the SSD is
        out of space, or a partly written block cannot be read from BACKING (a write-only
        handle BACKING would not reopen read-write), the write goes around the cache.
        """
        cf = of.cfile
        end = off + len(data)
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        await self.destager.throttle(len(data))
        while True:
            if self.ssd_full():
                return await self._write_around(of, off, data)
            gaps = self._partial_gaps(cf, off, end)
            if gaps:
                if not of.readable:
                    return await self._write_around(of, off, data)
                if not await self._fill_for_write(of, cf, gaps) and not self.ssd_full():
                    await self.destager.wait_progress()
                continue
            missing = sum(1 for e in range(first, last + 1) if e not in cf.extents)
            if missing and not self._make_room(missing):
                self.stats.throttled_writes += 1
                await self.destager.wait_progress()      # the pool is full of dirty data
                continue
            if missing and self._partial_gaps(cf, off, end):
                continue                # making room evicted a block this write fills
            break
        try:
            self._write_dirty(cf, off, data)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            self.ssd_failed(exc, "a write-back write")
            return await self._write_around(of, off, data)
        if cf.wb_fd < 0:
            cf.wb_fd = os.dup(of.backing_fd)    # the destager's writable BACKING fd
        self.stats.write_ops += 1
        self.stats.write_bytes += len(data)
        if of.flags & (os.O_SYNC | os.O_DSYNC):
            await self.persist(durable=True)
        return len(data)

    def _write_dirty(self, cf: CachedFile, off: int, data: bytes) -> None:
        """Put a write-back write into the cache file and mark its blocks dirty (sync).

        Extents whose clean blocks are overwritten in place are journaled first (a crash
        must not leave new bytes in blocks the database calls clean). On an SSD error the
        map is unchanged; blocks partly written hold either version of clean bytes, and the
        caller writes the same bytes to BACKING (_write_around), so both agree again.
        """
        end = off + len(data)
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        for e in range(first, last + 1):
            x = cf.extents.get(e)
            if x is None:
                continue
            base = e << EXT_SHIFT
            m = block_mask(max(off, base) - base, min(end, base + EXT_SIZE) - base)
            if x.valid & ~x.dirty & m:
                self.persister.journal_dirtying(x.key)      # before clean data changes
        fd = self.cachefiles.fd(cf)
        head, tail = self._zero_pads(cf, off, end)
        if head:
            pwrite_all(fd, bytes(head), off - head)
        if tail:
            pwrite_all(fd, bytes(tail), end)
        pwrite_all(fd, data, off)
        for e in range(first, last + 1):
            x = cf.extents.get(e)
            if x is None:
                x = cf.extents[e] = Extent(cf.ino, e)
                self.pool.insert(x)
                self.persister.reused(x.key)
            base = e << EXT_SHIFT
            m = block_mask(max(off, base) - base, min(end, base + EXT_SIZE) - base)
            x.valid |= m
            x.redirty |= m
            self.dirty.set(cf, x, m)
            self.store.queue_extent(cf.ino, e, x.valid, x.dirty)
        if end > cf.size:
            cf.size = end
        self._persist_identity(cf)
        self.persister.written(cf.ino)

    async def _write_around(self, of: OpenFile, off: int, data: bytes) -> int:
        """A write-back write that cannot be cached goes to BACKING at once (write-through).

        Blocks it touches that hold dirty data get the new bytes in the cache file too (they
        are allocated, so this needs no new SSD space) and stay dirty: the destager later
        writes the merged blocks. Clean blocks it touches turn invalid. The file's lock keeps
        the destager out meanwhile: a destage pass that read a block before this write must
        not land after it.
        """
        cf = of.cfile
        end = off + len(data)
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        self.stats.writes_around += 1
        async with self.file_lock(cf):
            cf.clobber(first, last)
            view = memoryview(data)
            for e in range(first, last + 1):
                x = cf.extents.get(e)
                if x is None:
                    continue
                base = e << EXT_SHIFT
                s, t = max(off, base), min(end, base + EXT_SIZE)
                m = block_mask(s - base, t - base)
                for b0, b1 in _runs(x.dirty & m):
                    bs = max(s, base + (b0 << BLK_SHIFT))
                    bt = min(t, base + (b1 << BLK_SHIFT))
                    pwrite_all(self.cachefiles.fd(cf), view[bs - off:bt - off], bs)
                    x.redirty |= block_mask(bs - base, bt - base)
                x.valid &= ~(m & ~x.dirty)
                self.store.queue_extent(cf.ino, e, x.valid, x.dirty)
                self.persister.written(cf.ino)
            cf.writes_inflight += 1
            try:
                written, st = await self.backing.pwrite_stat(of.backing_fd, -1, data, off)
            except OSError:
                self.stats.backing_errors += 1
                raise
            finally:
                cf.writes_inflight -= 1
            cf.clobber(first, last)
        self.stats.write_ops += 1
        self.stats.write_bytes += written
        self.stats.backing_write_ops += 1
        self.stats.backing_write_bytes += written
        self._own_change(cf, st, size_exact=False)
        if end > cf.size:
            cf.size = end
            self._persist_identity(cf)
        if of.flags & (os.O_SYNC | os.O_DSYNC):     # BACKING's fd has O_SYNC itself
            await self.persist(durable=True)
        return written

    def _zero_pads(self, cf: CachedFile, off: int, end: int) -> tuple[int, int]:
        """Bytes to zero before and after a write in its partly written first and last
        blocks when those are not valid (past BACKING's end, so their other bytes are zeros;
        the cache file may still hold an evicted extent's old bytes there)."""
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

    async def _fill_for_write(self, of: OpenFile, cf: CachedFile, exts: list[int]) -> bool:
        """Read extents from BACKING into the cache so a sub-block write can be merged."""
        self.stats.partial_block_fills += 1
        for e in exts:
            cf.fills.setdefault(e, False)
        ok = True
        for e in exts:
            try:
                chunk = await self._backing_read(of.backing_fd, EXT_SIZE, e << EXT_SHIFT)
            except BaseException:
                cf.fills.pop(e, None)
                raise
            if not self.install(cf, e, chunk):
                ok = False
        return ok

    async def _write_through(self, of: OpenFile, off: int, data: bytes) -> int:
        """Write-through: BACKING first, then the cached blocks the write touches.

        While the BACKING write is in flight the touched blocks are invalid (readers go to
        BACKING). Afterwards the bytes go into the cache only if no other write or truncate
        touched those extents meanwhile (then the order of the two in BACKING is unknown and
        the blocks stay invalid); fills that overlapped are dropped.
        """
        cf = of.cfile
        end = off + len(data)
        first, last = off >> EXT_SHIFT, (end - 1) >> EXT_SHIFT
        cf.clobber(first, last)
        mine = []
        for e in range(first, last + 1):
            track = cf.wtrack.get(e)
            if track is None:
                track = cf.wtrack[e] = [0, 0]
            track[0] += 1
            track[1] += 1
            mine.append((e, track[1], track[0] == 1))
            x = cf.extents.get(e)
            if x is not None:
                base = e << EXT_SHIFT
                x.valid &= ~block_mask(max(off, base) - base, min(end, base + EXT_SIZE) - base)
        trunc_seq = cf.trunc_seq
        cf.writes_inflight += 1
        try:
            written, st = await self.backing.pwrite_stat(of.backing_fd, of.direct_fd, data, off)
        except OSError:
            self.stats.backing_errors += 1
            raise
        finally:
            cf.writes_inflight -= 1
            alone = {}
            for e, seq, first_in in mine:
                track = cf.wtrack[e]
                alone[e] = first_in and track[1] == seq and track[0] == 1
                track[0] -= 1
                if not track[0]:
                    del cf.wtrack[e]
            for e in range(first, last + 1):
                x = cf.extents.get(e)
                if x is not None:
                    self.store.queue_extent(cf.ino, e, x.valid, x.dirty)
        cf.clobber(first, last)       # fills that may have read BACKING before our write
        self.stats.write_ops += 1
        self.stats.write_bytes += written
        self.stats.backing_write_ops += 1
        self.stats.backing_write_bytes += written
        self._own_change(cf, st, size_exact=False)
        if trunc_seq == cf.trunc_seq:
            self._update_cached(cf, off, data, alone)
        return written

    def _update_cached(self, cf: CachedFile, off: int, data: bytes,
                       alone: dict[int, bool]) -> None:
        """Put a completed write's bytes into the cached extents it was alone on."""
        end = off + len(data)
        view = memoryview(data)
        for e, ok in alone.items():
            x = cf.extents.get(e)
            if x is None:
                continue
            base = e << EXT_SHIFT
            s, t = max(off, base), min(end, base + EXT_SIZE)
            if not ok:
                x.valid &= ~block_mask(s - base, t - base)
                continue
            try:
                pwrite_all(self.cachefiles.fd(cf), view[s - off:t - off], s)
            except OSError as exc:
                self.ssd_failed(exc, "a write-through update")
                self.stats.drop_cache_error += 1
                self._remove_extent(cf, x)
                self.persister.evicted(x.key)
                continue
            # Blocks filled during the write hold our bytes now and BACKING's elsewhere.
            x.valid |= covered_mask(s - base, t - base, cf.size - base)
            self.store.queue_extent(cf.ino, x.ext, x.valid, x.dirty)
            self.persister.written(cf.ino)

    def file_lock(self, cf: CachedFile) -> trio.Lock:
        """Serialises a file's destaging with its truncation."""
        if cf.lock is None:
            cf.lock = trio.Lock()
        return cf.lock

    async def truncate(self, ino: int, size: int, path: bytes, fd: int | None
                       ) -> os.stat_result:
        """Change a file's size in BACKING, dropping cached blocks past the new end."""
        cf = self.files.get(ino)
        if cf is None:
            return await self.backing.write_call(bk.truncate_stat, self.backing.root_fd, path,
                                                 fd, size)
        async with self.file_lock(cf):
            return await self._truncate_locked(cf, size, path, fd)

    def _trim(self, cf: CachedFile, size: int) -> None:
        """Drop cached blocks past a new size (dirty ones too) and zero the cache file
        there, as BACKING will be."""
        cf.clobber(size >> EXT_SHIFT, 1 << 62)
        cf.trunc_seq += 1
        if self.write_back:       # keep the block holding the new end: it may be dirty
            keep_below = (size + BLK_SIZE - 1) & ~(BLK_SIZE - 1)
        else:                     # drop it: a racing read must not see early zeros
            keep_below = size & ~(BLK_SIZE - 1)
        for x in list(cf.extents.values()):
            base = x.ext << EXT_SHIFT
            if base >= keep_below:
                self._remove_extent(cf, x)
            elif base + EXT_SIZE > keep_below:
                keep = block_mask(0, keep_below - base)
                self.dirty.clear(cf, x, x.dirty & ~keep)
                x.valid &= keep
                self.store.queue_extent(cf.ino, x.ext, x.valid, x.dirty)
        try:
            self.cachefiles.truncate(cf, size)
        except FileNotFoundError:
            pass

    async def _truncate_locked(self, cf: CachedFile, size: int, path: bytes, fd: int | None
                               ) -> os.stat_result:
        self._trim(cf, min(size, cf.size))
        if self.write_back and size < cf.size:
            # Shrinking: the new logical size and the dirty blocks gone past it are durable
            # before BACKING shrinks, so that after a crash the file is never longer than
            # BACKING's truncate left it with older dirty data past the end (the database
            # may still call such data dirty even when memory no longer does).
            cf.size = size
            self._persist_identity(cf)
            await self.persist(durable=True)
        cf.writes_inflight += 1
        try:
            st = await self.backing.write_call(bk.truncate_stat, self.backing.root_fd, path,
                                               fd, size)
        finally:
            cf.writes_inflight -= 1
            # Fills that read the old contents during the call may have been installed.
            self._trim(cf, min(size, cf.size))
        self._own_change(cf, st, size_exact=True)
        self._trim(cf, size)                   # the cache file as long as the file again
        return st

    async def fsync(self, of: OpenFile, datasync: bool) -> None:
        """Write-back: data and the metadata naming it durable on the SSD. Write-through:
        BACKING's fsync."""
        if self.write_back:
            await self.persist(durable=True)
        else:
            await self.backing.write_call(os.fdatasync if datasync else os.fsync,
                                          of.backing_fd)

    # -- destaging (state changes; the schedule lives in writeback.Destager) -----------------

    def destage_plan(self, cf: CachedFile, max_bytes: int, start_ext: int = 0
                     ) -> tuple[list[tuple[Extent, int]], list[tuple[int, int]]]:
        """Snapshot a file's dirty extents from `start_ext` on, in offset order: (extent,
        dirty mask) pairs, and the byte runs to write, coalesced across extents and clipped
        to the file's size. The destager starts at the file's oldest dirty extent: under
        random writes that is where the last sweep passed longest ago, so dirty blocks are
        densest there and bridge into long writes (a circular elevator)."""
        plan: list[tuple[Extent, int]] = []
        runs: list[tuple[int, int]] = []
        total = 0
        for e in sorted(e for e, x in cf.extents.items() if x.dirty and e >= start_ext):
            x = cf.extents[e]
            base = e << EXT_SHIFT
            # Only blocks below the logical size are written, so only they may turn clean;
            # a dirty block past it would be a bug, and it stays dirty rather than vanish.
            snap = x.dirty & block_mask(0, min(cf.size - base, EXT_SIZE))
            if snap != x.dirty:
                log.error("inode %d extent %d: dirty blocks past the file's size %d",
                          cf.ino, e, cf.size)
            plan.append((x, snap))
            x.redirty = 0
            for b0, b1 in _runs(snap):
                s, t = base + (b0 << BLK_SHIFT), min(base + (b1 << BLK_SHIFT), cf.size)
                if t <= s:
                    continue
                if runs:
                    end = runs[-1][0] + runs[-1][1]
                    # Bridge a short gap of clean valid blocks (BACKING already has those
                    # bytes): one larger write costs little more than a small one on a disk.
                    if end == s or (s - end <= MERGE_GAP and cf.all_valid(end, s)):
                        total += s - end
                        runs[-1] = (runs[-1][0], t - runs[-1][0])
                        total += t - s
                        continue
                runs.append((s, t - s))
                total += t - s
            if total >= max_bytes:
                break
        cf.writes_inflight += 1          # BACKING is about to change under our own hand
        return plan, runs

    def destage_failed(self, cf: CachedFile) -> None:
        cf.writes_inflight -= 1

    def destage_done(self, cf: CachedFile, plan: list[tuple[Extent, int]],
                     st: os.stat_result) -> None:
        """BACKING has the snapshot durably: blocks not rewritten since turn clean."""
        cf.writes_inflight -= 1
        for x, snap in plan:
            if cf.extents.get(x.ext) is not x:
                continue                         # truncated or dropped meanwhile
            self.dirty.clear(cf, x, snap & ~x.redirty)
            self.store.queue_extent(cf.ino, x.ext, x.valid, x.dirty)
        self._own_change(cf, st, size_exact=False)

    def set_wb_fd(self, cf: CachedFile, fd: int) -> None:
        cf.wb_fd = fd

    def take_idle_wb_fd(self, cf: CachedFile) -> int:
        """The destager's BACKING fd of a file that is clean and closed, to close; or -1."""
        if cf.dirty_exts or cf.open_count or cf.wb_fd < 0:
            return -1
        fd, cf.wb_fd = cf.wb_fd, -1
        return fd

    def discard_orphan(self, cf: CachedFile) -> None:
        """Dirty data of a file BACKING no longer has (removed while we were down)."""
        log.warning("BACKING inode %d (last seen as %s) no longer exists; discarding its %d "
                    "dirty extents", cf.ino, os.fsdecode(cf.path or b"?"), cf.dirty_exts)
        self.drop_file(cf)

    # -- a full or failing SSD ------------------------------------------------------------

    def ssd_full(self) -> bool:
        """True for a while after the cache filesystem ran out of space: no promotions,
        write-back writes go around the cache, until evicted space is released."""
        return self._ssd_full_until > time.monotonic()

    def ssd_failed(self, exc: OSError, what: str) -> None:
        """An SSD write failed. Out of space: shrink the pool below what is cached now and
        evict clean data (the space is released after the next commit); the mount goes on
        from BACKING meanwhile. Logged at most once a minute."""
        self.stats.cache_errors += 1
        full = exc.errno in NO_SPACE
        if full:
            self.out_of_space()
        now = time.monotonic()
        if now - self._ssd_warned_s >= 60:
            self._ssd_warned_s = now
            log.warning("the cache directory failed %s: %s; %s", what, exc.strerror or exc,
                        "serving from BACKING and evicting clean data until space is "
                        "released (the pool is now %s)" % format_size(self.capacity_exts
                                                                      * EXT_SIZE)
                        if full else "that data is served from BACKING")

    def out_of_space(self) -> None:
        """The cache filesystem is full: no promotions for a while, writes go around the
        cache, and the pool shrinks (at most once per hold time)."""
        self.stats.cache_full_events += 1
        self._ssd_full_until = time.monotonic() + SSD_FULL_HOLD_S
        if self._shrink_at_s + SSD_FULL_HOLD_S < time.monotonic():
            self._shrink_at_s = time.monotonic()
            self._shrink_pool()

    def space_released(self) -> None:
        """Evicted space was released (the reserve file is back): try the SSD again."""
        self._ssd_full_until = 0.0

    def _shrink_pool(self) -> None:
        """The cache filesystem is full (another tenant, or holes not yet punched): make the
        pool 1/16 smaller than what it holds now and evict clean extents down to it."""
        held = len(self.pool)
        target = max(16, held - max(16, held // 16))
        if target >= self.capacity_exts:
            target = max(16, self.capacity_exts - max(16, self.capacity_exts // 16))
        self.capacity_exts = target
        n = 0
        while len(self.pool) > self.capacity_exts:
            x = self.pool.victim()
            if x is None:
                break
            self._evict(self.files[x.ino], x)
            n += 1
        self.stats.drop_capacity += n
        log.warning("cache filesystem full: pool shrunk to %s, %d clean extents evicted "
                    "(reason: capacity)", format_size(self.capacity_exts * EXT_SIZE), n)

    def regrow_pool(self) -> None:
        """Give the pool back the room it lost to a full filesystem, as space frees up."""
        if self.capacity_exts >= self.target_exts or self.ssd_full():
            return
        try:
            sv = os.statvfs(self.cfg.cache_dir)
        except OSError:
            return
        spare = sv.f_bavail * sv.f_frsize - int(sv.f_blocks * sv.f_frsize * 0.10)
        if spare > 0:
            self.capacity_exts = min(self.target_exts,
                                     self.capacity_exts + spare // EXT_SIZE)

    # -- operator commands -------------------------------------------------------------------

    def drop_clean(self) -> int:
        """Evict every clean extent not protected (pinned or being prefetched; cachefs-ctl
        drop); returns how many."""
        n = 0
        protected = self.pool.protected
        for cf in list(self.files.values()):
            if cf.ino in protected:
                continue
            cf.clobber(0, 1 << 62)
            for x in list(cf.extents.values()):
                if not x.dirty:
                    self._evict(cf, x)
                    n += 1
        self.stats.drop_operator += n
        log.info("dropped %d clean cached extents (reason: operator, cachefs-ctl drop)", n)
        return n

    # -- warming (cachefs/warm.py: prefetch and pins) ---------------------------------------

    def file_state(self, ino: int) -> CachedFile:
        """The cache state of inode `ino`, made if needed (revalidate it before use)."""
        return self._file_for(ino)

    def reserve(self, n: int) -> bool:
        """Evict unprotected clean extents until `n` more fit; False if the rest of the pool
        is dirty or protected (pinned, being prefetched)."""
        return self._make_room(n)

    def install_wanted(self, cf: CachedFile, e: int, chunk: bytes) -> bool:
        """install() an extent an operator asked for: it joins the main queue at once, like
        data known to be hot, rather than the probation queue of one-touch data."""
        if not self.install(cf, e, chunk):
            return False
        x = cf.extents[e]
        self.pool.remove(x)
        self.pool.insert_main(x)
        return True

    def status(self) -> dict:
        return {
            "dirty_bytes": self.dirty_bytes(),
            "dirty_extents": len(self.dirty),
            "oldest_dirty_age_s": round(self.oldest_dirty_age_s(), 3),
            "cache_size": self.capacity_exts * EXT_SIZE,
            "cache_used": self.used_bytes(),
            "extents_cached": len(self.pool),
            "files_cached": sum(1 for cf in self.files.values() if cf.extents),
            "metadata_pending": self.store.pending(),
            "metadata_commits": self.store.commits,
        }

    # -- persistence (cachefs/persist.py) -----------------------------------------------------

    async def persist(self, durable: bool = False) -> None:
        """Make everything changed so far durable on the SSD (Persister.persist)."""
        await self.persister.persist(durable)


def _open_fstat(root: int, path: bytes, flags: int, want_direct: bool
                ) -> tuple[int, os.stat_result, int]:
    fd = bk.open_at(root, path, flags)
    try:
        return fd, os.fstat(fd), aio.open_direct(fd) if want_direct else -1
    except BaseException:
        os.close(fd)
        raise


def _writable_twin(fd: int, flags: int) -> int:
    """A writable descriptor of the file open as `fd` (also when unlinked), or -1."""
    if flags & os.O_ACCMODE != os.O_RDONLY:
        return os.dup(fd)
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _slice_ext(data: bytes, off: int, e: int) -> bytes:
    """Extent `e`'s bytes out of `data` read at `off`."""
    lo = (e << EXT_SHIFT) - off
    return data[lo:lo + EXT_SIZE]


def _runs(mask: int) -> list[tuple[int, int]]:
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
