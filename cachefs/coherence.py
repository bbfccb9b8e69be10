"""Coherence with BACKING: is cached data still BACKING's, and which changes are our own.

Owns `Coherence`: the identity comparison on open and attribute revalidation (`revalidate`,
`_conflict` when dirty data meets a change behind us), the merging of our own changes'
stats (`own_change`, `own_metadata_change`, `older`), the stat tokens that let a stat
overtaken by our own change be ignored (`change_seq`), and the channel of stale inodes that
`fs` reads to invalidate the kernel's cache (`stale_inodes`).
"""

from __future__ import annotations

import logging
import os
import time

import trio

from .extents import BLK_SHIFT, EXT_SHIFT, FULL_MASK, CachedFile, identity, racy
from .state import CacheState

log = logging.getLogger("cachefs.cache")


def older(a: tuple[int, int, int, int], b: tuple[int, int, int, int],
          size_counts: bool = True) -> bool:
    """True if identity `a` was taken before `b`: by ctime, then mtime (a file's timestamps
    never go back); within one timestamp tick, by size if `size_counts` (writes never shrink
    a file; a truncate's own stat is taken as the newer one)."""
    if (a[3], a[2]) != (b[3], b[2]):
        return (a[3], a[2]) < (b[3], b[2])
    return size_counts and a[1] < b[1]


