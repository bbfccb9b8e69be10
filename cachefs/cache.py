"""The engine façade: wires the engine's parts and is what `fs`, `warm` and `mount` call.

Owns the wiring (state, coherence, read path, write path, destager, persister), open,
create and release of files, the write-back unlink intent, and the extent state changes of
a destage pass (the schedule is `writeback.Destager`'s). Never imports pyfuse3: `fs.py`
translates requests into calls here. Imports flow one way (docs/architecture.md): this
module imports the parts, the parts never import it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from typing import Awaitable, Callable, TypeVar

from . import aio
from . import backingpaths as bp
from .backing import Backing
from .coherence import Coherence
from .config import Config
from .extents import BLK_SHIFT, BLKS_PER_EXT, EXT_SHIFT, KEEP_ATIME, CachedFile, Extent
from .integrity import recheck
from .hit import OpenFile
from .namespace import Namespace
from .readpath import ReadPath
from .state import ABANDONED, UNLINKING, CacheState
from .stats import Stats
from .store import MetadataStore
from .writeback import Destager, plan_destage
from .openmode import OpenModes
from .mounttable import noatime
from .statx import birth_ns, dio_align
from .writepath import WritePath

log = logging.getLogger("cachefs.cache")

T = TypeVar("T")
# O_APPEND: the kernel passes the offset; O_DIRECT: Python buffers are not aligned;
# O_TRUNC: truncation goes through the engine, which must drop cached (and dirty) data.
_FLAGS_NOT_FOR_BACKING = (os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_APPEND | os.O_TRUNC
                          | getattr(os, "O_DIRECT", 0))


class Cache:
    def __init__(self, cfg: Config, store: MetadataStore, backing: Backing, stats: Stats,
                 capacity_exts: int):
        self.state = state = CacheState(cfg, store, backing, stats, capacity_exts)
        self.coherence = Coherence(state)
        self.reads = ReadPath(state)
        self.destager = Destager(self, backing, cfg, stats)
        self.writes = WritePath(state, self.coherence, self.destager)
        self.modes = OpenModes(state, self.writes, cfg)     # how opens are answered
        self.namespace = Namespace(backing, cfg.attr_timeout_s)   # BACKING's namespace, for fs
        self.pins = None                 # the listener of unlinks and renames (name_listener)
        # the objects the parts share (never rebound)
        self.cfg, self.store, self.backing, self.stats = cfg, store, backing, stats
        self.write_back = state.write_back
        self.mounted_at: str | None = None      # the mount's real path, once mounted
        self._noatime = (False, 0.0)            # (the mount is noatime, when looked at)
        # Write-through opens get an O_DIRECT twin for AIO (aio.py) where BACKING is a FUSE or
        # network mount, whose direct writes the kernel serialises per file; on a local
        # filesystem buffered writes are what a plain directory does, and the twin would
        # send each aligned write to the disk.
        self._direct_twins = not self.write_back and not backing.inline
        self.files, self.pool, self.dirty = state.files, state.pool, state.dirty
        self.cachefiles, self.persister = state.cachefiles, state.persister
        self.stale_inodes = self.coherence.stale_inodes
        # the API of the parts, called directly (bound methods: no extra call per request)
        self.read_miss = self.reads.read_miss
        self.read_damaged = self.reads.read_damaged
        self.run_promoter = self.reads.run_promoter
        self.run_readahead = self.reads.run_readahead
        self.write = self.writes.write
        self.truncate = self.writes.truncate
        self.fallocate = self.writes.fallocate
        self.seek = self.writes.seek
        self.fsync = self.writes.fsync
        self.stat_token = self.coherence.stat_token
        self.revalidate = self.coherence.revalidate
        self.attributes_seen = self.coherence.attributes_seen
        self.own_metadata_change = self.coherence.own_metadata_change
        self.logical_size = self.coherence.logical_size
        self.overtaken = self.coherence.overtaken
        for name in ("load", "forget", "drop_file", "drop_clean", "install_wanted", "status",
                     "shown_ctime",
                     "used_bytes", "cache_path", "file_lock", "dirty_bytes",
                     "oldest_dirty_age_s", "ssd_full"):
            setattr(self, name, getattr(state, name))

    @property
    def capacity_exts(self) -> int:
        return self.state.capacity_exts

    def name_listener(self, listener) -> None:
        """Tell `listener` (warm.Warm) of unlinks and renames of BACKING files."""
        self.pins = listener

    def needs_unlink_guard(self, ino: int | None) -> bool:
        """Write-back: the file has cached data, or is open (its data may come after the
        unlink, written through a descriptor still open: found by the kill -9 rounds)."""
        cf = self.files.get(ino) if ino is not None else None
        return self.write_back and cf is not None and bool(cf.extents or cf.open_count)

    async def unlink_guarded(self, ino: int | None, unlink: Callable[[], Awaitable[T]]) -> T:
        """Run `unlink`, which removes the last BACKING name of inode `ino`.

        Write-back, with cached data (or open): first a durable intent (and the identity), so
        that after a crash mid-way the data is never taken for a new file that reuses the
        inode number (recovery in load()); the intent goes in the batch that drops the
        file. The destager is kept out meanwhile, so the identity stays as recorded."""
        if not self.needs_unlink_guard(ino):
            return await unlink()
        cf = self.files[ino]
        key = UNLINKING + str(cf.ino)
        async with self.state.file_lock(cf):
            self.state.persist_identity(cf)
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

    def renamed(self, ino: int, new_path: bytes) -> None:
        if self.pins is not None:
            self.pins.renamed(ino, new_path)
        cf = self.files.get(ino)
        if cf is not None:              # its path: for destaging, copy-backs, warming, loads
            cf.path = new_path
            self.state.persist_identity(cf)

    def backing_changed(self, ino: int) -> None:
        """cachefs changed BACKING's file itself (its attributes): the next write-back fsync
        syncs BACKING's file too (WritePath.fsync)."""
        cf = self.files.get(ino)
        if cf is not None:
            cf.backing_unsynced = True

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
            self.state.discard(cf)

    def noatime(self) -> bool:
        """The mount has the kernel's noatime flag (`-o noatime`; a remount changes it):
        reads through it move no atime, BACKING's included. Looked up at most once a
        second (/proc/self/mountinfo)."""
        flag, when = self._noatime
        now = time.monotonic()
        if now - when >= 1.0 and self.mounted_at is not None:
            flag = noatime(self.mounted_at)
            self._noatime = (flag, now)
        return flag

    async def open(self, fh: int, ino: int, path: bytes, flags: int, named: bool = True
                   ) -> tuple[OpenFile, bool]:
        """Open BACKING, revalidate cached data; returns the handle and whether the kernel may
        keep its page cache for the file. `named` False: `path` is a /proc/self/fd link of
        the file (no name of it is known), not a path hint to keep."""
        bflags = (flags & ~_FLAGS_NOT_FOR_BACKING) | os.O_CLOEXEC
        if flags & os.O_ACCMODE != os.O_WRONLY and self.noatime():
            bflags |= os.O_NOATIME      # misses read BACKING: no atime moves there either
        token = self.coherence.stat_token(ino)
        before = self.files.get(ino)
        want_direct = self._direct_twins and flags & os.O_ACCMODE != os.O_RDONLY
        readable = True
        opened = None
        birth = self.write_back and flags & os.O_ACCMODE != os.O_RDONLY
        if self.write_back and flags & os.O_ACCMODE == os.O_WRONLY:
            # A sub-block write-back write into a block not cached reads BACKING's bytes
            # of that block: open BACKING read-write if BACKING lets us (else such writes
            # go around the cache, see _write_around).
            try:
                opened = await self.backing.read_call(
                    "open", _open_fstat, self.backing.root_fd, path,
                    (bflags & ~os.O_ACCMODE) | os.O_RDWR, False, True)
            except PermissionError:
                readable = False
        if opened is None:
            opened = await self.backing.read_call("open", _open_fstat, self.backing.root_fd,
                                                  path, bflags, want_direct, birth)
        fd, st, dfd, born = opened
        now = self.files.get(ino)
        if st.st_ino != ino or (now is not before and before is not None) or \
                not st.st_nlink and (now is None or not now.doomed) and (named or self.write_back):
            # The name led to another file by the time BACKING opened it (a rename over it
            # in flight, here or on another host), or the file lost its last name meanwhile
            # and its cached data (its newest bytes, in write-back) went with it: ESTALE
            # makes the kernel look the name up again and retry the open, instead of this
            # inode's handle (its O_TRUNC, its writes, its destage) reaching that other
            # file, or reading what is left of a removed one. (A write-through reopen
            # through a descriptor of a removed file reads BACKING's, which has every byte.)
            os.close(fd)
            if dfd >= 0:
                os.close(dfd)
            raise OSError(errno.ESTALE, "the file was replaced meanwhile")
        dio = (0, 0)
        if flags & os.O_DIRECT and flags & os.O_ACCMODE == os.O_RDONLY and self.modes.enabled:
            # how strict BACKING is about O_DIRECT alignment (openmode: may such an open
            # read the cache file with O_DIRECT?)
            dio = await self.backing.read_call("open", dio_align, fd)
        cf = self.state.file_for(ino, st)
        if born:
            self.coherence.born(cf, born, st)
        if not st.st_nlink:
            cf.doomed = True            # no name: its data goes at the last release
        known = cf.identity
        unchanged = self.coherence.revalidate(cf, st, token)
        if not unchanged and known is not None and cf.identity != known:
            cf.attrs_stale = True       # changed behind us: the kernel's size is old too
        if cf.kernel_stale:             # a lookup just before found the change: the kernel
            cf.kernel_stale = False     # must drop its pages in this open, not later
            unchanged = False
        if named:
            cf.path = path
        cf.open_count += 1
        cf.open_st = st
        if flags & os.O_TRUNC:
            # Linux truncates at O_RDONLY | O_TRUNC too (the kernel checked write permission):
            # by path then, the descriptor being read-only.
            writable = flags & os.O_ACCMODE != os.O_RDONLY
            try:
                await self.writes.truncate(ino, 0, path, fd if writable or not path else None)
            except BaseException:
                cf.open_count -= 1
                os.close(fd)
                if dfd >= 0:
                    os.close(dfd)
                raise
            unchanged = False
        due = (_atime_due(cf, st) if flags & os.O_ACCMODE != os.O_WRONLY
               and not flags & os.O_NOATIME else None)
        if due is not None and self.noatime():
            due = None
        if due is not None:
            # Reads the cache answers never reach BACKING: BACKING reads a block, so that
            # it moves the atime by its own rules (relatime: mail readers, tmpwatch and
            # find -atime go by it), once per change of the file.
            cf.atime_read = due
            if self.write_back and cf.dirty_exts and cf.times is not None \
                    and cf.times[1] > st.st_mtime_ns:
                # BACKING's relatime goes by its own mtime, older than the write's (not yet
                # destaged): the destage sets the atime of this read with the mtime.
                self.state.set_times(cf, (due[2], cf.times[1]))
            else:
                try:
                    # (a byte is enough; on a local BACKING whose page cache has it, on
                    # the loop: git reads back every file it just wrote)
                    await self.backing.pread(fd, 1, 0)
                except OSError as exc:
                    log.debug("inode %d: the read for its atime failed: %s", ino, exc)
                else:
                    self.atime_set(ino)     # BACKING's atime is newer than any set before
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
                self.state.cache_file_unusable(cf, exc)
        of = OpenFile(fh, cf, fd, flags, self.stats)
        of.direct_fd = dfd
        of.readable = readable
        of.dio_align = dio
        return of, unchanged

    async def create(self, fh: int, path: bytes, flags: int, mode: int, uid: int, gid: int,
                     umask: int, parent: bytes, remember: Callable[[os.stat_result], int]
                     ) -> tuple[OpenFile, os.stat_result]:
        """Create and open a BACKING file owned by uid/gid; `remember` names its inode."""
        bflags = (flags & ~_FLAGS_NOT_FOR_BACKING) | (flags & os.O_EXCL) | os.O_CLOEXEC
        readable = flags & os.O_ACCMODE != os.O_WRONLY
        opened = None
        if self.write_back and not readable:
            try:                # as in open(): fills of sub-block writes read through it
                opened = await self.backing.write_call(
                    _create_twin, self.backing.root_fd, path,
                    (bflags & ~os.O_ACCMODE) | os.O_RDWR, mode, uid, gid, parent, umask,
                    False, True)
                readable = True
            except PermissionError:
                pass
        if opened is None:          # write-through: the O_DIRECT twin in the same thread call
            opened = await self.backing.write_call(
                _create_twin, self.backing.root_fd, path, bflags, mode, uid, gid, parent,
                umask, self._direct_twins, self.write_back)
        fd, st, dfd, born = opened
        ino = remember(st)
        cf = self.state.file_for(ino)
        if born:
            self.coherence.born(cf, born, st)
        self.coherence.revalidate(cf, st)
        cf.path = path
        cf.backing_unsynced = True      # write-back: its first fsync makes BACKING's file durable
        cf.open_count += 1
        if flags & os.O_TRUNC and (st.st_size or cf.size):     # it existed: truncate it
            writable = flags & os.O_ACCMODE != os.O_RDONLY      # (else by path, as in open)
            try:
                st = await self.writes.truncate(ino, 0, path, fd if writable else None)
            except BaseException:
                cf.open_count -= 1
                os.close(fd)
                if dfd >= 0:
                    os.close(dfd)
                raise
        of = OpenFile(fh, cf, fd, flags, self.stats)
        of.readable = readable
        of.direct_fd = dfd
        return of, st

    def release(self, of: OpenFile) -> list[int]:
        """Drop a handle; returns the BACKING fds for the caller to close in a thread."""
        cf = of.cfile
        cf.open_count -= 1
        if not cf.open_count:
            cf.open_st = None
        if cf.doomed and cf.open_count == 0 and self.files.get(cf.ino) is cf:
            self.state.discard(cf)
        self.cachefiles.close_idle(cf)
        return [of.backing_fd] if of.direct_fd < 0 else [of.backing_fd, of.direct_fd]

    def destage_plan(self, cf: CachedFile, max_bytes: int, start_ext: int = 0
                     ) -> tuple[list[tuple[Extent, int]], list[tuple[int, int]]]:
        """The next destage pass of a file (writeback.plan_destage); from now until
        destage_done/destage_failed, BACKING changes under our own hand."""
        plan = plan_destage(cf, max_bytes, start_ext)
        cf.writes_inflight += 1
        return plan

    def destage_abandoned(self, cf: CachedFile) -> None:
        """The unmount left a destage pass of `cf` to its thread, which may still write
        BACKING's file after the last commit (CacheState.load)."""
        self.store.queue_meta(f"{ABANDONED}{cf.ino}", "1")

    def destage_failed(self, cf: CachedFile, st: os.stat_result | None = None) -> None:
        """The pass failed; `st`: BACKING's stat after it (part of it may be there)."""
        cf.writes_inflight -= 1
        if st is not None:
            self.coherence.own_change(cf, st, size_exact=False)

    def destage_done(self, cf: CachedFile, plan: list[tuple[Extent, int]],
                     st: os.stat_result, snapshot_s: float) -> None:
        """BACKING has the snapshot (taken at `snapshot_s`) durably: blocks not rewritten
        since turn clean; what stays dirty was written after the snapshot, and ages from it."""
        cf.writes_inflight -= 1
        shown = None                    # the ctime programs saw before this pass
        if cf.identity is not None:
            shown = self.state.shown_ctime(cf.ino, cf.identity[3])
            if cf.times is not None:
                shown = max(shown, cf.times[1])
        still = []
        for x, snap in plan:
            if cf.extents.get(x.ext) is not x:
                continue                         # truncated or dropped meanwhile
            self.state.map.clean(cf, x, snap & ~x.redirty & ~x.bad)
            if x.dirty:
                still.append(x.key)
        if still:
            self.dirty.restamp(still, snapshot_s)
        if not cf.dirty_exts and cf.times is not None:
            self.state.set_times(cf, None)          # BACKING has the data and the times
        if not cf.dirty_exts and cf.caps is not None:
            self.state.set_caps(cf, None)           # and its capability
        self.coherence.own_change(cf, st, size_exact=False)
        if shown is not None:
            self.state.mask_ctime(cf.ino, st.st_ctime_ns, shown)
        if len(self.pool) > self.state.capacity_exts:
            # More than the pool's size: dirty data a mount with a smaller --cache-size
            # found (kept: BACKING had none of it). Clean now, what is over the size goes
            # (it stayed for the whole mount: a helper's hunt).
            self.state.make_room(0)

    @contextlib.contextmanager
    def changing(self, *inos: int | None):
        """Held around an attribute change of ours (rename, chmod, utime, link) from before
        BACKING makes it until its stat is recorded (own_metadata_change): an open or a
        getattr that stats BACKING meanwhile sees a new ctime that is no change behind us."""
        held = [cf for cf in map(self.files.get, inos) if cf is not None]
        for cf in held:
            cf.meta_inflight += 1
        try:
            yield
        finally:
            for cf in held:
                cf.meta_inflight -= 1

    def destage_guard(self, ino: int, needed: bool):
        """Held around a change BACKING takes at once that a destage pass would undo (times
        set by utime, whose data write and utime put the last write's time back; a
        capability, which its data write drops); `needed`: the change is such a one.
        Write-back, a file with dirty data: its lock, so that the change does not reach
        BACKING during a pass; before or after one, times_set / caps_set keep it for the
        next pass, or BACKING holds it."""
        cf = self.files.get(ino)
        if needed and self.write_back and cf is not None and cf.dirty_exts:
            return self.state.file_lock(cf)
        return contextlib.nullcontext()

    def times_set(self, ino: int, st) -> None:
        """BACKING just took explicit times (`st`, its stat after them): write-back writes
        from now on get no older mtime (CacheState.written_now); for a file with dirty data
        destaging the data would replace its mtime, so each destage pass puts these back."""
        if st is not None and st.st_mtime_ns > self.state.mtime_floor:
            self.state.mtime_floor = st.st_mtime_ns     # later writes' mtimes: not before
        cf = self.files.get(ino)
        if self.write_back and cf is not None and cf.dirty_exts and st is not None:
            self.state.set_times(cf, (st.st_atime_ns, st.st_mtime_ns))

    def caps_set(self, ino: int, value: bytes | None) -> bool:
        """Write-back: security.capability was set (or removed: None) through the mount
        after the file's last write. BACKING holds it now, but the destage's write of that
        earlier data drops it there, as any write does: the destage puts it back (a
        helper's hunt: cp + setcap, tar --xattrs and rsync -X lost every capability).
        True if it is to be put back (the caller makes that durable)."""
        cf = self.files.get(ino)
        if not self.write_back or cf is None:
            return False
        self.state.set_caps(cf, value if cf.dirty_exts else None)
        return cf.caps is not None

    def caps_dropped(self, cf: CachedFile) -> None:
        """A write or truncate through the mount dropped the file's capability."""
        if cf.caps is not None:
            self.state.set_caps(cf, None)

    def atime_set(self, ino: int) -> None:
        """Write-back: BACKING just took a new atime (touch -a, a read) for a file with dirty
        data: a destage pass must no longer put back an atime set explicitly before."""
        cf = self.files.get(ino)
        if self.write_back and cf is not None and cf.times is not None \
                and cf.times[0] != KEEP_ATIME:
            self.state.set_times(cf, (KEEP_ATIME, cf.times[1]))

    def damaged(self, cf: CachedFile, offsets: list[int], where: str) -> int:
        """Blocks at `offsets` failed their checksums when a thread read them: those still
        as they were (not rewritten, truncated or dropped since) and failing again now are
        damage (integrity.Reports.found); returns how many of them are dirty."""
        masks: dict[int, int] = {}
        for off in offsets:
            e = off >> EXT_SHIFT
            masks[e] = masks.get(e, 0) | 1 << ((off >> BLK_SHIFT) & (BLKS_PER_EXT - 1))
        bad = []
        for e, m in masks.items():
            x = cf.extents.get(e)
            if x is not None and m & ~x.redirty:
                m = recheck(cf.cache_fd, self.state.cache_path(cf.ino), x, m & ~x.redirty)
                if m:
                    bad.append((x, m))
        return self.state.damage.found(cf, bad, where) if bad else 0

    def cache_reader(self, cf: CachedFile) -> int:
        """A descriptor of `cf`'s cache file for a destage pass to read in a thread, its to
        close: a dup of the one open (a close meanwhile cannot give its number to another
        file), so the file the map speaks of, also when its name went behind the daemon.
        Opened by name, a removed cache file failed every pass for good (ENOENT); now
        CacheFiles.fd tells CacheState.cache_file_made, which marks its blocks lost."""
        fd = os.dup(self.cachefiles.fd(cf))
        self.cachefiles.close_idle(cf)
        return fd

    def damaged_dirty_blocks(self) -> int:
        return sum(bin(cf.extents[e].bad).count("1") for (_, e), cf in self.state.map.bad.items()
                   if e in cf.extents)

    def set_wb_fd(self, cf: CachedFile, fd: int) -> None:
        cf.wb_fd = fd

    def take_idle_wb_fd(self, cf: CachedFile) -> int:
        """The destager's BACKING fd of a file that is clean and closed, or that the engine
        let go of during the pass, to close; or -1."""
        if cf.wb_fd < 0 or self.files.get(cf.ino) is cf and (cf.dirty_exts or cf.open_count):
            return -1
        fd, cf.wb_fd = cf.wb_fd, -1
        return fd

    def discard_orphan(self, cf: CachedFile) -> None:
        """Dirty data of a file BACKING no longer has (removed while we were down)."""
        self.state.orphaned(cf, "no longer exists (or another file has its number now)")

    def file_state(self, ino: int) -> CachedFile:
        """The cache state of inode `ino`, made if needed (revalidate it before use)."""
        return self.state.file_for(ino)

    def reserve(self, n: int) -> bool:
        """Evict unprotected clean extents until `n` more fit; False if the rest of the pool
        is dirty or protected (pinned, being prefetched)."""
        return self.state.make_room(n)

    async def persist(self, durable: bool = False) -> None:
        """Make everything changed so far durable on the SSD (Persister.persist)."""
        await self.persister.persist(durable)


