"""The engine's separable parts, without FUSE: the dirty index, coherence decisions (which
stat is older, merging our own changes), the order of persistence (fake store and cache
files), and destage planning (coalescing, clipping)."""

from __future__ import annotations

import errno
import os
import sqlite3

import pytest
import trio

from cachefs.coherence import Coherence, older
from cachefs.dirty import DirtyIndex
from cachefs.extents import EXT_SHIFT, CachedFile, Extent, block_mask
from cachefs.persist import Persister
from cachefs.stats import Stats
from cachefs.writeback import MERGE_GAP, plan_destage

BLK = 4096
EXT = 64 << 10


# -- the dirty index ------------------------------------------------------------------------

def test_dirty_index_counts_blocks_and_keeps_the_oldest_first():
    d = DirtyIndex()
    cf = CachedFile(1)
    a, b = Extent(1, 0), Extent(1, 3)
    d.set(cf, b, 0b11)
    d.set(cf, a, 0b1)
    d.set(cf, b, 0b110)                 # one new block; b keeps its place (dirty since first)
    assert list(d) == [(1, 3), (1, 0)]
    assert (d.blocks, d.bytes(), cf.dirty_exts, b.dirty) == (4, 4 * BLK, 2, 0b111)
    d.clear(cf, b, 0b1)
    assert (d.blocks, b.dirty, cf.dirty_exts) == (3, 0b110, 2)
    d.clear(cf, b, 0b110 | 0b1000)      # blocks that were not dirty do not count
    assert (d.blocks, len(d), cf.dirty_exts, (1, 3) in d) == (1, 1, 1, False)
    d.clear(cf, a, a.dirty)
    assert (d.blocks, len(d), cf.dirty_exts, d.oldest_age_s()) == (0, 0, 0, 0.0)


def test_restamp_ages_what_a_destage_pass_left_dirty_from_its_snapshot(monkeypatch):
    """Blocks still dirty after a destage pass were written after its snapshot: the extent
    ages from the snapshot, not from when it first turned dirty (otherwise an extent
    rewritten during every pass looks ever older and is destaged over and over)."""
    now = [0.0]
    monkeypatch.setattr("cachefs.dirty.time.monotonic", lambda: now[0])
    d = DirtyIndex()
    cf = CachedFile(1)
    a, b, c = Extent(1, 0), Extent(1, 1), Extent(1, 2)
    d.set(cf, a, 1)                                  # t=0
    now[0] = 1.0
    d.set(cf, b, 1)                                  # t=1
    now[0] = 3.0
    d.set(cf, c, 1)                                  # t=3, after the snapshot at t=2
    now[0] = 10.0
    assert d.oldest_age_s() == 10.0
    d.restamp([a.key, c.key, (1, 9)], 2.0)           # c is newer, (1, 9) is not dirty
    assert list(d) == [b.key, a.key, c.key]          # still oldest first
    assert d.oldest_age_s() == 9.0                   # b, dirty since t=1
    d.clear(cf, b, 1)
    assert d.oldest_age_s() == 8.0                   # a, from the snapshot at t=2
    d.clear(cf, a, 1)
    assert d.oldest_age_s() == 7.0                   # c kept its own time


async def test_dirty_index_events_wake_waiters_and_time_out(autojump_clock):
    d = DirtyIndex()
    cf, x = CachedFile(1), Extent(1, 0)
    t0 = trio.current_time()
    await d.wait_dirtied(5)                          # nothing happens: the timeout
    assert trio.current_time() - t0 == pytest.approx(5)
    async with trio.open_nursery() as nursery:
        async def dirty_later():
            await trio.sleep(1)
            d.set(cf, x, 1)
        nursery.start_soon(dirty_later)
        t0 = trio.current_time()
        await d.wait_dirtied(60)
        assert trio.current_time() - t0 == pytest.approx(1)

        async def clean_later():
            await trio.sleep(2)
            d.clear(cf, x, 1)
        nursery.start_soon(clean_later)
        t0 = trio.current_time()
        await d.wait_cleaned(60)
        assert trio.current_time() - t0 == pytest.approx(2)
    assert d.oldest_age_s() == 0.0


# -- coherence decisions ----------------------------------------------------------------------

