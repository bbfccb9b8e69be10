"""The cache state: the files with cached data, the pool of extents and its capacity, and
the decisions that keep them consistent (load at mount, install, evict, drop, a full SSD).

Owns `CacheState`: `files` (ino -> CachedFile), `pool` (eviction order), `admission`,
`capacity_exts`/`target_exts`, the SSD-full hold, and the objects below it (the extent map,
the dirty index, the cache files, the persister, the store). Extent state itself changes
only through `self.map` (extentmap.ExtentMap), in synchronous code (atomic under trio).
Imports only lower modules; the read path, the write path, coherence and the engine façade
use it.
"""

from __future__ import annotations

import errno
import logging
import os
import time

import trio

from . import backingpaths as bp
from .backing import Backing
from .cachefiles import CacheFiles, pwrite_all
from .config import BLK_SIZE, EXT_SIZE, Config, format_size
from .dirty import DirtyIndex
from .errors import UserError
from .extentmap import ExtentMap
from .extents import (BLK_SHIFT, EXT_SHIFT, FULL_MASK, KEEP_ATIME, CachedFile, Extent,
                      block_mask, identity, popcount, racy, runs)
from .integrity import Reports, lost_blocks
from .oplog import RateLimitedLog
from .persist import Persister
from .policy import Admission, Clock, S3Fifo
from .room import NO_SPACE
from .stats import Stats
from .store import MetadataStore

log = logging.getLogger("cachefs.cache")

UNLINKING = "unlinking:"     # meta key prefix of an unlink intent (see store.py)
MAPPED = "mapped:"           # meta key prefix: a held file mapped shared and writable
CUTS = "cut:"                # meta key prefix: a write-back shrink BACKING may not have yet
ABANDONED = "abandoned:"     # meta key prefix: a destage pass the unmount left to its thread
CLOCK_REALTIME_COARSE = 5        # Linux: the clock file systems stamp times from
TIMES = "times:"             # meta key prefix of the times awaiting a destage (set_times)
CAPS = "caps:"               # meta key prefix of a capability awaiting a destage (set_caps)
CTIMES = "ctime:"            # meta key prefix of a ctime shown over a destage's (mask_ctime)
BIRTHS = "birth:"            # meta key prefix: BACKING's birth time of a file with dirty data
CTIMES_KEPT = 65536          # files whose ctime is shown over a destage's, at most
SSD_FULL_HOLD_S = 2.0       # after an out-of-space error: no promotions, writes go around


