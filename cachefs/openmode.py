"""How each open is answered, and what an open served by FUSE passthrough holds.

Owns `OpenModes` (the one place that chooses an open's mode) and `Held` (per inode whose
cache file the kernel may read by itself). The open path passes through `answer` once,
and the release path through `release`; nothing else decides a mode.

The kernel's rules (Linux >= 6.9, measured on 6.18; docs/architecture.md "FUSE
passthrough"):
- while an inode has a passthrough open, any other open of it must be a passthrough open
  with the same backing id, or open(2) fails with EIO; while it has a page-cache open, a
  passthrough open fails with EIO;
- a passthrough open with direct_io sends its reads and writes to the daemon, but its mmap
  maps the backing file;
- a mapping outlives its open: after the release, it still reads (and, if shared and
  writable, writes) the backing file.

The modes, in the order they are chosen:
- PASSTHROUGH: an O_RDONLY open of a file whose every block is valid in the cache (clean,
  or dirty in write-back: the cache file then holds the newest bytes), when the inode has
  no open but passthrough ones on the same cache file. The kernel reads the cache file;
  no read reaches cachefs.
- JOINED (passthrough + direct_io): any other open of an inode that has passthrough opens
  (writers, a file no longer fully valid, a cache file replaced). Its reads and writes
  reach cachefs, so no open ever fails and no write(2) bypasses the engine.
- CACHED / DIRECT: as without passthrough (the page cache, keep_cache when unchanged;
  direct_io for O_DIRECT).

What a held file gets (the kernel may read its cache file: passthrough opens, or mappings
that outlive them), from the engine:
- its extents are protected: eviction and `drop` skip them (drop says so);
- every write reaches the cache file at once, in BACKING's order (writepath: `held`);
- data that must go (an unlinked file, an SSD error) is detached (the cache file unlinked,
  its bytes left to whoever holds it) rather than punched or cut; after an outside change
  of BACKING its blocks turn invalid in place, and the next open is answered once they are
  read again (`refresh`: the kernel serves that open's mmap from the same cache file);
- an O_RDWR open with the cache file as backing file could write it through a shared
  mapping: the file's cached blocks are then treated as written (write-back: dirty at the
  open and at the end; write-through: copied to BACKING at the end).
A file stays held until its last passthrough open is released and no process maps it
(/proc/*/maps, checked every HOLD_CHECK_S).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass

import trio

from . import mounttable
from .backing import ABANDON_KW
from .config import EXT_SIZE, format_size
from .extents import CachedFile
from .hit import OpenFile
from .state import CacheState
from .statx import dio_align, fs_type

log = logging.getLogger("cachefs.openmode")

PASSTHROUGH, JOINED, CACHED, DIRECT = "passthrough", "joined", "cached", "direct"
COMPLETE_MAX_BYTES = 256 << 20  # a file missing more is not completed in the background
REFRESH_MAX_BYTES = 1 << 30     # nor, with more to read, refreshed before an open (refresh)
REFRESH_TRIES = 3               # loads overtaken by writes are tried again
HOLD_CHECK_S = 1.0              # how often held files without opens are looked at
MAPS_SCAN_S = 5.0               # a look through /proc/*/maps longer than this: unknown
FUSE_SUPER_MAGIC, OVERLAYFS_SUPER_MAGIC = 0x65735546, 0x794C7630
CAP_SYS_ADMIN = 21


@dataclass(eq=False)
class Held:
    """An inode whose cache file the kernel may read (and, through a shared writable
    mapping of an O_RDWR open, write) without asking cachefs."""
    cf: CachedFile
    backing_id: int = 0         # registered with the kernel while passthrough opens exist
    opens: int = 0              # handles answered PASSTHROUGH or JOINED
    current: bool = True        # the registered file is still the file's cache file
    mapped_writable: bool = False   # an O_RDWR open had it as backing file
    writers: int = 0            # O_RDWR opens answered JOINED (they can map it writable)
    generation: int = 0         # bumped at every open: a check that began before is void
    sync_failed: bool = False   # copying a mapping's writes to BACKING failed (logged once)
    # While mapped_writable (heldwrites.may_be_mapped, sync_back): extent -> (Extent, blocks,
    # their 128-bit digests at the O_RDWR open); the extents the engine changed since
    # (ExtentMap._changed adds them); set once the baseline is taken (opens wait for it).
    baseline: dict | None = None
    voided: set | None = None
    baseline_ready: trio.Event | None = None
    epoch: int = 0              # bumped by every O_RDWR open that takes a new baseline
    refreshing: trio.Event | None = None    # its cache file is being read again (refresh)
    refresh_failed: bool = False            # said once (refresh)
    # Where its cache file stopped growing (block-aligned), or None: the file grew past what
    # the cache may hold for it (heldwrites._room_to_grow); its bytes from here on are only
    # BACKING's, and passthrough opens see the file end here until they are reopened.
    limit: int | None = None


@dataclass
class Answer:
    """How the kernel is to serve one open: fs.py turns it into pyfuse3's FileInfo."""
    fh: int
    direct_io: bool
    keep_cache: bool
    backing_id: int = 0       # the cache file registered for passthrough; 0: none
    durable: bool = False     # the engine's metadata must be durable before the answer
    mappable: Held | None = None    # an O_RDWR open that may map the cache file: answered
    take_baseline: bool = False     # once its baseline is taken (by this open if True)
    refresh: Held | None = None     # answered once what BACKING changed is read again