def test_older_orders_by_ctime_then_mtime_then_size():
    base = (7, 100, 10, 20)                          # (ino, size, mtime_ns, ctime_ns)
    assert older(base, (7, 100, 10, 21))             # later ctime
    assert not older((7, 100, 10, 21), base)
    assert older(base, (7, 50, 11, 20))              # same ctime, later mtime (size ignored)
    assert older(base, (7, 101, 10, 20))             # same times: a write only grows a file
    assert not older((7, 101, 10, 20), base)
    assert not older(base, (7, 101, 10, 20), size_counts=False)   # truncate: exact size
    assert not older(base, base)


class FakeState:
    """What Coherence uses of the cache state, recording identity writes and drops."""

    def __init__(self):
        self.files: dict[int, CachedFile] = {}
        self.stats = Stats()
        self.store = self                # queue_extent, queue_file: not recorded
        self.map = self                  # the extent map's verbs it calls
        self.persisted: list[tuple] = []
        self.dropped: list[int] = []

    def queue_extent(self, *args):
        pass

    def persist_identity(self, cf):
        self.persisted.append(cf.identity)

    def drop_file(self, cf):
        self.dropped.append(cf.ino)
        cf.extents.clear()

    def remove(self, cf, x):
        del cf.extents[x.ext]

    def invalidate(self, cf, x, mask):
        x.valid &= ~(mask & ~x.dirty)


def _st(ino, size, mtime_ns, ctime_ns):
    return os.stat_result((0o100644, ino, 0, 1, 0, 0, size, 0, 0, 0, 0, 0, 0, 0,
                           mtime_ns, ctime_ns))


def _coherent_file(state, ident):
    cf = state.files[ident[0]] = CachedFile(ident[0], ident)
    cf.extents[0] = Extent(ident[0], 0, valid=1)
    return cf


def test_own_changes_arriving_out_of_order_only_move_the_identity_forward():
    state = FakeState()
    coh = Coherence(state)
    cf = _coherent_file(state, (7, 100, 10, 10))
    cf.writes_inflight = 2                           # two own writes in flight
    coh.own_change(cf, _st(7, 300, 30, 30), size_exact=False)     # the later one first
    coh.own_change(cf, _st(7, 200, 20, 20), size_exact=False)     # then the earlier one
    assert cf.identity == (7, 300, 30, 30)
    assert cf.size == 300
    assert state.persisted == [(7, 300, 30, 30)]
    # A stat taken before our own change is not a change behind our back...
    token = coh.stat_token(7)
    coh.own_change(cf, _st(7, 400, 40, 40), size_exact=False)
    cf.writes_inflight = 0
    assert coh.revalidate(cf, _st(7, 300, 30, 30), token)
    assert state.dropped == []
    # ...but one taken after it, that differs, is: the clean data goes.
    assert not coh.revalidate(cf, _st(7, 400, 41, 41), coh.stat_token(7))
    assert state.dropped == [7]


def test_own_metadata_change_adopts_only_a_ctime_move():
    state = FakeState()
    coh = Coherence(state)
    cf = _coherent_file(state, (7, 100, 10, 10))
    coh.own_metadata_change(7, _st(7, 100, 10, 11))          # chmod: ctime moved
    assert cf.identity == (7, 100, 10, 11)
    coh.own_metadata_change(7, _st(7, 100, 12, 13))          # mtime moved: not ours
    assert cf.identity == (7, 100, 10, 11)
    assert not coh.revalidate(cf, _st(7, 100, 12, 13))       # the next revalidation sees it
    assert state.dropped == [7]


def test_revalidate_keeps_dirty_blocks_on_a_conflict():
    state = FakeState()
    coh = Coherence(state)
    cf = _coherent_file(state, (7, 100, 10, 10))
    dirty = cf.extents[1] = Extent(7, 1, valid=0b11, dirty=0b01)
    cf.dirty_exts = 1
    assert not coh.revalidate(cf, _st(7, 100, 20, 20))
    assert state.stats.conflicts == 1
    assert list(cf.extents) == [1] and dirty.valid == 0b01      # the clean ones dropped


# -- persistence order -------------------------------------------------------------------------

class FakeStore:
    """Records what happens in which order; commits fail while `fail` is set."""

    def __init__(self, log):
        self.log = log
        self.queued: list = []
        self.fail: Exception | None = None
        self.requeued: list = []
        self.commits = 0

    def pending(self):
        return len(self.queued)

    def take_batch(self):
        batch, self.queued = list(self.queued), []
        self.log.append(("take", tuple(batch)))
        return batch

    async def commit_async(self, batch, durable):
        await trio.sleep(1)                          # an fsync's worth of time
        if self.fail is not None:
            self.log.append(("commit failed", tuple(batch)))
            raise self.fail
        self.commits += 1
        self.log.append(("commit", tuple(batch), durable))
        return 0                                     # rows left out

    def requeue(self, batch):
        self.requeued.append(batch)
        self.queued = batch + self.queued

    def release_reserve(self):
        return False

    def ensure_reserve(self):
        return True

    @property
    def journal(self):
        return self

    def append(self, ino, ext):                     # the doubt journal's
        self.log.append(("journal", ino, ext))


