"""Loading BACKING files into the pool on purpose (prefetch, pins, the pin keeper).

Owns `Loader`: files opened and revalidated against BACKING, their missing extents read in
large runs (`READ_EXTS`), files and reads in parallel (bounded), each extent installed as
hot data through `Cache.install_wanted`, which drops a chunk overtaken by a write or truncate
(`CachedFile.fills` is set before the read, as the read miss does). Room is made only by
evicting clean extents of unprotected files (`Cache.reserve`): when more would be needed,
loading stops and the `Job` says what did not fit. Progress goes to the control client.
"""

from __future__ import annotations

import dataclasses
import os
import stat as stat_mod
from typing import Awaitable, Callable

import trio

from . import backingpaths as bp
from .backing import Backing
from .cache import Cache
from .config import EXT_SIZE, format_size
from .extents import EXT_SHIFT, CachedFile, identity
from .stats import Stats

READ_EXTS = 32              # one BACKING read loads up to 2 MiB (32 extents)
PARALLEL_READS = 4          # prefetch reads in flight at once (BACKING has 16 threads)
FILES_AT_ONCE = 4           # files opened and loaded at once
REPORT_INTERVAL_S = 0.25    # progress lines to the client


def exts(size: int) -> int:
    return (size + EXT_SIZE - 1) >> EXT_SHIFT


@dataclasses.dataclass
class Target:
    rel: bytes
    path: bytes                 # BACKING path
    ino: int
    size: int


@dataclasses.dataclass
class Job:
    """Progress and outcome of one load (a prefetch, a pin, a keeper re-load)."""
    total: int = 0              # bytes of every target file
    cached: int = 0             # already valid in the cache
    loaded: int = 0             # read from BACKING and installed now
    missing: dict[bytes, int] = dataclasses.field(default_factory=dict)   # rel -> bytes
    full: bool = False          # stopped: only pinned, dirty or just-loaded data is left
    errors: list[str] = dataclasses.field(default_factory=list)
    overtaken: set[bytes] = dataclasses.field(default_factory=set)   # rels written meanwhile
    client_gone: bool = False

    def miss(self, t: Target, nbytes: int) -> None:
        self.missing[t.rel] = self.missing.get(t.rel, 0) + nbytes

    def missing_bytes(self) -> int:
        return sum(self.missing.values())

    def done_bytes(self) -> int:
        return self.cached + self.loaded + self.missing_bytes()


