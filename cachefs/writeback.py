"""The destager and flow control of write-back mode.

Owns the schedule: which dirty data goes to BACKING when, how fast writers may go, and the
destage rate, the plan of a pass (`plan_destage`: which blocks, coalesced into which runs)
and flush (`Destager.flush`). Extent state changes are the engine's (`Cache.destage_plan`,
`Cache.destage_done`), reached through the `Engine` protocol: this module never imports the
engine; it decides and moves bytes.

- Destaging: oldest dirty extent first; from it on, its file's dirty blocks are written in
  offset order (a circular elevator under random writes), coalesced into runs, up to
  `BATCH_BYTES` per pass, then BACKING is fdatasync'd; only then do the blocks turn clean
  (unless rewritten meanwhile). Data is destaged when dirty data is above --dirty-low, when
  it is older than the write-back delay (bounded by --max-dirty-age), or while a flush is
  requested. A BACKING error keeps the data dirty and retries that file with exponential
  backoff.
- Flow control: above --dirty-high a writer waits (excess / destage rate) seconds before its
  write is accepted: a proportional controller whose equilibrium is writers running at the
  destage rate with dirty data just above the high mark. Below it writers run at SSD speed.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from typing import TYPE_CHECKING, Protocol

import trio

from . import aio
from . import backingpaths as bp
from .backing import Backing
from .config import BLK_SIZE, EXT_SIZE, Config, format_size
from .statx import fresh_fstat
from .dirty import DirtyIndex
from .errors import CommandFailed
from .extents import BLK_SHIFT, BLKS_PER_EXT, EXT_SHIFT, KEEP_ATIME, block_mask, runs
from .integrity import block_sum
from .namespace import CAPS
from .oplog import RateLimitedLog
from .stats import Stats

if TYPE_CHECKING:
    from .extents import CachedFile, Extent

log = logging.getLogger("cachefs.writeback")

BATCH_BYTES = 16 << 20         # one destage pass of a file (runs, with bridged gaps)
MIN_RATE = 4 << 20             # B/s assumed before the first measurement
MAX_DELAY_S = 2.0              # one sleep of a held write is never longer than this
BACKOFF_MAX_S = 30.0
BACKOFF_FORCED_S = 1.0         # longest wait between retries while a flush asks for everything
FLUSH_STALL_TIMEOUTS = 5   # a flush gives up after this many --backing-timeout without progress
MIN_PASS_BYTES = 64 << 10      # after failures a file's passes shrink to this (one extent)
# Destage: join two dirty runs across a gap of clean valid blocks up to this long. Writing
# the gap costs link time (gap / bandwidth); a separate request costs a random access, but
# BACKING serves several at once, so about latency x bandwidth / parallel requests: 5 ms x
# 110 MB/s / 8 = 69 KB on the emulator. Measured there (write-back, 1 GiB): 256K -> 64K took
# hitachi-sql from 2,092 to 2,988 IOPS and flashsoft-70-30 from 12.1k to 14.0k; 16K lost
# 21 % on flashsoft-70-30.
MERGE_GAP = 64 << 10
# Destage passes of different files at once (a file has one at a time). Every pass ends with
# an fdatasync of its file on BACKING: one pass at a time destaged many small files at one
# file per BACKING round trip (51 files/s on the emulator: bench/README.md).
PARALLEL_PASSES = 4


def plan_destage(cf: "CachedFile", max_bytes: int, start_ext: int = 0
             ) -> "tuple[list[tuple[Extent, int]], list[tuple[int, int]]]":
    """Snapshot a file's dirty extents from `start_ext` on, in offset order: (extent,
    dirty mask) pairs, and the byte runs to write, coalesced across extents and clipped
    to the file's size. The destager starts at the file's oldest dirty extent: under
    random writes that is where the last sweep passed longest ago, so dirty blocks are
    densest there and bridge into long writes (a circular elevator). Resets the extents'
    `redirty` (blocks rewritten from now on stay dirty after the pass)."""
    plan: list[tuple[Extent, int]] = []
    out: list[tuple[int, int]] = []
    total = 0
    for e in sorted(e for e, x in cf.extents.items() if x.dirty and e >= start_ext):
        x = cf.extents[e]
        base = e << EXT_SHIFT
        # Only blocks below the logical size are written, so only they may turn clean;
        # a dirty block past it would be a bug, and it stays dirty rather than vanish.
        # Blocks found damaged on the SSD (x.bad) are never written to BACKING.
        snap = x.dirty & ~x.bad & block_mask(0, min(cf.size - base, EXT_SIZE))
        if snap != x.dirty & ~x.bad:
            log.error("inode %d extent %d: dirty blocks past the file's size %d",
                      cf.ino, e, cf.size)
        if not snap:
            continue
        plan.append((x, snap))
        x.redirty = 0
        for b0, b1 in runs(snap):
            s, t = base + (b0 << BLK_SHIFT), min(base + (b1 << BLK_SHIFT), cf.size)
            if t <= s:
                continue
            if out:
                end = out[-1][0] + out[-1][1]
                # Bridge a short gap of clean valid blocks (BACKING already has those
                # bytes): one larger write costs little more than a small one on a disk.
                # Not across blocks of zeros: BACKING may have a hole there (a punch, a
                # sparse file), which the write of those zeros filled.
                if end == s or (s - end <= MERGE_GAP and cf.all_valid(end, s)
                                and not _zeros_in(cf, end, s)):
                    total += s - end
                    out[-1] = (out[-1][0], t - out[-1][0])
                    total += t - s
                    continue
            out.append((s, t - s))
            total += t - s
        if total >= max_bytes:
            break
    return plan, out


_ZERO_SUM = block_sum(bytes(BLK_SIZE))


def _zeros_in(cf: "CachedFile", off: int, end: int) -> bool:
    """Does [off, end) (block-aligned, valid) hold a block whose checksum is that of zeros?"""
    for e in range(off >> EXT_SHIFT, ((end - 1) >> EXT_SHIFT) + 1):
        x = cf.extents[e]
        base = e << EXT_SHIFT
        m = block_mask(max(off, base) - base, min(end - base, EXT_SIZE)) & x.summed
        if m and x.sums is not None and any(x.sums[b] == _ZERO_SUM
                                            for b in range(BLKS_PER_EXT) if m >> b & 1):
            return True
    return False


class Engine(Protocol):
    """What the destager needs of the engine (cache.Cache implements it): the dirty index
    to schedule from, and the extent state changes of a destage pass. The destager never
    imports the engine: imports flow from the engine down to it."""

    files: "dict[int, CachedFile]"
    dirty: DirtyIndex

    def dirty_bytes(self) -> int: ...
    def oldest_dirty_age_s(self) -> float: ...
    def cache_reader(self, cf: "CachedFile") -> int: ...
    def file_lock(self, cf: "CachedFile") -> trio.Lock: ...
    def discard_orphan(self, cf: "CachedFile") -> None: ...
    def set_wb_fd(self, cf: "CachedFile", fd: int) -> None: ...
    def take_idle_wb_fd(self, cf: "CachedFile") -> int: ...
    def destage_plan(self, cf: "CachedFile", max_bytes: int, start_ext: int = 0
                     ) -> "tuple[list[tuple[Extent, int]], list[tuple[int, int]]]": ...
    def destage_failed(self, cf: "CachedFile", st: os.stat_result | None = None) -> None: ...
    def destage_abandoned(self, cf: "CachedFile") -> None: ...
    async def persist(self, durable: bool = False) -> None: ...
    def destage_done(self, cf: "CachedFile", plan: "list[tuple[Extent, int]]",
                     st: os.stat_result, snapshot_s: float) -> None: ...
    def damaged(self, cf: "CachedFile", offsets: list[int], where: str) -> int: ...
    def damaged_dirty_blocks(self) -> int: ...


class Destager:
    def __init__(self, cache: Engine, backing: Backing, cfg: Config, stats: Stats):
        self._cache = cache
        self._backing = backing
        self._stats = stats
        self.high = cfg.dirty_high or 0
        self.low = cfg.dirty_low or 0
        self.delay_s = min(5.0, cfg.max_dirty_age_s / 2)
        self.rate = 0.0                       # destage rate, bytes/s (moving average)
        self.force = 0                        # flush requests in progress
        self.room_wanted = 0                  # writers waiting for a slot held by dirty data
        self._engaged_s: float | None = None  # when writers began to be slowed (for the log)
        self._engaged_writes = 0
        self.last_error: str | None = None
        self.last_error_s = 0.0
        self.last_progress_s = time.monotonic()
        self._backoff: dict[int, tuple[float, float]] = {}    # ino -> (retry at, delay)
        # ino -> bytes of its next pass, below BATCH_BYTES after failures: a pass is all or
        # nothing, and with a few per cent of BACKING's writes failing, 16 MiB passes (256
        # writes) never got through (0 bytes destaged in 5 minutes at 5 %)
        self._pass_bytes: dict[int, int] = {}
        self._limited = RateLimitedLog(log)   # failed passes: one line per errno a minute
        self._in_pass: set[int] = set()       # inodes with a destage pass under way
        self._kick = trio.Event()             # a pass ended, or a writer wants room now
        # older caches stored absolute path hints: BACKING as given, or its real path
        self._root_paths = bp.root_paths(cfg.backing)

    # -- flow control ------------------------------------------------------------------------

    async def throttle(self, nbytes: int) -> None:
        """Hold a write that would take dirty data above the high mark until the destager
        has made room for it, in sleeps of (excess / destage rate), each at most
        MAX_DELAY_S: dirty data stays within the mark plus the writes in flight (what
        losing the SSD can lose, docs/operations.md). One sleep did before, whatever the
        destager achieved meanwhile: a writer beside a busy CPU took it 30 % over. While
        destaging fails (BACKING errors, timeouts) holding writers makes no room: after one
        sleep they go on, and dirty data grows on the SSD, as the log and stats say. So
        while BACKING is stalled (a write of it has not returned for --backing-timeout: a
        hung server, whose calls neither fail nor end): writers were held for as long as
        the hang lasted, 90 s for a 90 s hang (a helper's hunt)."""
        if not self.high:
            return
        counted = False
        while True:
            dirty = self._cache.dirty_bytes()
            over = dirty + nbytes - self.high
            # After a sleep, a write goes once dirty data is back at the mark (it is then
            # one of the writes in flight): a write larger than the room under the mark
            # (one of 300 KB with a 256 KiB mark) would otherwise wait for none at all.
            if over <= 0 or not dirty or (counted and dirty <= self.high):
                if self._engaged_s is not None:
                    self._check_release()
                return
            if self._engaged_s is None:
                self._engaged_s = time.monotonic()
                self._engaged_writes = self._stats.throttled_writes
                log.info("flow control engaged: %s dirty, over the high mark of %s; writers "
                         "are slowed to the destage rate (%s/s)", format_size(dirty),
                         format_size(self.high), format_size(max(self.rate, MIN_RATE)))
            delay = min(over / max(self.rate, MIN_RATE), MAX_DELAY_S)
            if not counted:
                counted = True
                self._stats.throttled_writes += 1
            self._stats.throttle_delay_ns += int(delay * 1e9)
            await trio.sleep(delay)
            if self.failing() or self._backing.health.stall is not None:
                return

    def _check_release(self) -> None:
        """Log the end of a flow-control episode once dirty data is back under the low mark
        (not merely the high one, around which a sustained burst keeps it: one episode is
        one pair of log lines)."""
        if self._cache.dirty_bytes() > self.low:
            return
        log.info("flow control released after %.1f s: %s dirty, under the low mark; %d "
                 "writes were slowed meanwhile (destage rate %s/s)",
                 time.monotonic() - self._engaged_s, format_size(self._cache.dirty_bytes()),
                 self._stats.throttled_writes - self._engaged_writes, format_size(self.rate))
        self._engaged_s = None

    def throttling(self) -> bool:
        return bool(self.high) and self._cache.dirty_bytes() > self.high

    def failing(self) -> bool:
        """True while the last destage pass failed and none succeeded since."""
        return self.last_error_s > self.last_progress_s

    async def wait_room(self, timeout_s: float = 0.5) -> None:
        """A writer needs a cache slot and every slot it could take holds dirty data: make
        the destager due now and wait until some dirty data turned clean (or a short while).
        The dirty marks count bytes, the pool counts 64 KiB extents: scattered small writes
        fill every slot while the dirty bytes stay under --dirty-low, and going by bytes and
        age alone the destager would wait out the write-back delay while the writer waits."""
        self.room_wanted += 1
        try:
            self._cache.dirty.wake()
            self._kick.set()
            await self._cache.dirty.wait_cleaned(timeout_s)
        finally:
            self.room_wanted -= 1

    # -- the destage loop --------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start a pass for the file of the oldest due dirty extent, up to PARALLEL_PASSES
        files at once. While passes run, the next file is looked for when one ends, when a
        writer wants room, or every idle interval: not at every extent that turns dirty (a
        look walks the dirty extents, most of them a file in a pass under random writes)."""
        task_status.started()
        cache = self._cache
        try:
            async with trio.open_nursery() as passes:
                while True:
                    cf = None
                    if len(self._in_pass) < PARALLEL_PASSES:
                        cf, start_ext = self._next_due()
                    if cf is None:
                        if self._in_pass:
                            await self._kicked(self._idle_wait_s())
                        else:
                            await cache.dirty.wait_dirtied(self._idle_wait_s())
                        continue
                    self._in_pass.add(cf.ino)
                    passes.start_soon(self._one_pass, cf, start_ext)
                    await trio.sleep(0)
        finally:
            self._limited.flush()             # the counts of failure lines held back

    async def _one_pass(self, cf: "CachedFile", start_ext: int) -> None:
        try:
            await self._destage(cf, start_ext)
        finally:
            self._in_pass.discard(cf.ino)
            self._kick.set()

    async def _kicked(self, timeout_s: float) -> None:
        """Wait until a pass ends or a writer wants room (or `timeout_s`)."""
        with trio.move_on_after(timeout_s):
            await self._kick.wait()
        self._kick = trio.Event()

    def _idle_wait_s(self) -> float:
        if not self._cache.dirty:
            return 5.0
        return 0.2

    def _due(self) -> bool:
        cache = self._cache
        return (self.force > 0 or self.room_wanted > 0 or cache.dirty_bytes() > self.low
                or cache.oldest_dirty_age_s() >= self.delay_s)

    def _next_due(self) -> "tuple[CachedFile | None, int]":
        """The file of the oldest dirty extent not backing off, and that extent."""
        cache = self._cache
        if not cache.dirty or not self._due():
            return None, 0
        if self._in_pass and cache.dirty.files <= sum(
                1 for ino in self._in_pass
                if (cf := cache.files.get(ino)) is not None and cf.dirty_exts):
            return None, 0                      # every dirty file is in a pass: no walk
        now = time.monotonic()
        for ino, ext in cache.dirty:           # oldest first
            if ino in self._in_pass:
                continue
            retry = self._backoff.get(ino)
            if retry is not None and retry[0] > now:
                continue
            cf = cache.files.get(ino)
            if cf is not None:
                x = cf.extents.get(ext)
                if x is not None and not x.dirty & ~x.bad:
                    continue                    # only damaged blocks: nothing to destage
                return cf, ext
        return None, 0

    async def _destage(self, cf: "CachedFile", start_ext: int = 0) -> None:
        """One destage pass of `cf`; then its BACKING descriptor is closed if the file is
        clean and closed, or was let go of meanwhile (whichever way the pass ended: a file
        removed while the pass held it kept a deleted file's descriptor to the unmount)."""
        try:
            await self._destage_pass(cf, start_ext)
        finally:
            # (Cancelled, at unmount: the close is abandoned if BACKING hangs, or not
            # started; the descriptor goes with the process.)
            fd = self._cache.take_idle_wb_fd(cf)
            if fd >= 0:
                await self._backing.write_call(os.close, fd, abandon_on_cancel=True)

    async def _destage_pass(self, cf: "CachedFile", start_ext: int) -> None:
        cache = self._cache
        async with cache.file_lock(cf):
            if not cf.dirty_exts:
                return
            if cf.wb_fd < 0:
                try:
                    fd = await self._backing.write_call(bp.open_by_ino, self._backing.root_fd,
                                                        cf.path, cf.ino, self._root_paths,
                                                        cf.birth, abandon_on_cancel=True)
                except OSError as exc:
                    self._failed(cf, exc)
                    return
                if fd < 0 and cf.open_count:
                    # Unlinked but still open (and no handle was opened since a remount to
                    # lend a descriptor): its data stays readable in the cache until closed.
                    self._backoff[cf.ino] = (time.monotonic() + BACKOFF_MAX_S, BACKOFF_MAX_S)
                    return
                if fd < 0:
                    cache.discard_orphan(cf)
                    return
                cache.set_wb_fd(cf, fd)
            if cf.recovered:
                # After an unclean stop, before the first destage adopts BACKING's identity
                # as its own: BACKING's file as found against the one last committed. A
                # punch, a zero range or a write around the cache that changed BACKING after
                # that commit left clean blocks with the old bytes; the destage took the
                # new identity as its own, and they were served for good (a helper's hunt).
                token = cache.stat_token(cf.ino)
                try:
                    st = await self._backing.write_call(os.fstat, cf.wb_fd,
                                                        abandon_on_cancel=True)
                except OSError as exc:
                    self._failed(cf, exc)
                    return
                cache.revalidate(cf, st, token)
            try:
                cfd = cache.cache_reader(cf)     # (a cache file found gone: its blocks lost)
            except OSError as exc:
                self._failed(cf, exc)
                return
            plan, runs = cache.destage_plan(cf, self._pass_bytes.get(cf.ino, BATCH_BYTES),
                                            start_ext)
            if not plan:
                os.close(cfd)
                cache.destage_failed(cf)         # nothing but damaged blocks
                return
            t0 = time.monotonic()                # no await since the snapshot: its time
            nbytes = sum(n for _, n in runs)
            sums = expected_sums(cf, runs)
            t0_ns = time.perf_counter_ns()
            cf.meta_inflight += 1           # BACKING's size and times move: ours
            try:
                try:
                    # Abandoned only at unmount, with BACKING hanging: the pass never
                    # completes, its blocks stay dirty for the next mount.
                    st, damaged = await self._backing.write_call(
                        _destage_io, cf.wb_fd, cfd, runs, sums, cf.times, cf.caps,
                        abandon_on_cancel=True)
                    self._stats.lat_destage.add(time.perf_counter_ns() - t0_ns)
                except BaseException as exc:
                    if not isinstance(exc, OSError):
                        cache.destage_failed(cf)
                        if isinstance(exc, trio.Cancelled):
                            # (the unmount) The abandoned thread may still write through
                            # wb_fd: never closed, so its number cannot name another file.
                            # BACKING's file changes after the last commit: the next mount
                            # must take that for its own (a conflict every time, generic/464).
                            cf.wb_fd = -1
                            cache.destage_abandoned(cf)
                        raise
                    # Part of the pass may be in BACKING (its size and times moved): ours,
                    # not a change behind the cache to drop data for at the next open.
                    try:
                        after = await self._backing.read_call("stat", fresh_fstat, cf.wb_fd)
                    except OSError:
                        after = None
                    cache.destage_failed(cf, after)
                    self._failed(cf, exc)
                    return
                if damaged:                      # left out of the write: never to BACKING
                    cache.damaged(cf, damaged, "destage")
                cache.destage_done(cf, plan, st, t0)
                if not st.st_nlink and not cf.doomed:
                    self._removed_behind(cf, nbytes, len(plan))
            finally:
                cf.meta_inflight -= 1
        self._backoff.pop(cf.ino, None)
        smaller = self._pass_bytes.get(cf.ino)
        if smaller is not None:                 # it got through: grow back
            if smaller * 2 >= BATCH_BYTES:
                del self._pass_bytes[cf.ino]
            else:
                self._pass_bytes[cf.ino] = smaller * 2
        elapsed = max(time.monotonic() - t0, 1e-6)
        self._stats.destage_ops += 1
        self._stats.destaged_bytes += nbytes
        self.last_progress_s = time.monotonic()
        if nbytes >= 64 << 10:
            # passes of other files ran beside this one: the rate BACKING takes is theirs too
            sample = nbytes / elapsed * (1 + len(self._in_pass - {cf.ino}))
            self.rate = sample if not self.rate else 0.7 * self.rate + 0.3 * sample
        if self._engaged_s is not None:
            self._check_release()

    def _removed_behind(self, cf: "CachedFile", nbytes: int, extents: int) -> None:
        """BACKING's file has no name left, and not by an unlink through the mount: someone
        removed it behind cachefs (another host, a cleanup job). Its dirty data went into
        the removed file, which nobody can reach: as at a mount that finds it gone (reason:
        orphan), it is said and counted, not flushed in silence (a helper's hunt)."""
        self._stats.drop_orphan += extents
        self._limited.warning(("removed behind", cf.ino), "BACKING file %s (inode %d) was "
                              "removed behind cachefs while %s of it was dirty here: written "
                              "into the removed file, which no name reaches (reason: orphan)",
                              os.fsdecode(cf.path or b"?"), cf.ino, format_size(nbytes))

    def _failed(self, cf: "CachedFile", exc: OSError) -> None:
        self._stats.destage_errors += 1
        _, delay = self._backoff.get(cf.ino, (0.0, 0.5))
        if self.force:                          # a flush waits: retry soon
            delay = min(delay, BACKOFF_FORCED_S)
        self._backoff[cf.ino] = (time.monotonic() + delay, min(delay * 2, BACKOFF_MAX_S))
        self._pass_bytes[cf.ino] = max(MIN_PASS_BYTES,
                                       self._pass_bytes.get(cf.ino, BATCH_BYTES) // 4)
        self.last_error = (f"destaging {os.fsdecode(cf.path or b'?')} to BACKING failed: "
                           f"{exc.strerror or exc}")
        self.last_error_s = time.monotonic()
        self._limited.warning(("destage", exc.errno), "%s; the data stays dirty on the SSD, "
                              "retrying in %.1f s", self.last_error, delay)

    # -- flush -------------------------------------------------------------------------------

    async def flush(self, timeout_s: float | None, progress=None) -> None:
        """Destage every dirty byte now (cachefs-ctl flush, umount --flush), then make the
        metadata durable. `progress` (async) gets a dict every half second. Raises
        CommandFailed on timeout, when BACKING keeps failing with no progress for 5 s, or
        when it takes no destage write at all for FLUSH_STALL_TIMEOUTS x --backing-timeout
        (a hung BACKING: its calls neither fail nor end; `cachefs umount --flush`, the
        unit's stop, waited for ever)."""
        cache = self._cache
        start = time.monotonic()
        self.force += 1
        now = time.monotonic()                  # files backing off: retried within a second
        for ino, (at, delay) in list(self._backoff.items()):
            self._backoff[ino] = (min(at, now + BACKOFF_FORCED_S), delay)
        try:
            while cache.dirty:
                if progress is not None:
                    await progress({"dirty_bytes": cache.dirty_bytes(),
                                    "destaged_bytes": self._stats.destaged_bytes,
                                    "destage_rate": round(self.rate), "eta_s": self.eta_s()})
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise CommandFailed(
                        f"flush timed out after {timeout_s:g} s with "
                        f"{format_size(cache.dirty_bytes())} still dirty"
                        + (f"; last error: {self.last_error}" if self.last_error else "")
                        + ".")
                lost = cache.damaged_dirty_blocks()
                if lost and cache.dirty.blocks <= lost:
                    raise CommandFailed(
                        f"{lost} dirty blocks ({format_size(lost * BLK_SIZE)}) are damaged on "
                        "the cache SSD and cannot be destaged (`cachefs-ctl stats` names "
                        "them; rewriting them whole or removing their files clears them).")
                if (self.last_error and self.last_error_s > start
                        and time.monotonic() - self.last_progress_s > 5):
                    raise CommandFailed(f"{self.last_error}; "
                                        f"{format_size(cache.dirty_bytes())} still dirty.")
                stalled = time.monotonic() - max(start, self.last_progress_s)
                if stalled > FLUSH_STALL_TIMEOUTS * self._backing.timeout_s:
                    raise CommandFailed(
                        f"BACKING took no destage write for {stalled:.0f} s (hung?); "
                        f"{format_size(cache.dirty_bytes())} still dirty, kept on the SSD "
                        "and destaged when BACKING answers.")
                await cache.dirty.wait_cleaned(0.5)
            await cache.persist(durable=True)
        finally:
            self.force -= 1

    def eta_s(self) -> float | None:
        dirty = self._cache.dirty_bytes()
        if not dirty:
            return 0.0
        return dirty / self.rate if self.rate else None


CHUNK = 1 << 20                 # largest single BACKING write of a destage pass
AIO_MIN_BYTES = 64 << 10        # a pass of one write up to this size skips AIO


def expected_sums(cf: "CachedFile", runs: list[tuple[int, int]]) -> dict[int, int]:
    """The checksums of the blocks a destage pass reads (offset -> sum), where known."""
    sums = {}
    for off, size in runs:
        for b in range(off, off + size, BLK_SIZE):
            x = cf.extents.get(b >> EXT_SHIFT)
            i = (b >> BLK_SHIFT) & (BLKS_PER_EXT - 1)
            if x is not None and x.summed >> i & 1:
                sums[b] = x.sums[i]
    return sums


def _destage_io(fd: int, cfd: int, runs: list[tuple[int, int]], sums: dict[int, int],
                times: tuple[int, int] | None = None, caps: bytes | None = None
                ) -> tuple[os.stat_result, list[int]]:
    """Copy runs from the cache file `cfd` (closed here: a pass abandoned at unmount may
    still read it, so nobody else closes it) to BACKING's `fd`, then make BACKING durable
    (one thread call);
    returns BACKING's stat and the offsets of blocks left out because they failed their
    checksums (garbage never reaches BACKING). `times`: (atime_ns, mtime_ns) the file had
    through the mount (its last write, or times set explicitly since), put back after the
    data, which moved BACKING's mtime (atime KEEP_ATIME: BACKING's stays). `caps`: the
    security.capability set through the mount after that data was written, which BACKING's
    write of it dropped: put back.

    The runs go out together through AIO (BACKING serves them in parallel; a FUSE BACKING
    would otherwise take them one at a time), then one fdatasync covers them all.
    """
    # One page-aligned buffer for the pass: each run is read straight into its own aligned
    # slice (the read runs without the GIL and faults the pages in itself), and AIO writes
    # from those slices as they are (no copy, no buffer per write).
    placed = []
    total = 0
    for off, size in runs:
        placed.append((off, size, total))
        total += (size + aio.ALIGN - 1) & ~(aio.ALIGN - 1)
    buf = mmap.mmap(-1, max(total, aio.ALIGN))
    view = memoryview(buf)
    items = []
    damaged = []
    try:
        for off, size, at in placed:
            _read_into(cfd, view[at:at + size], off)  # past the cache file's end: zeros
            for o in range(0, size, CHUNK):
                items += _checked(view[at + o:at + min(size, o + CHUNK)], off + o, sums,
                                  damaged)
    finally:
        os.close(cfd)
    # One write (a small file, one run of an extent) goes plainly: an O_DIRECT twin and an
    # AIO round have nothing to overlap it with, and cost a small file's pass a third more.
    direct = aio.open_direct(fd) if len(items) > 1 or total > AIO_MIN_BYTES else -1
    try:
        aio.pwrite_all(fd, direct, items)
    finally:
        if direct >= 0:
            os.close(direct)
    os.fdatasync(fd)
    if caps is not None:            # set after the data's write: BACKING's write dropped it
        os.setxattr(fd, CAPS, caps)
    if times is not None:
        atime, mtime = times
        st = os.fstat(fd)
        try:
            os.utime(fd, ns=(st.st_atime_ns if atime == KEEP_ATIME else atime, mtime))
        except OSError:
            # A file with no name left on BACKING (unlinked while open here): its times there
            # are nobody's to see, and a FUSE BACKING that reaches files by name refuses to
            # set them (ESTALE). Its data went to BACKING's file all the same.
            if st.st_nlink:
                raise
    return fresh_fstat(fd), damaged    # BACKING's own attributes, not the kernel's cached ones


def _read_into(fd: int, view: memoryview, off: int) -> None:
    """Fill `view` from `fd` at `off`; what lies past the file's end is left as it is."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], off + done)
        if n <= 0:
            return
        done += n


def _checked(data: memoryview, off: int, sums: dict[int, int], damaged: list[int]
             ) -> list[tuple[memoryview, int]]:
    """`data` (read at the block-aligned `off`) as items to write, without the blocks whose
    bytes fail their checksums (appended to `damaged`). The last block may be cut at the
    file's end: the cache file holds zeros past it, so it is checked padded."""
    view = data
    items = []
    start = 0
    get = sums.get
    for i in range(0, len(data), BLK_SIZE):
        want = get(off + i)
        if want is None:
            continue
        blk = view[i:i + BLK_SIZE]
        if len(blk) < BLK_SIZE:
            blk = bytes(blk) + bytes(BLK_SIZE - len(blk))
        if block_sum(blk) != want:
            damaged.append(off + i)
            if i > start:
                items.append((view[start:i], off + start))
            start = i + BLK_SIZE
    if start == 0:
        return [(data, off)]
    if start < len(data):
        items.append((view[start:], off + start))
    return items