class Coherence:
    def __init__(self, state: CacheState):
        self._s = state
        self.files = state.files
        self.stats = state.stats
        self.store = state.store
        self.change_seq = 0                      # bumped by every change cachefs makes
        # inodes whose data changed behind us: fs.Operations.run_invalidator reads them
        self._stale_send, self.stale_inodes = trio.open_memory_channel(1024)

    def stat_token(self, ino: int | None) -> tuple:
        """Taken before a BACKING stat: lets revalidate() ignore a stat that our own change
        overtook while it was in flight (its attributes would look like a change behind us)."""
        if ino is None:
            return (None, self.change_seq)
        cf = self.files.get(ino)
        return (cf, cf.change_seq if cf is not None else 0)

    def overtaken(self, cf: CachedFile, token: tuple | None) -> bool:
        """An own change of `cf` ended since `token` was taken (before a BACKING stat):
        that stat may show BACKING in the middle of it."""
        return self._overtaken(cf, token)

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
            cf.recovered = False        # BACKING's file is as last committed
            if cf.racy and not racy(ident, time.time_ns()):
                cf.racy = False
                if (cf.extents or cf.fills) and not cf.dirty_exts and not (
                        cf.writes_inflight or cf.meta_inflight):
                    self._drop_stale(cf, st, "was cached within the second of its last "
                                     "change, and BACKING keeps whole seconds: a rewrite "
                                     "later in that second would not show")
                    return False
            return True
        if cf.identity is None:
            cf.identity = ident
            cf.size = st.st_size
            return False
        if cf.writes_inflight or cf.meta_inflight or self._overtaken(cf, token):
            return True                 # our own change is in flight or overtook the stat
        if cf.ctime_pending and ident[:3] == cf.identity[:3]:
            # Our own metadata change (the unlink of another hard link) moved only the ctime;
            # a stat taken before it and seen after it is overtaken by it.
            cf.ctime_pending = False
            cf.change_seq += 1
            self.change_seq += 1
            cf.identity = ident
            self._s.persist_identity(cf)
            return True
        if cf.held is not None:     # write-back: what a shared mapping wrote wins
            self._s.mapping_wins(cf, "a change of BACKING")
        if cf.dirty_exts:
            self._conflict(cf, ident)
            cf.identity = ident
            # BACKING's file with the dirty blocks over it: its size, or as far as they go.
            # (The old size stayed: a file BACKING shrank showed its old length, with zeros
            # where the dropped clean data had been, until a destage cut it: a helper's hunt.)
            cf.size = max(st.st_size, _dirty_end(cf))
            self._s.persist_identity(cf)
            return False
        if cf.identity is not None and (cf.extents or cf.fills) and cf.recovered:
            # As for dirty files (_conflict): after an unclean stop, cachefs's own writes
            # since the last commit moved BACKING's identity too (they were all called
            # outside changes, reason coherence: a helper's hunt).
            self._drop_stale(cf, st, f"changed since the last commit before an unclean stop "
                             f"(cachefs's own writes then, or another's: size, mtime, ctime "
                             f"{cf.identity[1:]} -> {ident[1:]})", reason="recovery")
        elif cf.identity is not None and (cf.extents or cf.fills):
            self._drop_stale(cf, st, f"changed behind the cache (size, mtime, ctime "
                             f"{cf.identity[1:]} -> {ident[1:]})")
        cf.identity = ident
        cf.size = st.st_size
        cf.recovered = False
        if cf.extents:                  # kept in place (a held file): the new identity
            self._s.persist_identity(cf)    # with its blocks, all invalid now
        return False

    def born(self, cf: CachedFile, birth: int, st: os.stat_result) -> None:
        """An open found BACKING's file (`st`) with birth time `birth`. Another one than
        recorded: the file of the cached data was deleted and this one got its number; the
        data goes first, so that nothing of it reaches or shows in this file."""
        if cf.birth and cf.birth != birth and (cf.extents or cf.fills):
            if cf.dirty_exts:
                self._s.orphaned(cf, "was replaced by another file with its number")
            else:
                self._drop_stale(cf, st, "is another file now (another birth time)")
        cf.birth = birth

    def _drop_stale(self, cf: CachedFile, st: os.stat_result, why: str,
                    reason: str = "coherence") -> None:
        """The cached data of `cf` may be older than BACKING's file (`why`): it goes;
        `reason` recovery: found so after an unclean stop (not counted as stale)."""
        if reason == "recovery":
            self.stats.drop_recovery += len(cf.extents)
        else:
            self.stats.stale_files += 1
            self.stats.drop_coherence += len(cf.extents)
        in_place = cf.held is not None and cf.held.current and not cf.doomed
        log.info("BACKING inode %d %s; dropping %d cached extents (reason: %s)%s",
                 cf.ino, why, len(cf.extents), reason,
                 "; the kernel reads its cache file in passthrough: read again from "
                 "BACKING before the next open" if in_place else "")
        if in_place:
            self._s.stale_in_place(cf, st.st_size)
        else:
            self._s.drop_file(cf)

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
            self.stats.stale_files += 1         # changed behind the cache, as any other
            self.stats.drop_coherence += clean
            log.warning("conflict: BACKING inode %d (%s) changed behind the cache (size, "
                        "mtime, ctime %s -> %s) while %d extents hold dirty data; the dirty "
                        "data will overwrite it; dropping %d clean extents (reason: "
                        "coherence)", cf.ino, os.fsdecode(cf.path or b"?"), cf.identity[1:],
                        ident[1:], cf.dirty_exts, clean)
        cf.clobber(0, 1 << 62)
        for x in list(cf.extents.values()):
            if not x.dirty and cf.held is None:
                self._s.map.remove(cf, x)
            elif not x.dirty:           # in passthrough: no hole under the kernel's reads
                self._s.map.invalidate(cf, x, FULL_MASK)
            elif x.valid != x.dirty:
                self._s.map.invalidate(cf, x, FULL_MASK)

    def own_change(self, cf: CachedFile, st: os.stat_result, size_exact: bool) -> None:
        """Record BACKING's identity after a change made by cachefs itself.

        Own operations on one file overlap (several writes in flight) and their results
        arrive in any order, so a stat taken earlier may be processed later: the recorded
        identity only moves forward, to the stat with the latest (ctime, mtime, size). The
        latest stat was taken after every completed own operation, so once none is in
        flight the recorded identity is BACKING's state after all of them."""
        cf.change_seq += 1
        self.change_seq += 1
        ident = identity(st)
        if cf.identity is not None and cf.identity[0] == ident[0] and older(
                ident, cf.identity, size_counts=not size_exact):
            return                      # a later state of ours is known already
        cf.identity = ident
        if size_exact:
            cf.size = st.st_size
        elif cf.writes_inflight or cf.dirty_exts:
            cf.size = max(cf.size, st.st_size)
        else:
            cf.size = st.st_size
        self._s.persist_identity(cf)

    def logical_size(self, ino: int, backing_size: int, token: tuple | None = None) -> int:
        """The size programs see: BACKING's, or the engine's while extending writes are dirty
        or a write-back truncate that shrank the file has not cut BACKING yet (`cutting`:
        BACKING may be shorter than the new size then, its data past it was dirty), or when
        an own change overtook the stat that gave `backing_size` (`token`, taken before it:
        a truncate that ended meanwhile left that size stale, and the kernel kept it)."""
        cf = self.files.get(ino)
        if cf is None:
            return backing_size
        size = backing_size
        if cf.dirty_exts or cf.cutting or (token is not None and self._overtaken(cf, token)):
            size = cf.size
        if cf.extending and size > cf.shown_size:   # writes past the end not answered yet
            return cf.shown_size                    # (WritePath.write)
        return size

    def attributes_seen(self, ino: int, st: os.stat_result, token: tuple) -> None:
        """getattr/lookup saw BACKING's attributes: revalidate, invalidate the kernel cache."""
        cf = self.files.get(ino)
        if cf is not None and not self.revalidate(cf, st, token):
            self.kernel_stale(cf)

    def kernel_stale(self, cf: CachedFile) -> None:
        """The kernel's pages of `cf` may hold bytes that are no longer the file's: dropped
        now (fs.run_invalidator), and by the next open."""
        cf.kernel_stale = True
        try:
            self._stale_send.send_nowait(cf.ino)
        except trio.WouldBlock:
            log.warning("kernel invalidation queue full; inode %d may be cached until "
                        "its attribute timeout", cf.ino)

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
            self.own_change(cf, st, size_exact=False)
        elif ident[0] == cf.identity[0] and ident[1] == cf.identity[1] and (
                times_set or ident[2] == cf.identity[2]):
            cf.change_seq += 1
            self.change_seq += 1
            cf.identity = ident
            self._s.persist_identity(cf)


def _dirty_end(cf: CachedFile) -> int:
    """Where the file's dirty blocks end (at most its size)."""
    end = 0
    for x in cf.extents.values():
        if x.dirty:
            end = max(end, (x.ext << EXT_SHIFT) + (x.dirty.bit_length() << BLK_SHIFT))
    return min(end, cf.size)
