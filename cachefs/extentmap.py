"""The one owner of extent state: which extents of which files are cached, and which of
their 4 KiB blocks are valid and dirty.

Owns `ExtentMap`, whose verbs are the only code that creates or forgets an `Extent` or
changes its `valid`/`dirty` bits: add, fill, write, invalidate, clean, trim, remove, evict,
drop_file (and restore, at mount). Each verb mirrors its change at once into the eviction
pool, the dirty index, the store's next batch and the persister (data to fdatasync, space
to release), so no caller can forget a mirror. Verbs are synchronous (atomic under trio)
and do no I/O except in the checks. Policy (what to admit, what to evict, when to wait) is
the callers'. (The destager's snapshot resets `Extent.redirty` in `writeback.plan_destage`:
its own bookkeeping.)

The invariants (docs/concurrency.md) hold after every verb:
  I1  dirty ⊆ valid.
  I2  every extent of the map is in the pool, once.
  I3  the dirty index holds exactly the extents with dirty blocks, with their block count,
      and `CachedFile.dirty_exts` counts them per file.
  I4  no extent of the map has its SSD space pending release or being released: the
      persister punches holes only where the map has no extent, and `add` refuses a key
      whose hole is being punched (a writer waits for `Persister.wait_punched` first).
  I5  a valid block's bytes are in the cache file (never a hole).
  I6  no dirty block lies past the file's logical size.
I1 and I4 are checked on every verb (a violation raises `InvariantError`: losing data
quietly is worse than stopping); all of them with `--check-invariants` (tests, bug hunts).
"""

from __future__ import annotations

import os

from .config import BLK_SIZE, EXT_SIZE
from .dirty import DirtyIndex
from .errors import InvariantError
from .extents import BLK_SHIFT, EXT_SHIFT, FULL_MASK, CachedFile, Extent, block_mask, runs
from .integrity import recheck, restore_sums, resum
from .persist import Persister
from .store import MetadataStore


def spans(off: int, end: int) -> list[tuple[int, int, int, int]]:
    """(ext, start, stop, mask) for each extent that byte range [off, end) touches: the
    absolute byte range [start, stop) inside it and the mask of the blocks it touches."""
    e = off >> EXT_SHIFT
    base = e << EXT_SHIFT
    if end <= base + EXT_SIZE:              # within one extent: every 4 KiB request
        return [(e, off, end, block_mask(off - base, end - base))] if end > off else []
    out = []
    while True:
        s = off if off > base else base
        t = end if end < base + EXT_SIZE else base + EXT_SIZE
        if s >= t:
            return out
        out.append((e, s, t, block_mask(s - base, t - base)))
        e += 1
        base = e << EXT_SHIFT


def holes(fd: int, size: int, e: int, valid: int) -> int:
    """The blocks of `valid` (of extent `e`) whose bytes are not in the cache file `fd`
    (`size` bytes long): a hole under all of them, or no byte of them before its end. (The
    last block of a file may end past the cache file's end: its bytes past EOF read as
    zeros. So may a block that held the end of a truncated cache file and was extended
    since: on a cache filesystem with blocks smaller than 4 KiB its tail is a hole, which
    holds the zeros the file has there; whole blocks are what a cut or a punch removes.)"""
    base = e << EXT_SHIFT
    mask = valid & ~block_mask(0, max(0, min(size - base, EXT_SIZE)))
    for b0, b1 in runs(valid):
        s, t = base + (b0 << BLK_SHIFT), min(base + (b1 << BLK_SHIFT), size)
        while s < t:
            hole = os.lseek(fd, s, os.SEEK_HOLE)
            if hole >= t:
                break
            try:
                data = os.lseek(fd, hole, os.SEEK_DATA)
            except OSError:                 # ENXIO: a hole up to the end of the file
                data = size
            # the blocks whose bytes (up to the cache file's end) are all inside the hole
            end = min(data, t) - base
            first = (hole - base + BLK_SIZE - 1) >> BLK_SHIFT
            last = (end + (BLK_SIZE - 1 if end + base >= size else 0)) >> BLK_SHIFT
            if last > first:
                mask |= ((1 << last) - 1) ^ ((1 << first) - 1)
            s = data
    return mask & valid