class Kernel:
    """The binding's passthrough calls, given by fs.py (the only user of pyfuse3): they
    register a cache file as backing file (returns its id) and release an id; they may only
    be called from the open and release handlers."""

    def __init__(self, available: bool, register=None, unregister=None):
        self.available = available
        self.register = register
        self.unregister = unregister


def unavailable_reason(cfg, kernel: Kernel, has_cap=None) -> str | None:
    """Why passthrough cannot be used by this mount (before mounting), or None."""
    if not cfg.passthrough:
        return "turned off (--no-passthrough)"
    if not kernel.available:
        return ("pyfuse3 lacks the passthrough patch (make install, or "
                "deps/passthrough/build.sh, installs it)")
    if not (has_cap if has_cap is not None else _has_cap_sys_admin()):
        return ("the daemon lacks CAP_SYS_ADMIN (in the initial user namespace), which the "
                "kernel requires for it")
    try:
        fd = os.open(cfg.cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            f_type = fs_type(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"cannot statfs the cache directory ({exc.strerror})"
    if f_type in (FUSE_SUPER_MAGIC, OVERLAYFS_SUPER_MAGIC):
        return "the cache directory is on a FUSE or overlay file system"
    return None


class OpenModes:
    def __init__(self, state: CacheState, writes, cfg):
        self._s = state
        self._writes = writes
        self._cfg = cfg
        self.stats = state.stats
        self._kernel = Kernel(False)
        self.reason = unavailable_reason(cfg, self._kernel)   # why it is off; None: wanted
        self.enabled = False                      # negotiated with the kernel (init)
        self.held: dict[int, Held] = {}
        self._plain: dict[int, int] = {}          # ino -> handles answered CACHED/DIRECT
        self._cached: dict[int, int] = {}         # ino -> handles answered CACHED
        # inodes whose page cache may hold bytes older than the file's: written through a
        # joined open (passthrough) or a direct_io one; the next page-cache open drops it
        self._page_cache_stale: set[int] = set()
        self._fuse_dev: tuple[int, int] | None = None
        self._ended = False             # the FUSE session is over (session_ended)
        self._maps = MapsScanner()
        self._cache_dio: tuple[int, int] | None = None   # the cache files' O_DIRECT rules
        self._wake = trio.Event()
        self._debug = log.isEnabledFor(logging.DEBUG)
        self.completer = None       # (ino, path, size): load a file's missing extents (warm)
        self.refresher = None       # async (ino, path, size) -> why not all: the same, now
        self.verifier = None        # (cf): verify a file loaded from an earlier mount (verify)

    def bind(self, kernel: Kernel) -> None:
        """The binding's passthrough calls (fs.py, before the mount)."""
        self._kernel = kernel
        self.reason = unavailable_reason(self._cfg, kernel)

    @property
    def wanted(self) -> bool:
        return self.reason is None

    def negotiated(self, enabled: bool) -> None:
        """The kernel's answer at FUSE init; logs the one line that says how it went."""
        self.enabled = self.wanted and enabled
        if self.enabled:
            log.info("FUSE passthrough: on (read-only opens of fully cached files are served "
                     "by the kernel from the cache files)")
            return
        if self.wanted:
            self.reason = ("the kernel or libfuse did not grant the capability (Linux >= 6.9 "
                           "with FUSE passthrough and libfuse >= 3.17.1 are needed)")
        log.info("FUSE passthrough: off: %s", self.reason)

    def mounted(self, fuse_dev: tuple[int, int] | None) -> None:
        """The mount's device (major, minor), as /proc/*/maps shows its files."""
        self._fuse_dev = fuse_dev

    # -- the open path -----------------------------------------------------------------------

    def answer(self, of: OpenFile, keep_cache: bool) -> Answer:
        """Choose how the kernel serves the open `of` (registered already) and say so."""
        cf = of.cfile
        h = cf.held
        readonly = of.flags & os.O_ACCMODE == os.O_RDONLY
        why = ""
        direct = bool(of.flags & getattr(os, "O_DIRECT", 0))
        if self.enabled:
            if h is not None and h.backing_id:
                if readonly and h.current and self._eligible(cf):
                    return self._passthrough(of, h, PASSTHROUGH, "the file's passthrough opens")
                answer = self._passthrough(of, h, JOINED,
                                           "writable" if not readonly else "not fully cached")
                if self._stale(h):
                    answer.refresh = h
                return answer
            if not readonly:
                why = "writable"
            elif of.flags & os.O_DIRECT and not self._direct_ok(of, cf):
                why = ("O_DIRECT, and BACKING takes direct I/O the cache file would refuse "
                       "(alignment)")
            elif self._plain.get(of.ino):
                why = "other opens use the page cache"
            elif not self._eligible(cf):
                why = "not fully cached"
                self._complete(cf)
            elif not cf.verified and self.verifier is not None:
                why = "cached by an earlier mount, being verified first"
                self.verifier(cf)
            else:
                bid = self._register(cf)
                if bid:
                    if h is None:
                        # An earlier file of this inode number (BACKING reused it: a
                        # removed temporary file's, in builds) may still be held, its opens
                        # and mappings gone, to be let go: this Held takes its place and its
                        # protection (by number), or that protection would never end.
                        if of.ino not in self.held or not self.held[of.ino].current:
                            self._s.pool.protect(of.ino)
                        h = cf.held = self.held[of.ino] = Held(cf)
                    elif not h.current:         # mappings of a detached file may remain:
                        h.current = True        # they keep it; this is the new one
                        self._s.pool.protect(of.ino)
                        h.mapped_writable = False
                        h.baseline = h.voided = None
                        h.limit = None          # the new one is whole (_eligible)
                    h.backing_id = bid
                    return self._passthrough(of, h, PASSTHROUGH, "fully cached, read-only")
                why = "the kernel refused the cache file"
        if of.flags & os.O_APPEND and cf.attrs_stale and not direct:
            # The file changed behind the mount and the kernel's size is older: it would
            # put O_APPEND writes there, in its page cache too. Through direct I/O they
            # reach cachefs, which writes them at the file's end (fs.write).
            direct = True
            why = "O_APPEND to a file changed behind the mount"
        of.mode = DIRECT if direct else CACHED
        self._plain[of.ino] = self._plain.get(of.ino, 0) + 1
        if not direct:
            self._cached[of.ino] = self._cached.get(of.ino, 0) + 1
        if of.ino in self._page_cache_stale:
            self._page_cache_stale.discard(of.ino)
            keep_cache = False
        if self._debug:
            log.debug("open ino %d fh %d: %s%s", of.ino, of.fh, of.mode,
                      f" ({why})" if why else "")
        return Answer(of.fh, direct, keep_cache and not direct)

    def _direct_ok(self, of: OpenFile, cf: CachedFile) -> bool:
        """An O_DIRECT open in passthrough reads the cache file with O_DIRECT, under the
        cache filesystem's alignment rules: only when BACKING's are at least as strict (an
        unaligned read BACKING would serve must not fail here; NFS takes any)."""
        b_mem, b_off = of.dio_align
        if not b_mem or not b_off:
            return self._cfg.passthrough_odirect    # BACKING takes any: only if asked to
        if self._cache_dio is None:
            try:
                self._cache_dio = dio_align(self._s.cachefiles.fd(cf))
            except OSError:
                return False
        c_mem, c_off = self._cache_dio
        return 0 < c_mem <= b_mem and 0 < c_off <= b_off

    def _eligible(self, cf: CachedFile) -> bool:
        """Every block of the file valid, its cache file as long as the file, nothing in
        the way (a shrinking truncate committing, a file unlinked and replaced)."""
        if cf.size <= 0 or cf.doomed or cf.shrinking is not None or \
                len(cf.extents) < (cf.size + EXT_SIZE - 1) // EXT_SIZE:
            return False
        if not cf.covers(0, cf.size):
            return False
        try:
            fd = self._s.cachefiles.fd(cf)
            size = os.fstat(fd).st_size
            if size != cf.size:
                # The kernel reads the cache file to its end: make it as long as the file
                # (past EOF it holds zeros, and the last block may be padded with them).
                os.ftruncate(fd, cf.size)
        except OSError:
            return False
        return True

    @staticmethod
    def _stale(h: Held) -> bool:
        """Blocks of a held cache file are not valid: BACKING changed behind it
        (CacheState.stale_in_place), or behind dirty data (Coherence._conflict). (Past
        its `limit` the file is BACKING's alone: no block there is cached.)"""
        cf = h.cf
        end = cf.size if h.limit is None else min(cf.size, h.limit)
        return h.current and cf.held is h and not cf.doomed and end > 0 and \
            not cf.all_valid(0, end)

    async def refresh(self, h: Held) -> None:
        """Before a joined open of a held file whose blocks are not all valid is answered:
        read them again from BACKING into its cache file. The kernel serves that open from
        the cache file too (its mmap maps it), so it would map the old bytes, and what it
        wrote through a shared mapping of them would be lost. Its passthrough readers read
        BACKING's new bytes from then on, as readers of a local file see another process's
        writes. One refresh at a time; when it cannot be done (more than REFRESH_MAX_BYTES,
        no room, BACKING fails) the open is answered anyway and the log says what its
        mappings see."""
        while h.refreshing is not None:
            await h.refreshing.wait()
        if not self._stale(h):
            return
        h.refreshing = trio.Event()
        why = "no name of the file is known"
        try:
            for _ in range(REFRESH_TRIES):
                cf = h.cf
                end = cf.size if h.limit is None else min(cf.size, h.limit)
                missing = sum(1 for e in range((end + EXT_SIZE - 1) // EXT_SIZE)
                              if not cf.all_valid(e * EXT_SIZE, min(end, (e + 1) * EXT_SIZE)))
                if missing * EXT_SIZE > REFRESH_MAX_BYTES:
                    why = f"{missing * EXT_SIZE >> 20} MiB to read, over the limit"
                    break
                if self.refresher is None or cf.path is None:
                    why = "no loader" if self.refresher is None else why
                    break
                why = await self.refresher(cf.ino, cf.path, end)
                if not self._stale(h):
                    self.stats.passthrough_refreshed += 1
                    log.info("inode %d: its cache file, which the kernel reads in passthrough, "
                             "was read again from BACKING (%d extents)", cf.ino, missing)
                    return
            if not h.refresh_failed:
                h.refresh_failed = True
                log.warning("inode %d: BACKING changed under a file read in passthrough, and "
                            "its cache file could not be read again (%s): until its "
                            "passthrough opens are closed, mappings of new opens see the "
                            "older bytes", h.cf.ino, why)
        finally:
            h.refreshing.set()
            h.refreshing = None

    def _complete(self, cf: CachedFile) -> None:
        """A read-only open of a mostly cached file: load the rest in the background, so
        the next open can go passthrough (at least half of it cached, at most
        COMPLETE_MAX_BYTES missing: an open alone never pulls a whole cold file in)."""
        need = (cf.size + EXT_SIZE - 1) // EXT_SIZE
        have = len(cf.extents)
        if self.completer is None or cf.path is None or cf.doomed or not have or \
                2 * have < need or (need - have) * EXT_SIZE > COMPLETE_MAX_BYTES:
            return
        self.completer(cf.ino, cf.path, cf.size)

    def _register(self, cf: CachedFile) -> int:
        try:
            return self._kernel.register(cf.cache_fd)
        except OSError as exc:
            self.stats.passthrough_failed += 1
            if exc.errno == errno.EPERM:
                # The kernel wants CAP_SYS_ADMIN in the initial user namespace; every later
                # open would be refused the same way: off for this mount, said once.
                self.enabled = False
                self.reason = ("the kernel refused a backing file (EPERM): the daemon lacks "
                               "CAP_SYS_ADMIN in the initial user namespace")
                log.info("FUSE passthrough: off: %s", self.reason)
            else:
                log.info("passthrough refused for inode %d (%s); using the cached path",
                         cf.ino, exc.strerror or exc)
            return 0

    def session_ended(self) -> None:
        """The kernel ended the FUSE session: the backing ids went with the connection."""
        self._ended = True

    def _close_id(self, bid: int) -> None:
        if self._ended:
            return
        try:
            self._kernel.unregister(bid)
        except OSError as exc:
            log.warning("releasing a passthrough backing file failed: %s", exc)

    def _passthrough(self, of: OpenFile, h: Held, mode: str, why: str) -> Answer:
        of.mode = mode
        durable = take = False
        mappable = None
        h.opens += 1
        h.generation += 1
        if mode == PASSTHROUGH:
            self.stats.passthrough_opens += 1
        else:
            self.stats.passthrough_joined += 1
            if of.flags & os.O_ACCMODE != os.O_RDONLY:
                self._page_cache_stale.add(of.ino)
                if of.flags & os.O_ACCMODE == os.O_RDWR:
                    h.writers += 1
                if of.flags & os.O_ACCMODE == os.O_RDWR and h.current:
                    # It may map the cache file: answered once the file's mark is durable
                    # and its baseline taken (by the first such open; the others wait).
                    if not h.mapped_writable:
                        h.mapped_writable = take = True
                        self._writes.may_be_mapped(of)
                    durable, mappable = True, h
        if self._debug:
            log.debug("open ino %d fh %d: %s, backing id %d (%s)", of.ino, of.fh, mode,
                      h.backing_id, why)
        return Answer(of.fh, mode == JOINED, False, h.backing_id, durable, mappable, take)

    async def mappable(self, answer: Answer) -> None:
        """Before an open that may map a held file's cache file is answered: its baseline
        (heldwrites.take_baseline) is taken, by the first such open; the others wait."""
        h = answer.mappable
        if answer.take_baseline:
            try:
                await self._writes.take_baseline(h.cf)
            finally:
                h.baseline_ready.set()      # (cancelled: no baseline, all counts as changed)
        elif h.baseline_ready is not None:
            await h.baseline_ready.wait()

    def wrote_direct(self, of: OpenFile) -> bool:
        """A write through a direct_io open (O_DIRECT) is done. The kernel dropped its cached
        pages of the range before sending it, but a buffered read of another open meanwhile
        may have put the older bytes back (a buffered read after an AIO O_DIRECT write, with
        readers of the file beside it, got them: xfstests generic/451). The next page-cache
        open of the file drops them (keep_cache off); True if page-cache opens of it exist
        now: the caller drops them before the write is answered, as a local file system's
        O_DIRECT write does."""
        if of.mode != DIRECT:
            return False
        self._page_cache_stale.add(of.ino)
        return of.ino in self._cached

    def release(self, of: OpenFile) -> None:
        """A handle is released (in the release handler: the backing id can be closed)."""
        if of.mode in (PASSTHROUGH, JOINED):
            h = of.cfile.held
            h.opens -= 1
            if of.mode == JOINED and of.flags & os.O_ACCMODE == os.O_RDWR:
                h.writers -= 1
                if not h.writers and h.mapped_writable:
                    self._wake.set()    # once no process maps it: to BACKING (_settled)
            if h.opens == 0:
                self._close_id(h.backing_id)
                h.backing_id = 0
                self._wake.set()
        elif of.mode:
            _count_down(self._plain, of.ino)
            if of.mode == CACHED:
                _count_down(self._cached, of.ino)

    # -- letting go ----------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Let go of held files whose passthrough opens are gone and that no process maps;
        and copy what a shared writable mapping wrote as soon as no O_RDWR open and no
        mapping is left, though readers keep the file open (a reader's hold kept an
        msync'd write off BACKING in write-through for as long as it stayed open: a
        helper's differential hunt)."""
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while any(_idle(h) for h in self.held.values()):
                await trio.sleep(HOLD_CHECK_S)
                idle = {ino: h.generation for ino, h in self.held.items() if _idle(h)}
                if not idle:
                    break
                mapped = await self._maps.scan(self._fuse_dev, set(idle))
                for ino, gen in idle.items():
                    h = self.held.get(ino)
                    if h is None or h.generation != gen or ino in mapped:
                        continue
                    if h.opens == 0:
                        await self._let_go(h)
                    elif h.mapped_writable and not h.writers:
                        await self._settled(h)

    async def _settled(self, h: Held) -> bool:
        """No shared writable mapping of a held file is left: what they wrote goes to
        BACKING (write-through) or turns dirty (write-back). False if that failed (tried
        again later)."""
        cf = h.cf
        if h.mapped_writable and h.current and self._s.files.get(cf.ino) is cf \
                and not cf.doomed:
            h.mapped_writable = False
            try:
                await self._writes.sync_back(cf)
            except OSError as exc:      # BACKING failed: still held, tried again later
                h.mapped_writable = True
                if not h.sync_failed:
                    h.sync_failed = True
                    log.warning("inode %d: copying what a shared mapping wrote to BACKING "
                                "failed (%s); it is tried again every second (and by the "
                                "next mount)", cf.ino, exc)
                return False
        return True

    async def _let_go(self, h: Held) -> None:
        cf = h.cf
        if not await self._settled(h) or h.opens:
            return                      # failed, or opened again meanwhile: still held
        if self.held.get(cf.ino) is h and not h.opens:
            del self.held[cf.ino]
            cf.held = None
            if h.current:                   # a detached one's protection ended then
                self._s.pool.unprotect(cf.ino)
            self._s.cachefiles.close_idle(cf)
            self._back_to_size(cf)
            if self._debug:
                log.debug("inode %d: no passthrough open or mapping left; not held", cf.ino)

    def _back_to_size(self, cf: CachedFile) -> None:
        """What was appended to a held file stayed in its cache file past --cache-size (the
        kernel read that file by itself); let go, the pool goes back to its size, its
        victims evicted as any (it stayed over its size until the next mount: a 16 MiB pool
        held 55 MiB after a `tail -f` of a growing log, the cache filesystem full)."""
        s = self._s
        over = len(s.pool) - s.capacity_exts
        if over <= 0:
            return
        before = s.stats.evictions
        s.make_room(0)
        log.info("inode %d is no longer read in passthrough: the pool was %d extents (%s) "
                 "over the cache size of %s while it was held; %d clean extents evicted",
                 cf.ino, over, format_size(over * EXT_SIZE),
                 format_size(s.capacity_exts * EXT_SIZE), s.stats.evictions - before)

    async def settle(self) -> None:
        """Let go now, not at the next check, of held files a shared writable mapping may
        have written and that no O_RDWR open or mapping holds any more: what it wrote goes to
        BACKING (write-through) or turns dirty (write-back). A flush does this first, so
        that it destages the mapping's bytes, and so does the unmount (a file still mapped
        then, after a lazy unmount, keeps its mark: the next mount takes it as written).
        A file an O_RDWR open still has (a mapping may be writing it now, or its release
        is on its way) is made dirty whole in write-back, so that the flush destages what
        its mappings wrote so far; write-through copies that to BACKING now (checkpoint)."""
        for h in list(self.held.values()):
            if h.mapped_writable and h.writers and h.current:
                if self._s.write_back:
                    self._s.mapping_wins(h.cf, "a flush")
                elif self._s.files.get(h.cf.ino) is h.cf and not h.cf.doomed:
                    await self._writes.checkpoint(h.cf)
        wrote = {ino: h.generation for ino, h in self.held.items()
                 if h.mapped_writable and not h.writers}
        if not wrote:
            return
        mapped = await self._maps.scan(self._fuse_dev, set(wrote))
        for ino, gen in wrote.items():
            h = self.held.get(ino)
            if h is None or h.writers or h.generation != gen or ino in mapped:
                continue
            if h.opens:
                await self._settled(h)          # readers keep it held
            else:
                await self._let_go(h)

    # -- reporting -----------------------------------------------------------------------------

    def status(self) -> dict:
        held_exts = sum(len(h.cf.extents) for h in self.held.values() if h.current)
        return {
            "passthrough": "on" if self.enabled else "off",
            "passthrough_on": int(self.enabled),
            "passthrough_off_reason": None if self.enabled else self.reason,
            "passthrough_open_files": sum(1 for h in self.held.values() if h.opens),
            "passthrough_open_handles": sum(h.opens for h in self.held.values()),
            "passthrough_held_files": len(self.held),
            "passthrough_held_bytes": held_exts * EXT_SIZE,
        }


class MapsScanner:
    """mapped_inodes in a thread, for at most MAPS_SCAN_S. Opening a process's
    /proc/PID/maps waits for that process's exec lock, which a process stuck in a hung
    FUSE or NFS request may hold for as long as it hangs: an unmount waited 19 minutes for
    a scan (a helper's hunt, another mount hung on the host). A scan that does not finish
    in time counts every file as mapped (held files stay held, their marks stay: the next
    mount takes such a file as written); until that scan's thread returns, none starts."""

    def __init__(self, limit_s: float = MAPS_SCAN_S):
        self.limit_s = limit_s
        self._stuck: threading.Event | None = None      # set when the stuck scan returns

    async def scan(self, fuse_dev: tuple[int, int] | None, inos: set[int]) -> set[int]:
        if self._stuck is not None:
            if not self._stuck.is_set():
                return set(inos)
            self._stuck = None
        done = threading.Event()

        def scan_maps() -> set[int]:
            try:
                return mapped_inodes(fuse_dev, inos)
            finally:
                done.set()

        with trio.move_on_after(self.limit_s):
            return await trio.to_thread.run_sync(scan_maps, **{ABANDON_KW: True})
        self._stuck = done
        log.warning("looking for mappings of held files in /proc/*/maps took over %g s (a "
                    "process on this host is stuck, in a hung mount?); they count as mapped "
                    "until a look succeeds", self.limit_s)
        return set(inos)


def mapped_inodes(fuse_dev: tuple[int, int] | None, inos: set[int]) -> set[int]:
    """Which of `inos` (files of the mount `fuse_dev`) some process maps (runs in a thread).
    /proc/PID/maps names a mapping of a passthrough open by the FUSE file's device and inode
    (the user-visible file, not the backing file). Unknown device: all of them."""
    if fuse_dev is None:
        return set(inos)
    found: set[int] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return set(inos)
    want_dev = "%02x:%02x" % fuse_dev
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                data = f.read()
        except OSError:                  # gone, or not ours to read
            continue
        if want_dev.encode() not in data:
            continue
        for line in data.splitlines():
            fields = line.split(None, 5)
            if len(fields) >= 5 and fields[3].decode() == want_dev:
                ino = int(fields[4])
                if ino in inos:
                    found.add(ino)
    return found


def _has_cap_sys_admin() -> bool:
    """CAP_SYS_ADMIN in the initial user namespace, as the kernel's passthrough wants it: a
    capability inside a user namespace (a rootless container, `unshare -U`) is not enough."""
    try:
        with open("/proc/self/uid_map") as f:
            if f.read().split() != ["0", "0", "4294967295"]:
                return False            # not the initial user namespace
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def fuse_device(real_mountpoint: str) -> tuple[int, int] | None:
    """(major, minor) of the mount on `real_mountpoint`, from /proc/self/mountinfo."""
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and mounttable.unescape(fields[4]) == real_mountpoint:
                    major, minor = fields[2].split(":")
                    return int(major), int(minor)
    except (OSError, ValueError):
        pass
    return None


def _count_down(counts: dict[int, int], ino: int) -> None:
    n = counts[ino] - 1
    if n:
        counts[ino] = n
    else:
        del counts[ino]


def _idle(h: Held) -> bool:
    """A held file to look at (OpenModes.run): no open, or a shared writable mapping's
    writes to settle once no O_RDWR open is left."""
    return h.opens == 0 or (h.mapped_writable and not h.writers)
