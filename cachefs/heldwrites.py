"""Writes to files the kernel reads by itself (FUSE passthrough opens and their mappings:
openmode.Held): the cache file must hold every acknowledged write at once and in BACKING's
order, and a shared writable mapping may change it behind the engine's back.

Owns `HeldWrites`, the base of writepath.WritePath: these methods use its state (the
engine's parts, set by WritePath.__init__), and WritePath's own paths call them for held
files (`_write_through_held`, `_write_around_held`, `_mirror`); openmode calls `may_be_mapped`
and `sync_back`.
"""

from __future__ import annotations

import errno
import logging
import os

import trio
import xxhash

from . import backingpaths as bp
from .cachefiles import pwrite_all
from .extentmap import spans
from .config import BLK_SIZE, EXT_SIZE
from .extents import (BLK_SHIFT, BLKS_PER_EXT, EXT_SHIFT, CachedFile, covered_mask, popcount,
                      runs)
from .hit import OpenFile
from .room import MIN_FREE_FRACTION, NO_SPACE
from .state import MAPPED

log = logging.getLogger("cachefs.writepath")

_ZEROS = bytes(EXT_SIZE)
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
BASELINE_MAX_BYTES = 1 << 30    # a larger file's blocks all count as changed (take_baseline)
_digest = xxhash.xxh3_128_digest   # 2^-128 that a changed block looks unchanged
_NO_DIGEST = bytes(16)


