"""The engine between unit tests and real mounts (issue 15): the real `Cache` (extent map,
store, cache files, persister, destager) over temporary directories, with a BACKING whose
calls run on the event loop with a scripted delay, so each test places one interleaving
exactly: a write during a hole punch, a promotion overtaken by a destage and an eviction, a
miss whose BACKING read races a destage. Every test checks real bytes and, at the end, every
invariant of the extent map (`ExtentMap.check`)."""

from __future__ import annotations

import errno
import os
import time

import pytest
import trio
import trio.testing

from cachefs.backing import Backing
from cachefs.backingpaths import open_root
from cachefs.cache import Cache
from cachefs.config import Config
from cachefs.stats import Stats
from cachefs.store import MetadataStore

EXT = 64 << 10
BLK = 4096


class DelayedBacking(Backing):
    """BACKING on a local directory whose calls run on the event loop: the call itself at
    once, its result delivered `delay_s` later (a read returns what BACKING held when it ran,
    as a slow disk's does), so a test decides what happens in between."""

    def __init__(self, root: str):
        super().__init__(4, 60.0, open_root(root))
        self.delay_s = 0.0

    async def read_call(self, what, fn, *args):
        result = fn(*args)
        await trio.sleep(self.delay_s)
        return result

    async def write_call(self, fn, *args, abandon_on_cancel=False):
        result = fn(*args)
        await trio.sleep(0)
        return result


class Engine:
    """A write-back engine over tmp_path/backing with a pool of `pool_exts` extents."""

    def __init__(self, tmp_path, pool_exts: int, mode: str = "write-back"):
        self.backing_dir = tmp_path / "backing"
        cache_dir = tmp_path / "cache"
        self.backing_dir.mkdir()
        cache_dir.mkdir()
        self.cfg = Config(backing=str(self.backing_dir), mountpoint=str(tmp_path / "mnt"),
                          cache_dir=str(cache_dir), mode=mode, cache_size=pool_exts * EXT,
                          dirty_high=1 << 30, dirty_low=1 << 30, max_dirty_age_s=1000.0,
                          check_invariants=True)
        self.backing = DelayedBacking(str(self.backing_dir))
        self.store = MetadataStore(str(cache_dir))
        self.store.open(str(self.backing_dir), os.fstat(self.backing.root_fd))
        self.cache = Cache(self.cfg, self.store, self.backing, Stats(), pool_exts)
        self.cache.load(True)
        self._fh = 0

    def make_file(self, name: str, data: bytes) -> None:
        (self.backing_dir / name).write_bytes(data)

    async def open(self, name: str):
        self._fh += 1
        ino = os.stat(self.backing_dir / name).st_ino
        of, _ = await self.cache.open(self._fh, ino, name.encode(), os.O_RDWR)
        return of

    def cached(self, of, off: int, size: int) -> bytes | None:
        """What a hit answers now (None: not all cached)."""
        return of.read_hit(off, size)

    def close(self) -> None:
        self.cache.state.map.check()
        self.store.close(clean=True)
        os.close(self.backing.root_fd)


@pytest.fixture
def engine(tmp_path):
    made = []

    def make(pool_exts: int, mode: str = "write-back") -> Engine:
        e = Engine(tmp_path, pool_exts, mode)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


async def test_a_write_into_an_extent_whose_hole_is_being_punched_keeps_its_bytes(engine):
    """The data loss of issue 15: extent 0 is evicted; the persister commits and punches its
    hole in a thread; a write-back write of extent 0 arrives while the thread runs. Before
    the fix the write landed, was acknowledged, then the punch zeroed it (a hit served
    zeros, and the destager copied them to BACKING)."""
    eng = engine(pool_exts=4)
    eng.make_file("f", os.urandom(8 * EXT))
    of = await eng.open("f")
    state = eng.cache.state
    cf = of.cfile
    cf.fills[0] = False                                # a promotion of extent 0
    assert state.install(cf, 0, os.pread(of.backing_fd, EXT, 0))
    state.evict(cf, cf.extents[0])                       # its hole is released after a commit
    new = os.urandom(BLK)
    acked = trio.Event()
    real_punch = eng.cache.cachefiles.punch_holes

    async with trio.open_nursery() as nursery:
        async def write():
            await eng.cache.write(of, 0, new)
            acked.set()

        def punch_with_a_write_arriving(keys):         # runs in the persister's thread
            assert (cf.ino, 0) in keys
            trio.from_thread.run_sync(nursery.start_soon, write)
            time.sleep(0.2)                             # the write has all the time it needs
            real_punch(keys)

        eng.cache.cachefiles.punch_holes = punch_with_a_write_arriving
        await eng.cache.persist()
        await acked.wait()
    assert eng.cached(of, 0, BLK) == new
    assert os.pread(eng.cache.cachefiles.fd(cf), BLK, 0) == new
    assert eng.cache.stats.punch_waits == 1
    eng.cache.release(of)