def _create_twin(root: int, path: bytes, flags: int, mode: int, uid: int, gid: int,
                 parent: bytes, umask: int, want_direct: bool, birth: bool = False
                 ) -> tuple[int, os.stat_result, int, int]:
    """bp.create, the O_DIRECT twin if `want_direct`, the birth time (0) if `birth`."""
    fd, st = bp.create(root, path, flags, mode, uid, gid, parent, umask)
    try:
        return (fd, st, aio.open_direct(fd) if want_direct else -1,
                birth_ns(fd) if birth else 0)
    except BaseException:
        os.close(fd)
        raise


def _open_fstat(root: int, path: bytes, flags: int, want_direct: bool, birth: bool = False
                ) -> tuple[int, os.stat_result, int, int]:
    """The open, its fstat, the O_DIRECT twin if `want_direct`, the birth time (0) if
    `birth` (write-back: the file may turn dirty through it, CacheState.persist_birth)."""
    try:
        fd = bp.open_at(root, path, flags)
    except PermissionError:
        if not flags & os.O_NOATIME:
            raise
        fd = bp.open_at(root, path, flags & ~os.O_NOATIME)   # not the file's owner: as is
    try:
        return (fd, os.fstat(fd), aio.open_direct(fd) if want_direct else -1,
                birth_ns(fd) if birth else 0)
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


DAY_NS = 86_400 * 10**9


def _atime_due(cf: CachedFile, st) -> tuple[int, int, int] | None:
    """(mtime, ctime, now) if a read would move the atime under relatime (an atime not
    after the mtime or ctime, or a day old), else None. The mtime a write-back write gave
    the file counts (BACKING gets it later). Once per (mtime, ctime) and day: on a BACKING
    mounted noatime the read changes nothing."""
    now = time.time_ns()
    mtime = max(st.st_mtime_ns, cf.times[1] if cf.times else 0)
    last = cf.atime_read
    if last is not None and last[:2] == (mtime, st.st_ctime_ns) and now - last[2] < DAY_NS:
        return None
    atime = st.st_atime_ns
    if atime <= mtime or atime <= st.st_ctime_ns or now - atime >= DAY_NS:
        return mtime, st.st_ctime_ns, now
    return None