def read_by_kernel(cf: CachedFile) -> bool:
    """The kernel reads `cf`'s cache file by itself (held, and that file not detached since:
    after a detach the file's new cache file is an ordinary one, which grew without bound
    through the held paths and ended in ENOSPC for the writer, a helper's hunt)."""
    h = cf.held
    return h is not None and h.current


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
        await self._reserve_held(cf, min(off, cf.size), end)    # (up to its limit, if any)
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

    async def _reserve_held(self, cf: CachedFile, off: int, end: int) -> int:
        """Room in a held file's cache file for [off, end), allocated before anything else
        changes (fallocate, the size kept): the kernel reads that file by itself, so a write
        it cannot take would leave passthrough readers stale bytes (and in write-back it
        held the only copy of dirty data: detaching it lost them). Returns where the room
        ends: `end`, or the file's limit once its cache file stopped growing (_freeze: the
        file grew past what the cache may hold for it, or the cache filesystem is full);
        bytes past the limit are BACKING's alone. No room even within the cache file's own
        length: ENOSPC for this write, nothing changed, nothing dropped. (A cache
        filesystem without fallocate: not reserved.)"""
        if not read_by_kernel(cf):
            return end              # (let go, or detached meanwhile): an ordinary cache file
        h = cf.held
        if h.limit is None and end > cf.size and not self._room_to_grow(end - cf.size):
            self._freeze(cf, "past what the cache may hold for it")
        if h.limit is not None:
            end = min(end, h.limit)
        tries = 0
        while off < end:
            try:
                bp.fallocate(self.cachefiles.fd(cf), _FALLOC_FL_KEEP_SIZE, off, end - off)
                break
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    break               # EOPNOTSUPP; an SSD error shows in the write itself
                self._unreserve(cf, off, end)
                self._s.ssd_failed(exc, "making room in a file in passthrough")
                tries += 1
                if tries == 2 and h.limit is None and end > cf.size:
                    self._freeze(cf, "the cache filesystem is full")
                    end = min(end, h.limit)
                    continue            # the room within its last block is its own
                if tries >= 2:
                    raise OSError(errno.ENOSPC, "no room on the cache filesystem for a file "
                                  "read in passthrough") from None
            await self.persister.persist(durable=False)     # evicted space is released
        return end

    def _room_to_grow(self, grow: int) -> bool:
        """Whether a held file's cache file may take `grow` more bytes: within the pool's
        size, counting the clean data of other files evicted for it (a warm pool is full,
        and with the default pool size its filesystem is at the floor below: a first version
        counted only the free slots and stopped a held file at its first append); past it,
        while the cache filesystem keeps MIN_FREE_FRACTION free. A
        `tail -f` of a log appended to for long filled the cache filesystem, and the
        appender got ENOSPC. (No tighter bound past the pool's size: a reader in
        passthrough reads the file only up to where its cache file stops.)"""
        s = self._s
        need = (grow + EXT_SIZE - 1) // EXT_SIZE
        if len(s.pool) + need <= s.capacity_exts or \
                len(s.pool) + need <= s.capacity_exts + s.evictable_exts():
            return True     # (a full pool is the usual state: its clean data makes room)
        try:
            sv = os.statvfs(self._s.cfg.cache_dir)
        except OSError:
            return True                 # the reservation says
        return (sv.f_bavail - (grow + sv.f_frsize - 1) // sv.f_frsize) >= \
            MIN_FREE_FRACTION * sv.f_blocks

    def _freeze(self, cf: CachedFile, why: str) -> None:
        """The held file's cache file stops growing at the end of the block holding the
        file's end (the bytes up to there are its own): writes past it go to BACKING alone,
        no promotion or fill lands past it (CacheState.install), and its blocks there are
        never valid while it is held. Passthrough opens, which the kernel serves from the
        cache file, see the file end there until they are reopened; other opens read the
        rest from BACKING (their mappings, of the cache file too, end there). Once it is let
        go (or a truncate brings the file back within its cache file: writepath._trim) it
        is a file cached in part."""
        h = cf.held
        h.limit = (cf.size + BLK_SIZE - 1) & ~(BLK_SIZE - 1)
        self.stats.passthrough_frozen += 1
        log.warning("inode %d (%s): a file read in passthrough grew %s: its cache file stops "
                    "at %d bytes; its passthrough readers see the file end there until they "
                    "reopen it, and while it stays held the mappings of its other opens end "
                    "there too (their reads get the rest from BACKING)", cf.ino,
                    os.fsdecode(cf.path or b"?"), why, h.limit)

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
        limit = cf.held_limit()
        if limit is not None and end > limit:
            data = data[:max(0, limit - off)]       # past its limit: BACKING's alone
            end = off + len(data)
            if not data:
                self._s.persist_identity(cf)
                return
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
        limit = cf.held_limit()
        if limit is not None:
            end = min(end, limit)           # past its limit: BACKING's alone (_freeze)
            if start >= end:
                self._s.persist_identity(cf)
                return False
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

    def may_be_mapped(self, of: OpenFile) -> None:
        """An O_RDWR open of a held file has its cache file as backing file: a shared
        writable mapping of it may change any block behind the engine's back until it is
        gone (sync_back). A mark (MAPPED, durable before the open is answered) makes a mount
        after a crash take the whole file as written; the blocks' checksums are unknown
        meanwhile; the open is answered once take_baseline has read what BACKING has."""
        cf = of.cfile
        h = cf.held
        self.store.queue_meta(f"{MAPPED}{cf.ino}", "1")
        for x in list(cf.extents.values()):
            self._s.map.unsummed(cf, x, known=False)
        h.baseline, h.voided, h.baseline_ready = None, set(), trio.Event()
        h.epoch += 1
        if self.write_back and cf.wb_fd < 0:
            cf.wb_fd = os.dup(of.backing_fd)    # the destager's writable BACKING fd
            self._s.persist_birth(cf)

    async def take_baseline(self, cf: CachedFile) -> None:
        """The 128-bit digests of the clean blocks of a file a mapping may now write (their
        bytes are BACKING's), read in a thread before the open is answered: what sync_back
        compares with. Extents the engine changes meanwhile are voided (Held.voided). Not
        for files over BASELINE_MAX_BYTES (every block then counts as changed)."""
        h = cf.held
        h.voided = set()        # what changed before (a refresh of the file): read below
        if cf.size > BASELINE_MAX_BYTES:
            return
        want = [(x, x.valid & ~x.dirty) for x in cf.extents.values() if x.valid & ~x.dirty]
        try:
            digests = await trio.to_thread.run_sync(
                block_digests, self.cachefiles.path(cf.ino), [(x.ext, m) for x, m in want])
        except OSError as exc:
            log.info("inode %d: its cache file could not be read (%s): every block counts as "
                     "written when its mappings are gone", cf.ino, exc)
            return
        if h.voided is None:                # let go of or replaced meanwhile
            return
        h.baseline = {x.ext: (x, m, digests[x.ext]) for x, m in want
                      if x.ext in digests and cf.extents.get(x.ext) is x}

    async def sync_back(self, cf: CachedFile) -> None:
        """The end of a held file a shared writable mapping may have changed: the clean
        blocks whose bytes differ from the baseline taken at the O_RDWR open, or that have
        none (the engine changed their extent since, a file too large for one), turn dirty
        (write-back) or are copied to BACKING (write-through). An open that wrote nothing
        through a mapping costs a read of the cache file and nothing on BACKING.

        Write-back: the dirty blocks count as rewritten since the destager's snapshot
        (`Extent.redirty`), as a write's do. A pass in flight read them before the
        mapping's last writes; it cleaned them with those older bytes when done, and the
        mapping's writes never reached BACKING (a test's hung BACKING). Marked before the
        first await: a pass may end during the read of the digests."""
        if self.write_back:
            for x in cf.extents.values():
                x.redirty |= x.dirty
        h = cf.held
        base, voided = h.baseline or {}, h.voided or set()
        h.baseline = h.voided = None
        epoch = h.epoch
        changed = await self._mapped_changes(cf, base, voided, ended=True)
        nbytes = sum(popcount(m) for _, m in changed) * BLK_SIZE
        if self.write_back:
            for e, m in changed:
                x = cf.extents[e]
                self.persister.journal_dirtying(x.key)
                self._s.map.write(cf, x, m, changed=False)
            if changed:
                # The file changed: its mtime moves, the one its destage gives BACKING
                # too (it stayed the one before: rsync -a and make missed the change, a
                # helper's hunt). Blocks that were dirty already and that the mapping
                # rewrote are not seen here; their writes through the daemon moved it.
                self._s.written_now(cf)
            self._unmark(cf, epoch)                             # with the dirty marks
            self.stats.passthrough_syncs += 1
            log.info("inode %d: %d bytes in %d extents written through a shared mapping "
                     "are dirty", cf.ino, nbytes, len(changed))
            return
        try:
            await self._copy_changed(cf, changed, nbytes, epoch)
        except OSError:
            if h.voided is not None:            # a new O_RDWR open's baseline must not
                h.voided.update(e for e, _ in changed)  # vouch for what BACKING lacks
            raise
        self.stats.passthrough_syncs += 1       # counted once BACKING has it

    async def checkpoint(self, cf: CachedFile) -> None:
        """Write-through, a flush while an O_RDWR open of a held file is still there (a
        program still mapping it, or one that msync'd and exited, its release not yet
        taken): what its mappings changed so far is copied to BACKING now, so that the
        flush leaves BACKING with what was written through the mount (it copied nothing:
        a helper's fio hunt). The baseline and the file's mark stay for the mapping's end
        (sync_back), which copies those blocks again with what is written later."""
        h = cf.held
        changed = await self._mapped_changes(cf, h.baseline or {}, set(h.voided or ()),
                                             ended=False)
        nbytes = sum(popcount(m) for _, m in changed) * BLK_SIZE
        await self._copy_changed(cf, changed, nbytes, h.epoch, unmark=False)

    async def _mapped_changes(self, cf: CachedFile, base: dict, voided: set, ended: bool
                              ) -> list[tuple[int, int]]:
        """(extent, blocks) of a held file's clean blocks that may differ from BACKING: their
        bytes differ from the baseline `base`, or they have none (`voided`: the engine
        changed their extent since). `ended`: no mapping is left, the blocks' checksums are
        taken from the file as the mappings left it."""
        todo = [(x, x.valid & ~x.dirty) for x in cf.extents.values() if x.valid & ~x.dirty]
        check = [(x.ext, base[x.ext][1] & m) for x, m in todo
                 if x.ext in base and x.ext not in voided and base[x.ext][0] is x]
        try:
            now = await trio.to_thread.run_sync(block_digests, self.cachefiles.path(cf.ino),
                                                check) if check else {}
        except OSError:
            now = {}                            # every block counts as changed
        changed: list[tuple[int, int]] = []
        for x, m in todo:
            if cf.extents.get(x.ext) is not x:
                continue                        # gone meanwhile (a truncate): nothing to copy
            if ended:
                self._s.map.unsummed(cf, x, known=True)     # as the mapping left them
            m &= x.valid & ~x.dirty
            if x.ext in now:
                m &= ~same_blocks(base[x.ext][2], now[x.ext], base[x.ext][1] & m)
            if m:
                changed.append((x.ext, m))
        return changed

    def _unmark(self, cf: CachedFile, epoch: int) -> None:
        """What a mapping wrote is dirty or in BACKING: the file's mark goes, unless an
        O_RDWR open took the file again meanwhile (its mapping needs the mark: a kill -9
        then lost what it msync'd, a helper's hunt)."""
        if cf.held is None or cf.held.epoch == epoch:
            self.store.queue_meta(f"{MAPPED}{cf.ino}", None)

    async def _copy_changed(self, cf: CachedFile, changed: list[tuple[int, int]],
                            nbytes: int, epoch: int, unmark: bool = True) -> None:
        async with self._s.file_lock(cf):
            spans_ = [(start, min(end, cf.size)) for start, end in byte_runs(changed)
                      if start < cf.size]
            if not spans_:
                if unmark:
                    self._unmark(cf, epoch)                         # nothing for BACKING
                log.info("inode %d: a shared mapping changed nothing BACKING lacks", cf.ino)
                return
            cf.writes_inflight += 1
            try:
                st = await self.backing.write_call(_copy_back, self.cachefiles.path(cf.ino),
                                                   self.backing.root_fd, cf.path, cf.ino,
                                                   spans_)
            finally:
                cf.writes_inflight -= 1
            if unmark:
                self._unmark(cf, epoch)                 # BACKING has it (or no file)
            if st is not None:
                self._c.own_change(cf, st, size_exact=False)
                self.stats.backing_write_ops += 1
                self.stats.backing_write_bytes += nbytes
                log.info("inode %d: %d bytes a shared mapping wrote copied to BACKING",
                         cf.ino, nbytes)

    async def _write_around_held(self, of: OpenFile, off: int, data: bytes) -> int:
        """_write_around for a held file (its lock held): BACKING, then the cache file, in
        that order, blocks dirty before stay dirty (their bytes are the newest now too)."""
        written = await self._write_held(of, off, data, -1)
        if of.cfile.dirty_exts:             # the destage of older data must not move it back
            self._s.written_now(of.cfile)
        if of.flags & (os.O_SYNC | os.O_DSYNC):
            await self.persister.persist(durable=True)
        return written


def _copy_back(cache_path: str, root: int, path: bytes | None, ino: int,
               spans_: list[tuple[int, int]]) -> os.stat_result | None:
    """Copy the byte ranges `spans_` of a cache file over BACKING's file `ino` (at `path`,
    or found where it went: never another file that took its name) in a thread; its stat,
    or None if either file is gone."""
    try:
        cfd = os.open(cache_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        bfd = bp.open_by_ino(root, path, ino)
        if bfd < 0:
            return None
        try:
            for off, end in spans_:
                while off < end:
                    chunk = os.pread(cfd, min(1 << 20, end - off), off)
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


def block_digests(cache_path: str, want: list[tuple[int, int]]) -> dict[int, bytes]:
    """The 128-bit digests of blocks `mask` of each extent in `want` [(extent, mask)] of a
    cache file (in a thread): extent -> 16 digests of 16 bytes (zeros where not asked)."""
    out: dict[int, bytes] = {}
    fd = os.open(cache_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for e, mask in want:
            data = memoryview(os.pread(fd, EXT_SIZE, e << EXT_SHIFT))
            if len(data) < EXT_SIZE:
                data = memoryview(bytes(data) + bytes(EXT_SIZE - len(data)))
            out[e] = b"".join(_digest(data[b << BLK_SHIFT:(b + 1) << BLK_SHIFT])
                              if mask >> b & 1 else _NO_DIGEST for b in range(BLKS_PER_EXT))
    finally:
        os.close(fd)
    return out


def same_blocks(before: bytes, after: bytes, mask: int) -> int:
    """Blocks of `mask` whose digests in `before` and `after` (block_digests) are equal."""
    same = 0
    for b in range(BLKS_PER_EXT):
        if mask >> b & 1 and before[16 * b:16 * b + 16] == after[16 * b:16 * b + 16]:
            same |= 1 << b
    return same


def byte_runs(changed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[(start, end)] byte ranges of the blocks `changed` [(extent, mask)], adjacent ones
    merged."""
    out: list[tuple[int, int]] = []
    for e, m in sorted(changed):
        base = e << EXT_SHIFT
        for b0, b1 in runs(m):
            start, end = base + (b0 << BLK_SHIFT), base + (b1 << BLK_SHIFT)
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], end)
            else:
                out.append((start, end))
    return out