async def test_a_promotion_read_before_a_destage_is_not_installed_after_an_eviction(engine):
    """A promotion of extent 0 reads BACKING (old bytes of block 0, dirty in the cache);
    before it is installed, block 0 is destaged (clean) and the extent evicted. Installing
    the chunk then would bring the old block 0 back as valid (I7)."""
    eng = engine(pool_exts=4)
    old = os.urandom(2 * EXT)
    eng.make_file("f", old)
    of = await eng.open("f")
    cf = of.cfile
    new = os.urandom(BLK)
    await eng.cache.write(of, 0, new)                  # block 0 dirty, extent 0 partly valid
    eng.backing.delay_s = 1.0
    async with trio.open_nursery() as nursery:
        await nursery.start(eng.cache.run_promoter)
        nursery.start_soon(eng.cache.read_miss, of, 2 * BLK, BLK)   # promotes extent 0
        await trio.testing.wait_all_tasks_blocked()
        assert 0 in cf.fills                         # its BACKING read has run (old bytes)
        eng.backing.delay_s = 0.0
        await eng.cache.destager._destage(cf, 0)     # BACKING has the new block 0 now
        assert not cf.dirty_exts
        eng.cache.state.evict(cf, cf.extents[0])
        await trio.sleep(2)                          # the read returns, the promoter runs
        nursery.cancel_scope.cancel()
    hit = eng.cached(of, 0, BLK)
    assert hit in (None, new), "the promotion brought back block 0 as it was before the write"
    assert (eng.backing_dir / "f").read_bytes()[:BLK] == new
    eng.cache.release(of)


async def test_a_miss_racing_the_destage_of_a_dirty_block_in_its_range_is_not_stale(engine):
    """A read of blocks 0-1 misses (block 1 is not cached); block 0 is dirty. BACKING's read
    sees the old block 0; while it is on its way, block 0 is destaged and its extent
    evicted, so when the read returns nothing says block 0 was newer than what was read. The
    answer must still be the acknowledged write (I8)."""
    eng = engine(pool_exts=4)
    eng.make_file("f", os.urandom(2 * EXT))
    of = await eng.open("f")
    cf = of.cfile
    new = os.urandom(BLK)
    await eng.cache.write(of, 0, new)
    eng.backing.delay_s = 1.0
    got = []
    async with trio.open_nursery() as nursery:
        async def read():
            got.append(await eng.cache.read_miss(of, 0, 2 * BLK))
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        eng.backing.delay_s = 0.0
        await eng.cache.destager._destage(cf, 0)
        eng.cache.state.evict(cf, cf.extents[0])
    assert got[0][:BLK] == new, "the read answered block 0 as it was before the write"
    assert eng.cache.stats.overlay_rereads == 1
    eng.cache.release(of)


async def test_a_file_removed_while_a_prefetch_waits_for_a_read_slot_gets_no_cache_state(engine):
    """A prefetch of a 10 MiB file has 5 BACKING reads of 2 MiB, 4 at once: the fifth waits
    for a slot. The file is renamed over (its last name gone) while the first four read.
    Before the fix the fifth, checked before it waited, made the removed file's state
    again and cached its last 2 MiB for good: space of a file nobody can open, and a false
    'changed behind the cache' once BACKING gives the number to a new file."""
    from cachefs.loader import PARALLEL_READS, READ_EXTS, Job, Loader, Target
    eng = engine(pool_exts=256, mode="write-through")
    runs = PARALLEL_READS + 1
    eng.make_file("f", os.urandom(runs * READ_EXTS * EXT))
    ino = os.stat(eng.backing_dir / "f").st_ino
    eng.backing.inline = False
    eng.backing.delay_s = 0.3
    loader = Loader(eng.cache, eng.backing, eng.cache.stats, lambda rel: rel.decode())
    target = Target(b"f", b"f", ino, runs * READ_EXTS * EXT)
    job = Job()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(loader._load_file, target, job)
        await trio.sleep(0.4)                           # opened; the first four reads run
        assert eng.cache.files[ino].fills
        eng.make_file("g", b"new")
        os.rename(eng.backing_dir / "g", eng.backing_dir / "f")
        eng.cache.last_link_removed(ino)
    assert ino not in eng.cache.files
    assert len(eng.cache.state.pool) == 0 and eng.cache.state.used_bytes() == 0
    assert job.loaded == 0