class FakeFiles:
    def __init__(self, log):
        self.log = log

    def path(self, ino):
        return f"/nonexistent/{ino}"

    def punch_holes(self, keys):
        self.log.append(("punch", tuple(sorted(keys))))


class FakeSpace:
    def __init__(self, log):
        self.log = log

    def ssd_failed(self, exc, what):
        self.log.append(("ssd failed", what))

    def out_of_space(self):
        self.log.append(("out of space",))

    def reserve_given_up(self):
        pass

    def check_room(self):
        pass

    def committed(self, batch):
        pass

    def space_released(self):
        pass

    def regrow_pool(self):
        pass


def _persister():
    log: list = []
    store = FakeStore(log)
    return Persister(store, FakeFiles(log), Stats(), FakeSpace(log), 1.0), store, log


async def test_batches_commit_in_the_order_taken_and_holes_go_after_their_commit(
        autojump_clock):
    p, store, log = _persister()
    store.queued = ["a"]
    p.evicted((1, 0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(p.persist)
        await trio.sleep(0.5)                        # the first commit is in flight
        store.queued.append("b")
        p.evicted((1, 1))
        nursery.start_soon(p.persist, True)
    assert [e for e in log if e[0] != "journal"] == [
        ("take", ("a",)), ("commit", ("a",), True), ("punch", ((1, 0),)),
        ("take", ("b",)), ("commit", ("b",), True), ("punch", ((1, 1),))]


async def test_a_batch_taken_is_committed_even_when_its_caller_is_cancelled(autojump_clock):
    """A persist cancelled mid-commit (the unmount cancelling the periodic commit, a flush
    with --timeout) must not lose its batch: the drops in it would never reach the database
    while the next persist punched their holes (valid rows over holes at the next mount,
    found by the random-operation test), and dirty marks in it would be forgotten."""
    p, store, log = _persister()
    store.queued = ["drop extent (1, 0)"]
    p.evicted((1, 0))
    with trio.move_on_after(0.5):                    # cancelled while its commit runs
        await p.persist()
    await p.persist(durable=True)                    # the shutdown's last commit
    events = [e for e in log if e[0] != "journal"]
    assert ("commit", ("drop extent (1, 0)",), True) in events, events
    assert events.index(("punch", ((1, 0),))) > events.index(
        ("commit", ("drop extent (1, 0)",), True)), events


async def test_a_failed_commit_is_requeued_and_its_holes_wait(autojump_clock):
    p, store, log = _persister()
    store.queued = ["a"]
    p.evicted((2, 5))
    store.fail = sqlite3.OperationalError("disk I/O error")
    await p.persist()                                # not durable: logged, queued again
    assert store.requeued == [["a"]] and store.queued == ["a"]
    assert not any(e[0] == "punch" for e in log)
    with pytest.raises(OSError) as info:             # durable: the caller learns it
        await p.persist(durable=True)
    assert info.value.errno == errno.EIO
    store.fail = None
    await p.persist()
    assert log[-2:] == [("commit", ("a",), True), ("punch", ((2, 5),))]
    assert p.punching((2, 5)) is False


async def test_a_reused_extent_is_not_punched(autojump_clock):
    p, store, log = _persister()
    p.evicted((3, 1))
    p.evicted((3, 2))
    p.reused((3, 1))                                 # cached again before the commit
    await p.persist()
    assert ("punch", ((3, 2),)) in log and ("punch", ((3, 1),)) not in log


def test_journal_once_per_batch():
    p, store, log = _persister()
    p.journal_dirtying((4, 0))
    p.journal_dirtying((4, 0))
    p.journal_dirtying((4, 1))
    assert [e for e in log if e[0] == "journal"] == [("journal", 4, 0), ("journal", 4, 1)]


# -- destage planning ----------------------------------------------------------------------------

def _file(size, extents):
    cf = CachedFile(9, (9, size, 0, 0))
    cf.size = size
    for e, (valid, dirty) in extents.items():
        cf.extents[e] = Extent(9, e, valid, dirty)
    return cf


def _blocks(*bs):
    m = 0
    for b in bs:
        m |= 1 << b
    return m


def test_plan_coalesces_across_short_clean_gaps_only():
    full = block_mask(0, EXT)
    cf = _file(4 * EXT, {
        0: (full, _blocks(0, 1)),                   # dirty 0-8K, then clean valid blocks
        1: (full, _blocks(0)),                      # a gap of 56 KiB of valid data: bridged
        3: (_blocks(0, 1), _blocks(1)),             # extent 2 not cached: not bridged
    })
    cf.extents[0].redirty = _blocks(0)
    plan, runs = plan_destage(cf, 1 << 30)
    assert [(x.ext, snap) for x, snap in plan] == [(0, _blocks(0, 1)), (1, _blocks(0)),
                                                   (3, _blocks(1))]
    assert runs == [(0, EXT + BLK), ((3 << EXT_SHIFT) + BLK, BLK)]
    assert cf.extents[0].redirty == 0               # the snapshot starts the tracking anew
    assert EXT - 2 * BLK <= MERGE_GAP


def test_plan_does_not_bridge_invalid_blocks_and_clips_to_the_size():
    cf = _file(EXT + 6000, {
        0: (_blocks(0, 15), _blocks(0, 15)),        # blocks 1-14 not valid: two runs
        1: (_blocks(0, 1), _blocks(0, 1)),          # EOF inside block 1
    })
    plan, runs = plan_destage(cf, 1 << 30)
    assert runs == [(0, BLK), (15 * BLK, BLK + 6000)]


def test_plan_starts_at_the_given_extent_and_stops_after_max_bytes():
    full = block_mask(0, EXT)
    cf = _file(8 * EXT, {e: (full, full) for e in range(8)})
    plan, runs = plan_destage(cf, 2 * EXT, start_ext=3)
    assert [x.ext for x, _ in plan] == [3, 4]
    assert runs == [(3 * EXT, 2 * EXT)]


def test_holes_are_whole_blocks_without_bytes(tmp_path):
    """extentmap.holes: a block counts as missing when the cache file has none of its bytes
    (a punched block, or blocks past the file's end); the last block of a file cut mid-block
    counts by its bytes before the end. A hole in part of a block is never a missing block
    (test_power_cut.py covers the 1 KiB-block filesystem where such holes exist)."""
    from cachefs.cachefiles import punch_hole
    from cachefs.extentmap import holes
    path = tmp_path / "c"
    path.write_bytes(os.urandom(64 << 10) + os.urandom(5000))     # extent 0 and 5000 bytes
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        assert holes(fd, size, 0, 0xFFFF) == 0 and holes(fd, size, 1, 0b11) == 0
        punch_hole(fd, 8192, 4096)                                  # block 2
        assert holes(fd, size, 0, 0xFFFF) == 0b100
        assert holes(fd, size, 0, 0xFFFF & ~0b100) == 0
        punch_hole(fd, 64 << 10, 64 << 10)                          # all of extent 1
        assert holes(fd, size, 1, 0b11) == 0b11                     # block 1 is partial
        assert holes(fd, size, 1, 0b111) == 0b111                   # block 2 past the end
    finally:
        os.close(fd)


def test_getattr_keeps_the_old_size_while_a_write_past_the_end_is_unanswered():
    """Until a write past the end is answered, the kernel keeps the file's old size; a
    getattr meanwhile said the new one (BACKING's in write-through: the write had reached
    it), fstat(2) gave a reader that size, and its mapping of it died of SIGBUS at the pages
    past the kernel's end (a helper's hunt: 5 readers in ~190 passes of a file appended
    to). Answered, the write's end is the size."""
    from cachefs.writepath import WritePath
    state = FakeState()
    coh = Coherence(state)
    cf = _coherent_file(state, (7, 100, 10, 10))

    class Of:
        cfile = cf

    class Writes:
        async def _write(self, of, off, data):
            await gate.wait()
            cf.size = max(cf.size, off + len(data))     # BACKING and the engine have it
            return len(data)

    async def main():
        nonlocal gate
        gate = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(WritePath.write, Writes(), Of(), 100, b"x" * 50)
            await trio.sleep(0.01)
            assert coh.logical_size(7, 150) == 100          # BACKING has it, unanswered
            gate.set()
        assert coh.logical_size(7, 150) == 150
        assert cf.extending == 0

    gate = None
    trio.run(main)