class CacheState:
    def __init__(self, cfg: Config, store: MetadataStore, backing: Backing, stats: Stats,
                 capacity_exts: int):
        self.cfg = cfg
        self.store = store
        self.backing = backing
        self.stats = stats
        self.write_back = cfg.mode == "write-back"
        self._root_paths = bp.root_paths(cfg.backing)
        self.capacity_exts = capacity_exts
        self.target_exts = capacity_exts         # the pool size asked for (capacity may shrink)
        self.files: dict[int, CachedFile] = {}
        # write-back: ino -> (BACKING's ctime after a destage of ours, the ctime shown before
        # it): a destage is no change of the file's (shown_ctime)
        self.ctimes: dict[int, tuple[int, int]] = {}
        self.mtime_floor = 0                     # the latest mtime set through the mount
        self.pool = (S3Fifo if cfg.eviction == "s3-fifo" else Clock)(capacity_exts)
        self.admission = Admission(cfg.promote_after)
        self.dirty = DirtyIndex()                # write-back: extents newer than BACKING
        self.cachefiles = CacheFiles(cfg.cache_dir, self.cache_file_made,
                                     self.cache_file_restored)
        self.persister = Persister(store, self.cachefiles, stats, self, cfg.commit_interval_s)
        self.map = ExtentMap(self.files, self.pool, self.dirty, store, self.persister,
                             self.cachefiles.path, check=cfg.check_invariants)
        self.damage = Reports(stats, self.map)    # blocks failing their checksums
        self._ssd_full_until = 0.0
        self._shrink_at_s = -1e9
        self._ssd_warned_s = -1e9
        self._limited = RateLimitedLog(log, clock=lambda: time.monotonic())
        self._reserve_gone = False      # the reserve file was given up (room.py)
        self.db_dirty_evicted: set[tuple[int, int]] = set()   # see committed()

    def load(self, clean_stop: bool, renumbered: str | None = None,
             discard_dirty: bool = False) -> None:
        """Rebuild the in-memory map from the store (warm restart, or recovery).

        After an unclean stop, every valid block of an extent in the doubt journal is
        treated as dirty: it may hold data newer than BACKING. `renumbered`: why BACKING's
        inode numbers may have changed since (_distrust_numbers).
        """
        files, extents = self.store.load()
        checking, self.map.check_all = self.map.check_all, False     # checked when whole
        for ino, (size, mtime_ns, ctime_ns, path, lsize) in files.items():
            cf = self.files[ino] = CachedFile(ino, (ino, size, mtime_ns, ctime_ns))
            cf.racy = racy(cf.identity, self.store.written_before_ns)   # seen before then
            cf.path = path
            cf.size = lsize
            cf.recovered = not clean_stop
            cf.verified = False
        doubt = set() if clean_stop else self.store.journal.read()
        over = 0
        for ino, ext, valid, dirty, summed, sums in extents:
            cf = self.files.get(ino)
            if (ino, ext) in doubt:
                dirty |= valid
            if not clean_stop:
                # Dirty blocks may have been rewritten after the last commit of their
                # checksums: unknown until written again or verified (a false mismatch
                # would fail reads of good data with EIO). Clean blocks keep theirs: a
                # mismatch there costs one read of BACKING.
                summed &= ~dirty
            if cf is None or not valid:
                self.store.queue_drop_extent(ino, ext)        # names no cached data
                continue
            if not dirty and len(self.pool) >= self.capacity_exts:
                self.store.queue_drop_extent(ino, ext)
                self.persister.evicted((ino, ext))
                over += 1
                continue
            self.map.restore(cf, ext, valid, dirty, sums, summed)
        if renumbered is not None:
            self._distrust_numbers(renumbered, discard_dirty)
        for key in self.store.meta_keys(MAPPED):
            self.store.queue_meta(key, None)        # committed with the dirty marks below
            cf = self.files.get(int(key[len(MAPPED):]))
            if cf is not None and cf.extents:
                log.warning("inode %d (%s) was mapped shared and writable at the last stop: "
                            "its cache file may hold writes BACKING lacks; its %d cached "
                            "extents are dirty and go to BACKING", cf.ino,
                            os.fsdecode(cf.path or b"?"), len(cf.extents))
                for x in cf.extents.values():
                    self.map.unsummed(cf, x, known=False)
                self.dirty_whole(cf)
        for key, value in self.store.meta_items(CTIMES).items():
            backing_ctime, shown = value.split()
            self.ctimes[int(key[len(CTIMES):])] = (int(backing_ctime), int(shown))
        for key, value in self.store.meta_items(TIMES).items():
            cf = self.files.get(int(key[len(TIMES):]))
            if cf is not None and cf.dirty_exts:
                a, m = value.split()
                cf.times = (int(a), int(m))
            else:
                self.store.queue_meta(key, None)
        for key, value in self.store.meta_items(CAPS).items():
            cf = self.files.get(int(key[len(CAPS):]))
            if cf is not None and cf.dirty_exts:
                cf.caps = bytes.fromhex(value)
            else:
                self.store.queue_meta(key, None)
        for key, value in self.store.meta_items(BIRTHS).items():
            cf = self.files.get(int(key[len(BIRTHS):]))
            if cf is not None and cf.dirty_exts:
                cf.birth = int(value)
            else:
                self.store.queue_meta(key, None)
        for key, value in self.store.meta_items(CUTS).items():
            self._complete_cut(key, value)
        for key in self.store.meta_keys(ABANDONED):
            # The unmount cut a destage pass of this file off; its thread went on writing
            # BACKING after the last commit. Its new size and times are cachefs's own, as
            # after an unclean stop (each remount reported a conflict: xfstests generic/464).
            cf = self.files.get(int(key[len(ABANDONED):]))
            if cf is not None:
                cf.recovered = True
            self.store.queue_meta(key, None)
        # Files whose last name was going when the daemon stopped are settled first: gone,
        # their data went with them (a deletion the program asked for, not a drop: it was
        # logged as an orphan's dirty data discarded, when ext4 had given the number to a
        # new file, as to each new SQLite rollback journal: a helper's hunt).
        unlinking = {int(key[len(UNLINKING):]): key for key in self.store.meta_keys(UNLINKING)}
        self._bind_dirty([cf for cf in self.files.values()
                          if cf.dirty_exts and cf.birth and cf.ino not in unlinking])
        for ino, key in unlinking.items():
            self.store.queue_meta(key, None)
            cf = self.files.get(ino)
            if cf is None:
                continue
            if self._survived_unlink(cf):
                if cf.dirty_exts and cf.birth:
                    self._bind_dirty([cf])
                continue
            log.info("BACKING inode %d (last seen as %s) was unlinked through the mount just "
                     "before an unclean stop: its %d cached extents (%d dirty) went with it",
                     cf.ino, os.fsdecode(cf.path or b"?"), len(cf.extents), cf.dirty_exts)
            self.drop_file(cf)
            del self.files[cf.ino]
        if not clean_stop:
            touched, lost = self.map.repair_holes()
            if touched:
                self.stats.drop_recovery += touched
                log.warning("unclean stop: %d cached extents had valid blocks missing from "
                            "their cache files (cut before the commit that forgot them); "
                            "those blocks are read from BACKING (reason: recovery)%s", touched,
                            f"; {lost} of them were dirty and are lost" if lost else "")
        self.map.check_all = checking
        if checking:
            self.map.check()
        if over:
            self.stats.drop_capacity += over
            log.warning("dropped %d cached extents beyond the cache size of %s (reason: "
                        "capacity)", over, format_size(self.capacity_exts * EXT_SIZE))
        if doubt:
            log.warning("unclean stop: %d extents in doubt are treated as dirty", len(doubt))

    def _distrust_numbers(self, why: str, discard_dirty: bool) -> None:
        """BACKING is a FUSE filesystem mounted again since the last stop (`why`): many
        (libfuse's high-level ones, such as sshfs without -o use_ino) number their files
        anew at every mount, in lookup order, so a cached file's number may now be another
        file's, of the same size and times: one file's bytes were served as another's, and
        dirty data was destaged into the wrong file (a helper's hunt). Clean data goes
        (reason: recovery). Dirty data stays for files whose path still leads to the same
        number; if one's does not, the mount is refused (with `discard_dirty`, that file's
        dirty data goes instead, reason: orphan)."""
        root = self.backing.root_fd
        moved = []
        for cf in self.files.values():
            if not cf.dirty_exts:
                continue
            try:
                fd = bp.open_by_ino(root, cf.path, cf.ino, self._root_paths, walk=False)
            except OSError:
                fd = -2
            if fd >= 0:
                os.close(fd)
            else:
                moved.append(cf)
        if moved and not discard_dirty:
            cf = moved[0]
            raise UserError(
                f"BACKING {self.cfg.backing} {why}, and it may number its files anew at "
                f"every mount: {len(moved)} file(s) with write-back data not yet in BACKING "
                f"are not at their inode number any more ({os.fsdecode(cf.path or b'?')} was "
                f"inode {cf.ino}), so cachefs cannot tell which file that data belongs to. "
                "Mount BACKING with stable inode numbers (sshfs: -o use_ino), or mount with "
                "--discard-dirty to drop that data.")
        for cf in moved:
            self.orphaned(cf, "is not at its inode number any more (BACKING numbers its "
                          "files anew at every mount; --discard-dirty)")
        dropped = 0
        for cf in list(self.files.values()):
            for x in list(cf.extents.values()):
                if x.dirty:
                    self.map.invalidate(cf, x, FULL_MASK)
                else:
                    self.evict(cf, x)
                    dropped += 1
            if not cf.extents:              # its path hint may name another file now
                del self.files[cf.ino]
                self.store.queue_drop_file(cf.ino)
        self.stats.drop_recovery += dropped
        if dropped:
            log.warning("BACKING %s; its inode numbers may differ now (a FUSE filesystem may "
                        "number its files anew at every mount), so the %d cached clean "
                        "extents are dropped (reason: recovery)", why, dropped)

    def _bind_dirty(self, files: list[CachedFile]) -> None:
        """At mount, the files with dirty data whose birth time is known: open BACKING's
        file (by its path, else found by its inode number in one walk of BACKING for all of
        them) for the destager, now. Not there, or another file has its number (deleted
        while cachefs was down, and ext4 gave a new file the number: its dirty data went
        into that unrelated file, and a lookup of the new file took it for a change behind
        the cache: a helper's hunt), its data goes, logged and counted. The descriptor is
        held while the file is dirty: its number cannot go to another file meanwhile.
        BACKING failing: the destager tries later, as before."""
        root = self.backing.root_fd
        moved: dict[int, CachedFile] = {}
        try:
            for cf in files:
                fd = bp.open_by_ino(root, cf.path, cf.ino, self._root_paths, cf.birth,
                                    walk=False)
                if fd == -2:
                    moved[cf.ino] = cf
                elif fd < 0:
                    self.orphaned(cf, "is another file now (another birth time)")
                else:
                    cf.wb_fd = fd
            found = bp.find_by_inos(root, set(moved)) if moved else {}
            for ino, cf in moved.items():
                fd = (bp.open_by_ino(root, found[ino], ino, (), cf.birth, walk=False)
                      if ino in found else -1)
                if fd < 0:
                    self.orphaned(cf, "no longer exists (or another file has its number now)")
                else:
                    cf.wb_fd = fd
        except OSError as exc:
            log.warning("files with dirty data could not be opened in BACKING at mount (%s): "
                        "the destager tries again", exc)

    def orphaned(self, cf: CachedFile, why: str) -> None:
        """The file of dirty data is gone from BACKING: its data goes (reason: orphan)."""
        self.stats.drop_orphan += len(cf.extents)
        log.warning("BACKING inode %d (last seen as %s) %s; discarding its %d cached extents, "
                    "%d of them dirty (reason: orphan)", cf.ino, os.fsdecode(cf.path or b"?"),
                    why, len(cf.extents), cf.dirty_exts)
        self.drop_file(cf)

    def persist_birth(self, cf: CachedFile) -> None:
        """The file turns dirty: its birth time goes with its dirty data (_bind_dirty)."""
        if cf.birth:
            self.store.queue_meta(f"{BIRTHS}{cf.ino}", str(cf.birth))

    def _complete_cut(self, key: str, value: str) -> None:
        """A write-back shrink was made durable (the new size, the dirty blocks past it
        gone) and BACKING's file may not have been cut when the daemon stopped: cut it now,
        so that the file is the truncate's size and nothing older shows past it (the
        recorded size alone was not kept: a kill -9 during BACKING's call brought a file
        fsynced at 4.4 MiB and cut to 412 KiB back empty, or at its old length with bytes
        older than its fsync: a helper's hunt). Kept for the next mount if BACKING fails."""
        ino = int(key[len(CUTS):])
        size, _, path_hex = value.partition(" ")
        path, cf = bytes.fromhex(path_hex), self.files.get(ino)
        paths = [p for p in dict.fromkeys((path, cf.path if cf is not None else None)) if p]
        try:
            if not paths:
                raise OSError(errno.ENOENT, "no path known")
            for where in paths:         # the truncate's path, then where the file was renamed
                try:
                    st = bp.truncate_stat(self.backing.root_fd, where, None, int(size), ino)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ESTALE, errno.ENOTDIR) \
                            or where is paths[-1]:
                        raise
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ESTALE, errno.ENOTDIR):
                self.store.queue_meta(key, None)        # gone: nothing to cut
                return
            log.error("inode %d (%s) was being cut to %s bytes at an unclean stop, and "
                      "BACKING's file could not be cut (%s): the next mount tries again",
                      ino, os.fsdecode(path or b"?"), size, exc)
            return
        self.store.queue_meta(key, None)
        log.warning("unclean stop: inode %d (%s) was being cut to %s bytes; BACKING's file "
                    "is cut now", ino, os.fsdecode(path or b"?"), size)
        if cf is not None:
            cf.identity = identity(st)
            cf.size = st.st_size
            self.persist_identity(cf)

    def _survived_unlink(self, cf: CachedFile) -> bool:
        """After a crash during an unlink: does BACKING still have this very file (same
        inode at its path, with the identity recorded right before the unlink)?"""
        try:
            st = bp.lstat(self.backing.root_fd, cf.path) if cf.path else None
        except OSError:
            return False
        return st is not None and identity(st) == cf.identity

    def dirty_whole(self, cf: CachedFile, journal: bool = False) -> None:
        """Every valid block of `cf` counts as written (dirty): its cache file may hold bytes
        BACKING lacks, written behind the engine's back (a shared writable mapping).
        `journal`: note them in the doubt journal first (at run time)."""
        for x in list(cf.extents.values()):
            m = x.valid & ~x.dirty
            if m:
                if journal:
                    self.persister.journal_dirtying(x.key)
                self.map.write(cf, x, m, changed=False)

    def mapping_wins(self, cf: CachedFile, why: str) -> None:
        """Write-back: a file a shared mapping may be writing now (openmode.Held) meets a
        change of BACKING or a flush: every cached block counts as written (dirty), as the
        dirty data of writes does (the newest data: it overwrites BACKING's). What the
        mapping writes later is taken when it is gone (heldwrites.sync_back)."""
        if not self.write_back or cf.held is None or not cf.held.mapped_writable:
            return
        self.dirty_whole(cf, journal=True)
        self.stats.passthrough_syncs += 1
        log.info("inode %d: all %d cached extents made dirty (%s while a shared mapping may "
                 "write its cache file)", cf.ino, len(cf.extents), why)

    def written_now(self, cf: CachedFile) -> None:
        """Write-back: a write (or truncate) of `cf` was taken now: the mtime BACKING gets
        after the destage is this one. The kernel's coarse clock, as BACKING stamps the
        nodes made after it (a symlink made right after a write looked up to a tick older on
        the fine clock: xfstests generic/423), yet never before the latest mtime set through
        the mount (pyfuse3 gives `touch` the fine clock: a write right after a touch must
        not look older, make) nor the file's own ctime on BACKING (its birth, on BACKING's
        clock), and never after the fine clock (a BACKING clock ahead of ours)."""
        fine = time.time_ns()
        floor = max(self.mtime_floor, cf.identity[3] if cf.identity is not None else 0)
        now = max(time.clock_gettime_ns(CLOCK_REALTIME_COARSE), min(floor, fine))
        times = cf.times
        if times is None or times[1] != now:
            self.set_times(cf, (KEEP_ATIME if times is None else times[0], now))

    def set_caps(self, cf: CachedFile, value: bytes | None) -> None:
        """Write-back: the security.capability set through the mount after the file's last
        write (None: none, or a write or truncate since dropped it), which the destage puts
        back on BACKING after writing the data (its write drops it there)."""
        if value == cf.caps:
            return
        cf.caps = value
        self.store.queue_meta(f"{CAPS}{cf.ino}", None if value is None else value.hex())

    def set_times(self, cf: CachedFile, times: tuple[int, int] | None) -> None:
        """Write-back: the (atime_ns, mtime_ns) BACKING is to have once the file's dirty data
        is there (a destage moves BACKING's mtime to its own time): the time of the last
        write through the mount, or times set explicitly since; atime KEEP_ATIME: BACKING's
        own. None: the file is clean, BACKING's own times are right."""
        if times == cf.times:
            return
        cf.times = times
        self.store.queue_meta(f"{TIMES}{cf.ino}", None if times is None else
                              f"{times[0]} {times[1]}")

    def dirty_bytes(self) -> int:
        return self.dirty.bytes()

    def oldest_dirty_age_s(self) -> float:
        return self.dirty.oldest_age_s()

    def used_bytes(self) -> int:
        return len(self.pool) * EXT_SIZE

    def cache_path(self, ino: int) -> str:
        return self.cachefiles.path(ino)

    def persist_identity(self, cf: CachedFile) -> None:
        self.map.persist_identity(cf)

    def drop_file(self, cf: CachedFile) -> None:
        """Forget every cached extent of a file, dirty ones included."""
        self.map.drop_file(cf)
        self.admission.forget_file(cf.ino)
        self.store.queue_meta(UNLINKING + str(cf.ino), None)
        self.store.queue_meta(BIRTHS + str(cf.ino), None)
        if cf.held is not None and cf.held.current:
            # The kernel reads this cache file by itself (passthrough opens, mappings):
            # unlink it rather than empty it; they keep their bytes, no zeros appear.
            cf.held.current = False
            # Its next cache file is an ordinary one, evicted as any (protected, the new
            # data of a file written after its detach filled the pool while its old
            # passthrough opens lasted, and no other file could be cached).
            self.pool.unprotect(cf.ino)
            self.stats.passthrough_detached += 1
            log.info("inode %d: cache file detached, not emptied (passthrough opens or "
                     "mappings still read it)", cf.ino)
            try:
                self.cachefiles.detach(cf)
            except OSError:
                pass
            return
        # Safe before the commit: the stored identity no longer matches BACKING.
        try:
            self.cachefiles.truncate(cf, 0)
        except OSError:          # missing or unwritable: the map no longer claims it anyway
            pass

    def stale_in_place(self, cf: CachedFile, size: int) -> None:
        """BACKING changed behind a file the kernel reads by itself (held, no dirty data),
        now `size` bytes long: its blocks turn invalid where they are (extents past the new
        end go). The cache file stays the file's: the kernel serves every open of the inode
        from it until the last passthrough open is released (a new open's mmap maps it), so
        it is read again from BACKING before the next open is answered
        (OpenModes.refresh); a cache file set aside instead kept the old bytes under every
        new mapping, and lost what they wrote."""
        for x in list(cf.extents.values()):
            if x.ext << EXT_SHIFT >= size:
                self.map.remove(cf, x)
            else:
                self.map.invalidate(cf, x, FULL_MASK)
        cf.clobber(0, 1 << 62)      # promotions in flight read the old bytes
        if not cf.extents:
            self.store.queue_drop_file(cf.ino)
        limit = cf.held_limit()
        top = cf.size if limit is None else min(cf.size, limit)     # its cache file's end
        if size < top:              # its readers see the new end at once (the blocks past
            try:                    # it are gone from the map: the stored identity is
                self.cachefiles.truncate(cf, size)      # the old one until a commit)
            except OSError:
                pass

    def forget(self, ino: int) -> None:
        cf = self.files.get(ino)
        if cf is not None and cf.open_count == 0 and not cf.extents and not cf.fills:
            del self.files[ino]
            self._close_wb_fd(cf)

    def shown_ctime(self, ino: int, backing_ctime: int, busy: bool = False) -> int:
        """The ctime programs see for BACKING's `backing_ctime`: the one they saw before a
        destage of ours moved it (its writes and times on BACKING are no change of the
        file: git, rsync and backup tools compare ctimes), until something else moves it.
        `busy`: a change of ours is under way (a destage pass): BACKING's ctime may be its."""
        mask = self.ctimes.get(ino)
        if mask is None:
            return backing_ctime
        if mask[0] == backing_ctime or busy:
            return mask[1]
        del self.ctimes[ino]                    # changed since: BACKING's own from now on
        self.store.queue_meta(f"{CTIMES}{ino}", None)
        return backing_ctime

    def mask_ctime(self, ino: int, backing_ctime: int, shown: int) -> None:
        """A destage of ours left BACKING's ctime at `backing_ctime`; programs saw `shown`."""
        self.ctimes.pop(ino, None)
        if backing_ctime == shown:
            self.store.queue_meta(f"{CTIMES}{ino}", None)
            return
        if len(self.ctimes) >= CTIMES_KEPT:     # the oldest goes (its ctime may show later)
            old = next(iter(self.ctimes))
            del self.ctimes[old]
            self.store.queue_meta(f"{CTIMES}{old}", None)
        self.ctimes[ino] = (backing_ctime, shown)
        self.store.queue_meta(f"{CTIMES}{ino}", f"{backing_ctime} {shown}")

    def discard(self, cf: CachedFile) -> None:
        if self.ctimes.pop(cf.ino, None) is not None:
            self.store.queue_meta(f"{CTIMES}{cf.ino}", None)
        self.drop_file(cf)
        self.cachefiles.close_idle(cf)
        self._close_wb_fd(cf)           # unlinked: no BACKING flush to wait for
        del self.files[cf.ino]
        self.cachefiles.remove(cf.ino)

    @staticmethod
    def _close_wb_fd(cf: CachedFile) -> None:
        """Close the destager's BACKING descriptor of a file the engine lets go of (kept
        open, it held a deleted file's space on BACKING until the unmount); while a destage
        pass holds the file, the destager closes it after (Cache.take_idle_wb_fd)."""
        if cf.wb_fd >= 0 and not (cf.lock is not None and cf.lock.locked()):
            os.close(cf.wb_fd)
            cf.wb_fd = -1

    def file_for(self, ino: int, st: os.stat_result | None = None) -> CachedFile:
        """The cache state of inode `ino`; a fresh one if the old file of that number was
        deleted and its last handle is still to be released (the kernel reuses numbers, and
        RELEASE may arrive after the next CREATE), unless BACKING's `st`, of a file just
        opened, is that deleted file itself: no link left, as it was when last seen, or
        still open here (its number cannot have gone to another file). That is an open
        that raced the unlink or rename that removed the file; it reads what the file held,
        as on a local filesystem."""
        cf = self.files.get(ino)
        if cf is not None and cf.doomed and (st is None or st.st_nlink > 0 and
                                             not cf.open_count and identity(st) != cf.identity):
            self.drop_file(cf)                  # its old handles now read BACKING's old inode
            self._close_wb_fd(cf)
            cf = None
        if cf is None:
            cf = self.files[ino] = CachedFile(ino)
        return cf

    async def backing_read(self, fd: int, size: int, off: int) -> bytes:
        data = await self.backing.pread(fd, size, off)     # failures: BACKING health counts
        self.stats.backing_read_ops += 1
        self.stats.backing_read_bytes += len(data)
        return data

    def install(self, cf: CachedFile, e: int, chunk: bytes) -> bool:
        """Write one extent read from BACKING into the cache, unless it was overtaken."""
        clobbered = cf.fills.pop(e, True)
        key = (cf.ino, e)
        if not chunk:                   # past BACKING's end (read ahead of a stream's end)
            return False
        base = e << EXT_SHIFT
        limit = cf.held_limit()
        if limit is not None and base + len(chunk) > limit:
            # The held cache file stopped growing there: the kernel reads it to its end, and
            # bytes past it would leave a hole of zeros before them (heldwrites._freeze).
            chunk = chunk[:max(0, limit - base)]
            if not chunk:
                self.stats.promotions_dropped += 1
                return False
        if (clobbered or self.files.get(cf.ino) is not cf
                or self.persister.punching(key) or self.ssd_full()):
            self.stats.promotions_dropped += 1
            return False
        x = cf.extents.get(e)
        if x is None and not self.make_room(1):
            self.stats.promotions_dropped += 1
            return False
        valid = block_mask(0, len(chunk))
        fill = valid & ~x.valid if x is not None else valid   # valid blocks are as new or newer
        if len(chunk) & (BLK_SIZE - 1):
            # BACKING ended inside this block: the rest of it is zeros, in the cache file too
            # (it may still hold bytes of an evicted extent whose hole is not punched yet).
            padded = len(chunk) + BLK_SIZE - (len(chunk) & (BLK_SIZE - 1))
            if cf.held is not None:     # the kernel reads a held cache file to its end:
                padded = max(len(chunk), min(padded, cf.size - base))   # never past the file's
            chunk = bytes(chunk) + bytes(padded - len(chunk))
        try:
            fd = self.cachefiles.fd(cf)
            if fill == valid:
                pwrite_all(fd, chunk, base)
            else:
                view = memoryview(chunk)
                for b0, b1 in runs(fill):
                    pwrite_all(fd, view[b0 << BLK_SHIFT:b1 << BLK_SHIFT],
                               base + (b0 << BLK_SHIFT))
        except OSError as exc:
            self.stats.promotions_dropped += 1
            self.ssd_failed(exc, "a promotion")   # only invalid blocks were written: the
            self.cachefiles.close_idle(cf)               # map is unchanged and still true
            return False
        if x is None:                   # the blocks just written are summed from `chunk`
            self.map.add(cf, e, valid, chunk, base)
        else:
            self.map.fill(cf, x, fill, chunk, base)
        self.stats.promotions += 1
        self.cachefiles.close_idle(cf)
        return True

    def cache_file_made(self, cf: CachedFile) -> None:
        """A cache file was made for `cf` where there was none: the blocks the map calls
        cached went with the file it had, removed behind the daemon (an operator, a cleaner
        of old files such as systemd-tmpfiles). Before, the new, empty file was taken for
        it: zeros were served as the file's bytes, through passthrough too. Now its clean
        blocks are forgotten (read from BACKING again) and its dirty ones are lost as
        damaged ones are: reads of them fail with EIO, never destaged until rewritten."""
        lost = [(x, x.valid) for x in cf.extents.values() if x.valid]
        if not lost:
            return
        clean = dirty = 0
        for x, mask in lost:
            clean += popcount(mask & ~x.dirty)
            dirty += popcount(mask & x.dirty & ~x.bad)
            self.map.damaged(cf, x, mask & ~x.dirty, mask & x.dirty)
        self.stats.cache_errors += 1
        self.stats.drop_cache_error += len(lost)
        log.error("the cache file of %s (%s) is gone (removed behind cachefs?): %d clean "
                  "blocks of it dropped (reason: cache error; read from BACKING again)%s",
                  os.fsdecode(cf.path or b"?"), self.cachefiles.path(cf.ino), clean,
                  f"; {dirty} DIRTY blocks not yet in BACKING are lost: reads of them fail "
                  "with EIO and they are not destaged until rewritten whole" if dirty else "")

    def cache_file_unusable(self, cf: CachedFile, exc: OSError) -> None:
        """The cache file of `cf` could not be opened (a failing SSD, a file made immutable,
        no descriptor left). Its clean blocks are dropped (reason cache error: read from
        BACKING again); its dirty blocks stay: BACKING does not have them. Reads of them
        fail while the file cannot be opened, destage passes are retried, and both work
        again once it can. (Every extent was dropped, dirty ones too: the open then served
        BACKING's older bytes, `flush` found nothing dirty, acknowledged writes were lost.)"""
        clean = dirty = dropped = 0
        for x in list(cf.extents.values()):
            clean += popcount(x.valid & ~x.dirty)
            if x.dirty:
                dirty += popcount(x.dirty)
                self.map.invalidate(cf, x, FULL_MASK)
            else:
                self.evict(cf, x)
                dropped += 1
        self.stats.drop_cache_error += dropped
        self._limited.log(logging.ERROR if dirty else logging.WARNING, ("unusable", cf.ino),
                          "cannot open the cache file of %s (%s): %s; %d clean blocks of it "
                          "dropped (reason: cache error; read from BACKING again)%s",
                          os.fsdecode(cf.path or b"?"), self.cachefiles.path(cf.ino), exc,
                          clean, f"; {dirty} DIRTY blocks kept (not in BACKING yet): reads "
                          "of them fail until it opens again" if dirty else "")

    def cache_file_restored(self, cf: CachedFile, copied: int, err: OSError | None) -> None:
        """The cache file of `cf` was removed behind the daemon while it was open; at its
        close its data was copied under its name again (or could not be: then the next open
        finds it gone, cache_file_made)."""
        self.stats.cache_files_restored += err is None
        if err is not None:
            self.stats.cache_errors += 1
        log.log(logging.WARNING if err is None else logging.ERROR,
                "the cache file of %s (%s) was removed behind cachefs while open: %s",
                os.fsdecode(cf.path or b"?"), self.cachefiles.path(cf.ino),
                f"its {format_size(copied)} of data written again under its name"
                if err is None else f"writing it again failed ({err}); its blocks go with it")

    def evictable_exts(self) -> int:
        """How many extents make_room could evict now: the clean ones of files not protected
        (pinned, prefetched, held by passthrough)."""
        protected = sum(len(cf.extents) - cf.dirty_exts for ino in self.pool.protected
                        if (cf := self.files.get(ino)) is not None)
        return len(self.pool) - len(self.dirty) - protected

    def make_room(self, n: int = 1) -> bool:
        """Evict clean extents until `n` more fit; False if dirty data fills the pool."""
        while len(self.pool) + n > self.capacity_exts:
            x = self.pool.victim()
            if x is None:
                return False
            self.evict(self.files[x.ino], x)
            self.stats.evictions += 1
        return True

    def evict(self, cf: CachedFile, x: Extent) -> None:
        """Forget a clean extent; its SSD space is released after the next durable commit."""
        if x.db_dirty:                  # the database still calls it dirty (see committed)
            self.db_dirty_evicted.add(x.key)
        self.map.evict(cf, x)

    def file_lock(self, cf: CachedFile) -> trio.Lock:
        """Serialises a file's destaging with its truncation."""
        if cf.lock is None:
            cf.lock = trio.Lock()
        return cf.lock

    def ssd_full(self) -> bool:
        """True for a while after the cache filesystem ran out of space: no promotions,
        write-back writes go around the cache, until evicted space is released; and for as
        long as the reserve file (room.py), given up to let a commit through, cannot be
        made again. Otherwise new cached data filled the filesystem to its last block once
        more, every commit failed from then on, and the space of evicted extents (their
        holes are punched after a commit) was never released: a cache stuck at a 1 MiB
        pool until someone else freed space."""
        return self._reserve_gone or self._ssd_full_until > time.monotonic()

    def reserve_given_up(self) -> None:
        """The reserve file is gone (released for a commit, or not makeable at mount)."""
        self._reserve_gone = True

    def check_room(self) -> None:
        """Every commit interval while the reserve file is gone: make it again, or shrink
        the pool (clean data evicted; the commit that follows releases its space) until it
        can be made."""
        if not self._reserve_gone:
            return
        if self.store.ensure_reserve():
            self._reserve_gone = False
            log.info("the cache filesystem has room again: the reserve file is back")
        else:
            self._shrink_pool()

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

    def committed(self, batch: tuple) -> None:
        """A batch (MetadataStore.take_batch) is in the database now: what it says of the
        dirt of its extents.
        An extent destaged and evicted before the database learned it was clean is still
        dirty there (`db_dirty_evicted`) until a commit drops its row: a write around the
        cache over it waits for that commit (writepath), or, with commits failing and an
        unclean stop, recovery would destage the cache file's older bytes over it."""
        for key, rec in batch[2].items():
            dirty = rec is not None and bool(rec[1])
            cf = self.files.get(key[0])
            x = cf.extents.get(key[1]) if cf is not None else None
            if x is not None:
                x.db_dirty = dirty
            if x is not None or not dirty:      # (a record taken before an eviction that
                self.db_dirty_evicted.discard(key)      # came during the commit: still)

    def flush_log(self) -> None:
        """At unmount: the counts of lines held back (RateLimitedLog)."""
        self._limited.flush()

    def space_released(self) -> None:
        """Evicted space was released (the reserve file is back): try the SSD again."""
        self._ssd_full_until = 0.0
        self._reserve_gone = False

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
            self.evict(self.files[x.ino], x)
            n += 1
        self.stats.drop_capacity += n
        self._limited.warning("shrunk", "cache filesystem full: pool shrunk to %s, %d clean "
                              "extents evicted (reason: capacity)",
                              format_size(self.capacity_exts * EXT_SIZE), n)

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

    def drop_clean(self) -> int:
        """Evict every clean extent not protected (pinned or being prefetched; cachefs-ctl
        drop); returns how many."""
        n = 0
        held = 0
        protected = self.pool.protected
        for cf in list(self.files.values()):
            if cf.ino in protected:
                if cf.held is not None:
                    held += len(cf.extents)
                continue
            cf.clobber(0, 1 << 62)
            for x in list(cf.extents.values()):
                if not x.dirty:
                    self.evict(cf, x)
                    n += 1
        self.stats.drop_operator += n
        self.stats.drop_skipped_passthrough += held
        log.info("dropped %d clean cached extents (reason: operator, cachefs-ctl drop)%s", n,
                 f"; kept {held} extents of files in passthrough (the kernel reads them)"
                 if held else "")
        return n

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
            **lost_blocks(self.map.bad),
        }