async def test_an_unexpected_error_in_a_read_fails_that_read_not_the_mount(engine):
    """Only FUSEError may leave a pyfuse3 handler: anything else ends its main loop, and
    the mount with it (a read racing a truncate did, test_read_vs_shrink.py). A bug in the
    read path now fails the read with EIO, counted and logged with its traceback."""
    import errno as errno_mod

    import pyfuse3

    from cachefs.fs import Operations
    from cachefs.inodes import InodeTable

    eng = engine(pool_exts=4, mode="write-through")
    eng.make_file("f", os.urandom(2 * EXT))
    of = await eng.open("f")
    ops = Operations(eng.cfg, eng.cache, InodeTable(os.fstat(eng.backing.root_fd)), "/nowhere")
    ops._open[of.fh] = of

    async def broken(*args):
        raise ValueError("negative count")

    eng.cache.read_miss = broken
    with pytest.raises(pyfuse3.FUSEError) as err:
        await ops.read(of.fh, 0, BLK)
    assert err.value.errno == errno_mod.EIO
    assert of.stats.internal_errors == 1


async def test_a_write_past_the_end_of_a_held_file_waits_for_holes_punched_meanwhile(engine):
    """A held file (the kernel reads its cache file itself, passthrough) grows by a write
    past its end: the gap gets zero blocks in the map and the cache file. While BACKING
    wrote, a commit started punching the hole of an extent of that gap (removed earlier by
    a truncate). The gap's extent was added regardless: InvariantError, and the daemon died
    (a helper's race hunt: truncates, a shared mapping and writes past the end)."""
    from cachefs.openmode import Held

    eng = engine(pool_exts=8, mode="write-through")
    eng.make_file("f", os.urandom(EXT))
    of = await eng.open("f")
    cf = of.cfile
    cf.held = Held(cf)
    persister = eng.cache.persister
    real_write = eng.backing.write_call
    gap_ext = 2                                     # the write lands in extent 4

    async def write_call(fn, *args, **kw):
        result = await real_write(fn, *args, **kw)
        if fn.__name__ == "_pwrite_stat":           # a commit starts punching extent 2
            persister._punching = {(cf.ino, gap_ext)}
            persister._punched = trio.Event()

            async def punched():
                await trio.sleep(0.05)
                persister._punching = set()
                persister._punched.set()
            nursery.start_soon(punched)
        return result

    eng.backing.write_call = write_call
    data = os.urandom(BLK)
    async with trio.open_nursery() as nursery:
        assert await eng.cache.write(of, 4 * EXT, data) == BLK
    eng.backing.write_call = real_write
    assert cf.size == 4 * EXT + BLK
    assert eng.cached(of, 4 * EXT, BLK) == data
    assert eng.cached(of, gap_ext * EXT, BLK) == bytes(BLK)      # the gap: zeros, valid
    assert (eng.backing_dir / "f").read_bytes()[4 * EXT:] == data
    cf.held = None