class ExtentMap:
    def __init__(self, files: dict[int, CachedFile], pool, dirty: DirtyIndex,
                 store: MetadataStore, persister: Persister, cache_path, check: bool = False):
        self.files = files
        self.pool = pool
        self.dirty = dirty
        self.store = store
        self.persister = persister
        self._cache_path = cache_path          # ino -> the cache file's path (checks only)
        self.check_all = check
        # extents with dirty blocks found damaged on the SSD (integrity.py): key -> file
        self.bad: dict[tuple[int, int], CachedFile] = {}
        self._checks = 0                        # --check-invariants: changes checked

    # -- verbs -------------------------------------------------------------------------------

    # Verbs that mark blocks valid after new bytes went into the cache file take their
    # checksums from it (integrity.resum), in the same synchronous step as the write.

    def add(self, cf: CachedFile, e: int, valid: int = 0, data=None, data_off: int = 0
            ) -> Extent:
        """A new extent of `cf` (its valid blocks are in the cache file already; blocks
        marked valid later get their checksums then); `data` as for `fill`."""
        key = (cf.ino, e)
        if self.persister.punching(key):
            raise InvariantError(f"extent {key} added while its hole is being punched")
        x = cf.extents[e] = Extent(cf.ino, e, valid)
        if valid:
            self._resum(cf, x, valid, data, data_off)
        self.pool.insert(x)
        self.persister.reused(key)
        if len(cf.extents) == 1:
            self.persist_identity(cf)
        self._changed(cf, x)
        return x

    def restore(self, cf: CachedFile, e: int, valid: int, dirty: int, sums: bytes | None = None,
                summed: int = 0) -> Extent:
        """An extent loaded from the store at mount: in the pool (as hot data) and the dirty
        index; the store has it already."""
        x = cf.extents[e] = Extent(cf.ino, e, valid)
        restore_sums(x, sums, summed)
        self.pool.insert_main(x)
        self.persister.reused(x.key)
        if dirty:
            self.dirty.set(cf, x, dirty)
            x.db_dirty = True
        return x

    def fill(self, cf: CachedFile, x: Extent, mask: int, data=None, data_off: int = 0
             ) -> None:
        """Blocks `mask` now hold BACKING's bytes (a fill, a write-through update, the zeros
        a truncation left in the block holding the end); `data`: the bytes just written at
        `data_off` (whole blocks are summed from them)."""
        x.valid |= mask
        self._resum(cf, x, mask, data, data_off)
        self._changed(cf, x)

    def rewritten(self, cf: CachedFile, x: Extent, mask: int, data=None, data_off: int = 0
                  ) -> None:
        """New bytes went into blocks `mask` that stay as valid (and dirty) as they were: a
        write-through update or a mirror of a partial block a fill made valid meanwhile;
        `data` as for `fill`."""
        mask &= x.valid
        if mask:
            self._resum(cf, x, mask, data, data_off)
            self._changed(cf, x)

    def write(self, cf: CachedFile, x: Extent, mask: int, whole: int = 0,
              changed: bool = True, data=None, data_off: int = 0) -> None:
        """Blocks `mask` now hold a write-back write's bytes: valid and dirty, and rewritten
        since the destager's snapshot. `whole`: the blocks it rewrote entirely (damaged
        ones among them are whole again); `changed` False: the bytes are as they were;
        `data`: the bytes written at `data_off` (whole blocks are summed from them)."""
        x.valid |= mask
        x.redirty |= mask
        x.bad &= ~whole
        if changed:
            self._resum(cf, x, mask, data, data_off)
        self.dirty.set(cf, x, mask)
        self._changed(cf, x)

    def invalidate(self, cf: CachedFile, x: Extent, mask: int) -> None:
        """Clean blocks of `mask` no longer match BACKING (a write went around them, BACKING
        changed); dirty blocks stay (they are the newest data)."""
        x.valid &= ~(mask & ~x.dirty)
        self._changed(cf, x, data=False)

    def unsummed(self, cf: CachedFile, x: Extent, known: bool) -> None:
        """Something outside the engine may have written the extent (a shared writable
        mapping of a held cache file): its checksums are unknown; `known` True: that
        writer is gone, take them from the file as it is."""
        x.summed = 0
        if known:
            self._resum(cf, x, x.valid)
        self._changed(cf, x)

    def _resum(self, cf: CachedFile, x: Extent, mask: int, data=None, data_off: int = 0
               ) -> None:
        held = cf.held
        if held is not None and held.mapped_writable:
            x.summed &= ~mask                   # a mapping may write them any time
        else:
            resum(cf.cache_fd, x, mask, data, data_off)

    def damaged(self, cf: CachedFile, x: Extent, clean: int, dirty: int) -> None:
        """Blocks that failed their checksums: the clean ones are forgotten (BACKING has
        them), the dirty ones stay, marked bad (reads fail, never destaged)."""
        x.valid &= ~(clean & ~x.dirty)
        x.bad |= dirty & x.dirty
        self._changed(cf, x, data=False)

    def clean(self, cf: CachedFile, x: Extent, mask: int) -> None:
        """Blocks `mask` are durably in BACKING (a destage pass): no longer dirty."""
        self.dirty.clear(cf, x, mask)
        self._changed(cf, x, data=False)

    def trim(self, cf: CachedFile, x: Extent, keep: int) -> None:
        """Only blocks `keep` survive a truncation (dirty ones past it are gone too)."""
        self.dirty.clear(cf, x, x.dirty & ~keep)
        x.valid &= keep
        self._changed(cf, x)        # (the cache file was cut: made durable with the map)

    def remove(self, cf: CachedFile, x: Extent) -> None:
        """Forget an extent, dirty blocks included (truncated, stale, unusable); its SSD
        space is released after the next durable commit. A promotion of it in flight is
        overtaken: its bytes were read before whatever made the extent go (a destage of
        dirty blocks that a stale read of BACKING would bring back)."""
        self.dirty.clear(cf, x, x.dirty)
        self.pool.remove(x)
        del cf.extents[x.ext]
        self.bad.pop(x.key, None)
        cf.clobber(x.ext, x.ext)
        self.store.queue_drop_extent(cf.ino, x.ext)
        self.persister.evicted(x.key)

    def evict(self, cf: CachedFile, x: Extent) -> None:
        """Forget a clean extent to make room (the pool's victim, a drop)."""
        if x.dirty:
            raise InvariantError(f"dirty extent {x.key} chosen for eviction")
        self.remove(cf, x)
        if not cf.extents:
            self.store.queue_drop_file(cf.ino)

    def drop_file(self, cf: CachedFile) -> None:
        """Forget every extent of a file, dirty ones included, and empty its cache file."""
        for x in list(cf.extents.values()):
            self.dirty.clear(cf, x, x.dirty)
            self.pool.remove(x)
            self.bad.pop(x.key, None)
        cf.extents.clear()
        cf.clobber(0, 1 << 62)
        self.store.queue_drop_file(cf.ino)

    def persist_identity(self, cf: CachedFile) -> None:
        """Queue the file's record (BACKING identity, path hint, logical size)."""
        if cf.extents and cf.identity is not None:
            _, size, mtime_ns, ctime_ns = cf.identity
            self.store.queue_file(cf.ino, size, mtime_ns, ctime_ns, cf.path, cf.size)

    def _changed(self, cf: CachedFile, x: Extent, data: bool = True) -> None:
        """Mirror an extent's new state and check the invariants it must keep. `data`: the
        map may now claim bytes of the cache file not yet made durable (added, rewritten,
        summed), so the next commit fdatasyncs the file first; False for changes that only
        claim less or the same bytes (cleaned by a destage, invalidated, damaged):
        a file whose data was synced by an earlier commit is not synced again for them (a
        destaged small file cost a second fdatasync)."""
        if x.dirty & ~x.valid:
            raise InvariantError(f"extent {x.key}: dirty blocks {x.dirty:#x} not all valid "
                                 f"({x.valid:#x})")
        x.summed &= x.valid
        x.xsum = None                           # taken again at the next whole-extent read
        held = cf.held
        if held is not None and held.voided is not None:
            held.voided.add(x.ext)              # its baseline no longer holds (sync_back)
        if x.bad:
            x.bad &= x.dirty                    # truncated or cleaned away: no longer lost
            if x.bad:
                self.bad[x.key] = cf
            else:
                self.bad.pop(x.key, None)
        self.store.queue_extent(cf.ino, x.ext, x.valid, x.dirty, x.summed,
                                x.sums.tobytes() if x.summed else None)
        if data:
            self.persister.written(cf.ino)
        if self.check_all:
            # Checksums on every 4th change (each re-reads the extent; a write path that
            # forgets to retake them is still caught within a few changes).
            self._checks += 1
            self.check_extent(cf, x, sums=not self._checks & 3)

    # -- checks ------------------------------------------------------------------------------

    def check_extent(self, cf: CachedFile, x: Extent, sums: bool = True) -> None:
        """Every invariant of one extent (I1-I6), and with `sums` that its blocks match
        their checksums (after a change: a write path that forgot to retake them); raises
        InvariantError."""
        key = x.key
        problems = []
        if cf.extents.get(x.ext) is not x:
            problems.append("not in its file's map")
        if x.dirty & ~x.valid:
            problems.append(f"dirty {x.dirty:#x} not within valid {x.valid:#x}")
        if x.queue is None:
            problems.append("not in the eviction pool")
        if bool(x.dirty) != (key in self.dirty):
            problems.append(f"dirty {x.dirty:#x} but {'' if key in self.dirty else 'not '}"
                            "in the dirty index")
        if self.persister.releasing(key):
            problems.append("its SSD space is pending release or being released")
        base = x.ext << EXT_SHIFT
        if x.dirty and x.dirty & ~block_mask(0, max(0, min(cf.size - base, EXT_SIZE))):
            problems.append(f"dirty blocks past the logical size {cf.size}")
        if x.valid and not problems:
            hole = self._hole_in(cf, x)
            if hole is not None:
                problems.append(f"valid block at {hole} is a hole in the cache file")
        if sums and x.summed & ~x.bad and not problems:
            wrong = recheck(cf.cache_fd, self._cache_path(cf.ino), x, x.summed & ~x.bad)
            if wrong:
                problems.append(f"blocks {wrong:#x} fail their checksums")
        if problems:
            raise InvariantError(f"extent {key}: " + "; ".join(problems))

    def _hole_in(self, cf: CachedFile, x: Extent) -> int | None:
        """The offset of a hole under a valid block of `x`, or None."""
        fd = cf.cache_fd
        opened = fd < 0
        if opened:
            try:
                fd = os.open(self._cache_path(cf.ino), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return x.ext << EXT_SHIFT
        try:
            mask = holes(fd, os.fstat(fd).st_size, x.ext, x.valid)
        finally:
            if opened:
                os.close(fd)
        if not mask:
            return None
        return (x.ext << EXT_SHIFT) + (runs(mask)[0][0] << BLK_SHIFT)

    def repair_holes(self) -> tuple[int, int]:
        """After an unclean stop: forget valid blocks whose bytes are not in the cache file
        (a cache file cut or emptied before the commit that forgot its extents: a file
        dropped as stale, unlinked or truncated; I5). Returns (extents, dirty blocks)
        touched; dirty blocks lost that way are counted for the log."""
        touched = dirty_lost = 0
        for cf in self.files.values():
            if not cf.extents:
                continue
            try:
                fd = os.open(self._cache_path(cf.ino), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = -1                     # no cache file: no byte of any block
            try:
                size = os.fstat(fd).st_size if fd >= 0 else 0
                for x in list(cf.extents.values()):
                    mask = holes(fd, size, x.ext, x.valid)
                    if not mask:
                        continue
                    touched += 1
                    dirty_lost += bin(mask & x.dirty).count("1")
                    if mask == x.valid:
                        self.remove(cf, x)
                    else:
                        self.trim(cf, x, ~mask & FULL_MASK)
            finally:
                if fd >= 0:
                    os.close(fd)
        return touched, dirty_lost

    def check(self) -> int:
        """Every invariant of the whole map and its mirrors; returns the extents checked."""
        n = 0
        blocks = 0
        for cf in self.files.values():
            dirty_exts = 0
            for x in cf.extents.values():
                self.check_extent(cf, x, sums=False)     # each change checked its own
                dirty_exts += bool(x.dirty)
                blocks += bin(x.dirty).count("1")
                n += 1
            if dirty_exts != cf.dirty_exts:
                raise InvariantError(f"inode {cf.ino}: {dirty_exts} dirty extents, counted "
                                     f"{cf.dirty_exts}")
        if n != len(self.pool):
            raise InvariantError(f"the pool holds {len(self.pool)} extents, the map {n}")
        files = sum(1 for cf in self.files.values() if cf.dirty_exts)
        if files != self.dirty.files:
            raise InvariantError(f"the dirty index counts {self.dirty.files} files with dirty "
                                 f"data, the map {files}")
        if blocks != self.dirty.blocks or sum(1 for _ in self.dirty) != sum(
                bool(x.dirty) for cf in self.files.values() for x in cf.extents.values()):
            raise InvariantError(f"the dirty index counts {self.dirty.blocks} blocks in "
                                 f"{len(self.dirty)} extents, the map {blocks} blocks")
        return n