def _open_fstat(root: int, path: bytes) -> tuple[int, os.stat_result]:
    fd = bp.open_at(root, path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


class Loader:
    def __init__(self, cache: Cache, backing: Backing, stats: Stats,
                 show: Callable[[bytes], str]):
        self.cache = cache
        self.backing = backing
        self.stats = stats
        self._show = show                       # how a user names a file (Warm._show)
        self._reads = trio.CapacityLimiter(PARALLEL_READS)

    async def load(self, targets: list[Target],
                   progress: Callable[[dict], Awaitable[None]] | None) -> Job:
        """Load every target; files and reads in parallel (bounded). The caller protects
        the files from eviction meanwhile."""
        job = Job(total=sum(t.size for t in targets))
        async with trio.open_nursery() as outer:
            if progress is not None:
                outer.start_soon(self._report, job, progress, outer.cancel_scope)
            send, recv = trio.open_memory_channel[Target](0)
            async with trio.open_nursery() as workers:
                for _ in range(FILES_AT_ONCE):
                    workers.start_soon(self._worker, recv.clone(), job)
                await recv.aclose()
                async with send:
                    for t in targets:
                        await send.send(t)
            outer.cancel_scope.cancel()
        if job.client_gone:
            raise trio.BrokenResourceError("the control client went away")
        if progress is not None:
            try:
                await progress({"total_bytes": job.total, "done_bytes": job.done_bytes()})
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise trio.BrokenResourceError("the control client went away") from None
        return job

    async def _report(self, job: Job, progress: Callable[[dict], Awaitable[None]],
                      scope: trio.CancelScope) -> None:
        try:
            while True:
                await progress({"total_bytes": job.total, "done_bytes": job.done_bytes()})
                await trio.sleep(REPORT_INTERVAL_S)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            job.client_gone = True                  # Ctrl-C: stop loading
            scope.cancel()

    async def _worker(self, recv: trio.MemoryReceiveChannel, job: Job) -> None:
        async with recv:
            async for t in recv:
                if job.full:
                    job.miss(t, t.size)
                else:
                    await self._load_file(t, job)

    async def _load_file(self, t: Target, job: Job) -> None:
        """Open and revalidate one file against BACKING, then load its missing extents."""
        cache = self.cache
        token = cache.stat_token(t.ino)
        try:
            fd, st = await self.backing.read_call("open", _open_fstat, self.backing.root_fd,
                                                  t.path)
        except OSError as exc:
            job.errors.append(f"{self._show(t.rel)}: {exc.strerror or exc}")
            job.miss(t, t.size)
            return
        try:
            if st.st_ino != t.ino or not stat_mod.S_ISREG(st.st_mode) or not st.st_nlink:
                job.errors.append(f"{self._show(t.rel)}: replaced while loading")
                job.miss(t, t.size)
                return
            job.total += st.st_size - t.size
            t.size = size = st.st_size
            cf = cache.file_state(t.ino)
            if cf.identity is None:
                cache.revalidate(cf, st, token)
            else:                   # drops stale data (and the kernel's pages) if changed
                cache.attributes_seen(t.ino, st, token)
            cf.path = t.path
            limit = cf.held_limit()
            if limit is not None and size > limit:
                # Read in passthrough, and its cache file stopped growing there (heldwrites.
                # _freeze): the rest is BACKING's alone while it is held (a refresh before
                # an open read all of a large file for nothing, every install refused).
                job.miss(t, size - limit)
                job.errors.append(f"{self._show(t.rel)}: read in passthrough and grown past "
                                  f"the room for it in the cache; its last "
                                  f"{format_size(size - limit)} stay on BACKING while it "
                                  "is held")
                t.size = size = limit
            runs: list[list[int]] = []
            for e in range(exts(size)):
                base = e << EXT_SHIFT
                end = min(size, base + EXT_SIZE)
                if cf.all_valid(base, end):
                    job.cached += end - base
                elif runs and runs[-1][-1] == e - 1 and len(runs[-1]) < READ_EXTS:
                    runs[-1].append(e)
                else:
                    runs.append([e])
            async with trio.open_nursery() as nursery:
                for run in runs:
                    nursery.start_soon(self._load_run, cf, st, fd, run, t, job)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.backing.write_call(os.close, fd)
                except OSError:
                    pass                            # read-only: nothing was to be flushed

    async def _load_run(self, cf: CachedFile, st: os.stat_result, fd: int, run: list[int],
                        t: Target, job: Job) -> None:
        """One large BACKING read of consecutive extents, installed one by one."""
        size = t.size

        def nbytes(e: int) -> int:
            return max(0, min(size, (e + 1) << EXT_SHIFT) - (e << EXT_SHIFT))

        async with self._reads:
            if job.full:
                job.miss(t, sum(nbytes(e) for e in run))
                return
            cache = self.cache
            if cache.files.get(t.ino) is not cf:
                # Forgotten meanwhile: unused and empty, or removed (its last name gone), also
                # while this run waited for its slot. A removed file's state is not made
                # again: BACKING would give its number to the next new file, whose first open
                # would take the old bytes for a change behind us. (A removal after this
                # check finds the state made here and discards it.)
                try:
                    gone = (await self.backing.read_call("open", os.fstat, fd)).st_nlink == 0
                except OSError:
                    gone = True
                if gone:
                    job.miss(t, sum(nbytes(e) for e in run))
                    return
            if cache.files.get(t.ino) is not cf:
                cf = cache.file_state(t.ino)
                if cf.identity is None:
                    cache.revalidate(cf, st)
                elif cf.identity != identity(st):   # and opened again, with newer data
                    job.miss(t, sum(nbytes(e) for e in run))
                    job.overtaken.add(t.rel)
                    return
            exts = []
            for e in run:
                if e in cf.fills:           # a promotion is loading it already
                    job.cached += nbytes(e)
                else:
                    exts.append(e)
            if not exts:
                return
            if not cache.reserve(sum(1 for e in exts if e not in cf.extents)):
                job.full = True
                job.miss(t, sum(nbytes(e) for e in exts))
                return
            for e in exts:
                cf.fills[e] = False             # a write or truncate from now on overtakes us
            start = exts[0] << EXT_SHIFT
            try:
                data = await self.backing.pread(fd, min(size, (exts[-1] + 1) << EXT_SHIFT)
                                                - start, start)
            except BaseException as exc:
                for e in exts:
                    cf.fills.pop(e, None)
                if not isinstance(exc, OSError):
                    raise
                job.errors.append(f"{self._show(t.rel)}: {exc.strerror or exc}")
                job.miss(t, sum(nbytes(e) for e in exts))
                return
        self.stats.backing_read_ops += 1
        self.stats.backing_read_bytes += len(data)
        for e in exts:
            lo = (e << EXT_SHIFT) - start
            chunk = data[lo:lo + EXT_SIZE]
            if not chunk:                       # BACKING is shorter now
                cf.fills.pop(e, None)
                continue
            if e not in cf.extents and not cache.reserve(1):
                cf.fills.pop(e, None)
                job.full = True
                job.miss(t, len(chunk))
                continue
            if cache.install_wanted(cf, e, chunk):
                job.loaded += len(chunk)
                self.stats.prefetched_bytes += len(chunk)
            else:                               # overtaken by a write, or the SSD failed
                job.miss(t, len(chunk))
                job.overtaken.add(t.rel)