def test_a_cache_filesystem_that_stays_full_logs_the_shrinking_once_a_minute(
        engine, monkeypatch, caplog):
    """While the cache filesystem stays full, the pool shrinks at every out-of-space event
    (at most every SSD_FULL_HOLD_S): the WARNING came each time, every 2 s (a helper's run:
    18 lines in 40 s, on the full filesystem that holds the log)."""
    import logging
    import time as time_mod

    from cachefs.state import SSD_FULL_HOLD_S
    eng = engine(pool_exts=64)
    state = eng.cache.state
    now = [time_mod.monotonic()]
    monkeypatch.setattr("cachefs.state.time.monotonic", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="cachefs"):
        for _ in range(40):                     # 40 events, 2.5 s apart: 100 s
            state.out_of_space()
            now[0] += SSD_FULL_HOLD_S + 0.5
    lines = [r for r in caplog.records if "pool shrunk" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    assert eng.cache.stats.cache_full_events == 40


async def test_a_write_around_over_an_extent_the_database_still_calls_dirty_waits_for_it(
        engine):
    """Commits fail (a full cache filesystem); extent 0, dirty in the database, is destaged
    and evicted in memory only. A write around the cache then put newer bytes in BACKING
    while the database still called extent 0 dirty with the cache file's older bytes: after
    an unclean stop, recovery destaged those over the newer ones (a helper's run: 24 MiB of
    writes reverted). The write around now waits for the database to learn (EIO while it
    cannot), and recovery has nothing stale to destage."""
    import sqlite3
    from cachefs.store import _read_tables

    eng = engine(pool_exts=4)
    eng.make_file("f", bytes(4 * EXT))
    of = await eng.open("f")
    cf = of.cfile
    v1, v2 = os.urandom(EXT), os.urandom(EXT)
    assert await eng.cache.write(of, 0, v1) == EXT
    await eng.cache.persist(durable=True)                    # the database: 0 is dirty
    real_commit = eng.store.commit_async

    async def failing(batch, durable):
        raise sqlite3.OperationalError("disk I/O error")
    eng.store.commit_async = failing
    await eng.cache.destager._destage(cf, 0)                 # BACKING: v1, memory: clean
    x = cf.extents[0]
    assert not x.dirty
    eng.cache.state.evict(cf, x)
    with pytest.raises(OSError):
        await eng.cache.writes._write_around(of, 0, v2)
    assert (eng.backing_dir / "f").read_bytes()[:EXT] == v1  # nothing went around
    eng.store.commit_async = real_commit
    assert await eng.cache.writes._write_around(of, 0, v2) == EXT
    assert (eng.backing_dir / "f").read_bytes()[:EXT] == v2
    _, extents = _read_tables(eng.store._db)
    assert not [e for e in extents if e[1] == 0 and e[3]], extents   # no stale dirty mark


async def test_a_held_write_cancelled_after_its_reservation_gives_the_room_back(engine):
    """A write to a held file reserves its room in the cache file first (fallocate, the
    size kept), then may wait (here for a hole being punched). Cancelled there (an unmount,
    an interrupted writer), it left the reserved blocks past the cache file's end, where no
    eviction or punch reaches them: SSD space lost for as long as the file stayed cached."""
    from cachefs.openmode import Held

    eng = engine(pool_exts=128)
    eng.make_file("f", bytes(EXT))
    of = await eng.open("f")
    data = os.urandom(EXT)
    assert await eng.cache.write(of, 0, data) == EXT     # all of it in the cache (dirty)
    cf = of.cfile
    cf.held = Held(cf)
    fd = eng.cache.cachefiles.fd(cf)
    before = os.fstat(fd).st_blocks
    persister = eng.cache.persister
    persister._punching = {(cf.ino, 1)}          # a commit punches extent 1: the write waits
    persister._punched = trio.Event()
    with trio.move_on_after(0.1) as scope:
        await eng.cache.write(of, 4 * EXT, os.urandom(4 << 20))
    assert scope.cancelled_caught
    persister._punching = set()
    persister._punched.set()
    assert cf.size == EXT and os.fstat(fd).st_size == EXT
    assert os.fstat(fd).st_blocks <= before, (os.fstat(fd).st_blocks, before)
    assert eng.cached(of, 0, EXT) == data
    cf.held = None


async def test_an_open_that_fails_after_its_handle_was_made_lets_it_go(engine):
    """An open whose last step fails (the commit a durable answer waits for, on a failing
    SSD; a refresh or a baseline cancelled at the unmount) is never answered, so no release
    will come for it: the handle, its BACKING descriptors and what the open mode counted
    (a passthrough open holds its file and backing id) used to stay for the mount's life."""
    import types

    from cachefs.fs import Operations
    from cachefs.inodes import InodeTable
    eng = engine(pool_exts=4, mode="write-through")
    eng.make_file("f", os.urandom(EXT))
    ino = os.stat(eng.backing_dir / "f").st_ino
    ops = Operations(eng.cfg, eng.cache, InodeTable(os.fstat(eng.backing.root_fd)), "/nowhere")
    released = []
    real_release = ops._modes.release
    ops._modes.release = lambda of: (released.append(of.fh), real_release(of))

    real_answer = ops._modes.answer

    def answer(of, keep):
        a = real_answer(of, keep)
        a.durable = True            # as for an O_RDWR open that may map a held file
        return a

    async def failing_commit(durable=False):
        raise OSError(errno.EIO, "the cache's metadata could not be committed")

    ops._modes.answer = answer
    eng.cache.persist = failing_commit
    ctx = types.SimpleNamespace(pid=os.getpid(), uid=0, gid=0)
    with pytest.raises(OSError):
        await ops._open_file(ino, b"f", os.O_RDONLY, ctx, True)
    assert not ops._open and not ops._fds.has(ino)
    assert len(released) == 1 and not ops._modes._plain
