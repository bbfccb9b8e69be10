"""Verification of cached data: `cachefs-ctl verify`, and files about to be served by the
kernel (passthrough), which cannot be checked per read.

Reads the cache files in a worker thread, an extent batch at a time, and checks every
block with a known checksum (integrity.py); blocks without one are given one from the
file as it is now. Blocks that fail are handed to `Cache.damaged` (re-checked on the event
loop first, so a write racing the thread's read is not mistaken for damage): clean ones are
dropped, dirty ones reported and kept from BACKING. With `against_backing`, clean blocks
are also compared with BACKING's bytes; a difference is stale data and is dropped.

The scrub (`run_scrub`) is the same walk over everything, every `--scrub-interval`, at
`--scrub-rate`; the time of its last pass is kept in the store, so it runs across remounts.

Owns: `Verifier` (the walk, its counts and progress, the scrub, the background queue of
files waiting for verification before passthrough).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Awaitable, Callable

import trio

from . import backingpaths as bp
from .config import BLK_SIZE, EXT_SIZE
from .errors import CommandFailed
from .extents import BLK_SHIFT, BLKS_PER_EXT, EXT_SHIFT, CachedFile, runs
from .integrity import damaged_blocks

log = logging.getLogger("cachefs.verify")

BATCH_EXTENTS = 16              # extents read per thread call (1 MiB)
SCRUB_KEY = "scrub.last"        # meta: wall time the last scrub pass ended


def _extents_of(fd: int, exts: list[int]) -> dict[int, bytes]:
    out = {}
    for e in exts:
        data = os.pread(fd, EXT_SIZE, e << EXT_SHIFT)
        out[e] = data + bytes(EXT_SIZE - len(data))          # past the end: zeros
    return out


def _read_backing(root: int, path: bytes, ino: int, exts: list[int]) -> dict[int, bytes]:
    """The same extents of BACKING's file `ino` at `path` (thread); {} if it is not there."""
    try:
        fd = bp.open_at(root, path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return {}
        raise
    try:
        if os.fstat(fd).st_ino != ino:
            return {}
        return _extents_of(fd, exts)
    finally:
        os.close(fd)


def _clean_and_bad(cf: CachedFile) -> tuple[int, int]:
    """The file's clean valid blocks and its damaged dirty ones."""
    clean = bad = 0
    for x in cf.extents.values():
        clean += bin(x.valid & ~x.dirty).count("1")
        bad += bin(x.bad).count("1")
    return clean, bad


class Counts:
    def __init__(self):
        self.files = self.blocks = self.summed_now = self.clean_damaged = 0
        self.dirty_damaged = self.stale = self.bytes = 0

    def answer(self) -> dict:
        return {"files": self.files, "blocks_checked": self.blocks,
                "checksums_taken": self.summed_now, "damaged_clean_blocks": self.clean_damaged,
                "damaged_dirty_blocks": self.dirty_damaged, "stale_blocks": self.stale,
                "checked_bytes": self.bytes}


class Verifier:
    def __init__(self, cache, backing, stats):
        self._cache = cache                     # cache.Cache: damaged(), the state
        self._s = cache.state
        self._backing = backing
        self._stats = stats
        self._queue_send, self._queue_recv = trio.open_memory_channel(1024)
        self._queued: set[int] = set()

    # -- the command -----------------------------------------------------------------------

    async def verify(self, inos: list[int] | None, against_backing: bool,
                     progress: Callable[[dict], Awaitable[None]] | None) -> dict:
        """Check the cached blocks of files `inos` (all when None)."""
        files = [cf for cf in list(self._s.files.values())
                 if cf.extents and (inos is None or cf.ino in inos)]
        total = sum(bin(x.valid).count("1") for cf in files for x in cf.extents.values())
        counts = Counts()
        last = time.monotonic()
        for cf in files:
            await self.file(cf, counts, against_backing)
            if progress is not None and time.monotonic() - last > 0.5:
                last = time.monotonic()
                await progress({"done_bytes": counts.blocks * BLK_SIZE,
                                "total_bytes": total * BLK_SIZE})
        if progress is not None:
            await progress({"done_bytes": counts.blocks * BLK_SIZE,
                            "total_bytes": max(total, counts.blocks) * BLK_SIZE})
        await self._cache.persist()
        out = counts.answer()
        out["lost"] = self._s.status()["lost"]
        log.info("verify: %d files, %d blocks checked (%d given checksums), %d clean and %d "
                 "dirty blocks damaged, %d stale", counts.files, counts.blocks,
                 counts.summed_now, counts.clean_damaged, counts.dirty_damaged, counts.stale)
        return out

    async def file(self, cf: CachedFile, counts: Counts, against_backing: bool = False,
                   rate: int = 0) -> None:
        """Verify one file's cached blocks (see the module's docstring); `rate`: at most
        that many bytes a second (0: as fast as the SSD goes)."""
        counts.files += 1
        # The cache file the map speaks of, also when its name was removed behind the
        # daemon (read by name, a removed one was skipped and the file called sound).
        clean, bad = _clean_and_bad(cf)
        cfd = self._cache.cache_reader(cf)
        gone = _clean_and_bad(cf)               # (a removed one: its blocks were lost now)
        counts.clean_damaged += clean - gone[0]
        counts.dirty_damaged += gone[1] - bad
        try:
            await self._file(cf, cfd, counts, against_backing, rate)
        finally:
            os.close(cfd)

    async def _file(self, cf: CachedFile, cfd: int, counts: Counts, against_backing: bool,
                    rate: int) -> None:
        exts = sorted(cf.extents)
        for i in range(0, len(exts), BATCH_EXTENTS):
            batch = [e for e in exts[i:i + BATCH_EXTENTS] if e in cf.extents]
            if not batch:
                continue
            t0 = time.monotonic()
            seq = (cf.change_seq, cf.trunc_seq)
            valid = {e: cf.extents[e].valid for e in batch}
            data = await trio.to_thread.run_sync(_extents_of, cfd, batch)
            theirs = {}
            if against_backing and cf.path is not None:
                try:
                    theirs = await self._backing.read_call(
                        "read", _read_backing, self._backing.root_fd, cf.path, cf.ino, batch)
                except OSError as exc:
                    raise CommandFailed(f"cannot read {os.fsdecode(cf.path)} in BACKING: "
                                        f"{exc.strerror or exc}.") from None
            if self._s.files.get(cf.ino) is not cf:
                return                          # dropped meanwhile
            self._check(cf, valid, data, theirs if seq == (cf.change_seq, cf.trunc_seq)
                        else {}, counts)
            pause = len(batch) * EXT_SIZE / rate - (time.monotonic() - t0) if rate else 0
            await trio.sleep(max(0.0, pause))

    def _check(self, cf: CachedFile, valid: dict[int, int], data: dict[int, bytes],
               theirs: dict[int, bytes], counts: Counts) -> None:
        """On the event loop, with the bytes read in the thread (see verify); `valid`: the
        extents' valid blocks when the thread read them."""
        bad_offsets = []
        self._s.cachefiles.fd(cf)               # for checksums taken now (resum)
        for e, was in valid.items():
            x = cf.extents.get(e)
            if x is None or e not in data:
                continue
            base = e << EXT_SHIFT
            counts.blocks += bin(x.valid).count("1")
            counts.bytes += bin(x.valid).count("1") * BLK_SIZE
            self._stats.verified_blocks += bin(x.valid).count("1")
            wrong = damaged_blocks(x, data[e], base) & x.valid
            bad_offsets += [base + (b << BLK_SHIFT) for b in range(BLKS_PER_EXT)
                            if wrong >> b & 1]
            unknown = x.valid & ~x.summed & ~x.bad
            if unknown:
                self._s.map.fill(cf, x, unknown)     # a checksum from the file as it is now
                counts.summed_now += bin(unknown).count("1")
            mine, other = data[e], theirs.get(e)
            if other is not None:
                stale = 0
                clean = x.valid & was & ~x.dirty & ~wrong
                for b0, b1 in runs(clean):
                    for b in range(b0, b1):
                        s = b << BLK_SHIFT
                        if mine[s:s + BLK_SIZE] != other[s:s + BLK_SIZE] and \
                                base + s < cf.size:
                            stale |= 1 << b
                if stale:
                    self._stale(cf, x, stale, counts)
        self._s.cachefiles.close_idle(cf)
        if bad_offsets:
            before = self._stats.checksum_errors
            dirty = self._cache.damaged(cf, bad_offsets, "verify")
            counts.dirty_damaged += dirty
            counts.clean_damaged += self._stats.checksum_errors - before

    def _stale(self, cf: CachedFile, x, mask: int, counts: Counts) -> None:
        counts.stale += bin(mask).count("1")
        self._stats.drop_coherence += 1
        self._s.map.invalidate(cf, x, mask)
        # The kernel's page cache may hold the same stale bytes (read from the cache before):
        # dropped, or reads stayed wrong until the pages were evicted (a helper's hunt).
        self._cache.coherence.kernel_stale(cf)
        log.warning("verify: %d clean cached blocks of %s differ from BACKING at extent %d; "
                    "dropped (reason: coherence)", bin(mask).count("1"),
                    os.fsdecode(cf.path or b"?"), x.ext)

    # -- the scrub -------------------------------------------------------------------------

    async def run_scrub(self, interval_s: float, rate: int, *,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Every `interval_s` (counted across remounts: the store keeps when the last pass
        ended), check every cached block at `rate` bytes/s, so that hits do not notice."""
        task_status.started()
        if interval_s <= 0:
            return
        store = self._s.store
        last = store.meta_items(SCRUB_KEY).get(SCRUB_KEY)
        if last is None:                        # a new cache: the first pass one interval on
            last = time.time()
            store.queue_meta(SCRUB_KEY, repr(last))
        last = float(last)
        while True:
            await trio.sleep(max(0.0, last + interval_s - time.time()))
            counts = Counts()
            t0 = time.monotonic()
            for cf in list(self._s.files.values()):
                if cf.extents and self._s.files.get(cf.ino) is cf:
                    await self.file(cf, counts, rate=rate)
            last = time.time()
            store.queue_meta(SCRUB_KEY, repr(last))
            self._stats.scrubs += 1
            log.info("scrub: %d files, %d blocks checked in %.0f s (%d given checksums); %d "
                     "clean and %d dirty blocks damaged", counts.files, counts.blocks,
                     time.monotonic() - t0, counts.summed_now, counts.clean_damaged,
                     counts.dirty_damaged)

    # -- before passthrough ----------------------------------------------------------------

    def want(self, cf: CachedFile) -> None:
        """Verify a file loaded from an earlier mount before the kernel serves it itself
        (in the background: this open is served by the daemon, every read checked)."""
        if cf.ino in self._queued:
            return
        try:
            self._queue_send.send_nowait(cf)
        except trio.WouldBlock:
            return
        self._queued.add(cf.ino)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for cf in self._queue_recv:
            try:
                counts = Counts()
                await self.file(cf, counts)
                if not counts.clean_damaged and not counts.dirty_damaged and all(
                        x.summed == x.valid for x in cf.extents.values()):
                    cf.verified = True
                log.debug("inode %d verified for passthrough: %d blocks, %d damaged", cf.ino,
                          counts.blocks, counts.clean_damaged + counts.dirty_damaged)
            finally:
                self._queued.discard(cf.ino)
