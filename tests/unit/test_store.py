"""The SQLite record: batches, drop-then-re-add, ownership and corruption errors, commits in
the store's thread."""

import os
import threading
import time

import pytest
import trio

from cachefs.errors import UserError
from cachefs.store import SCHEMA_VERSION, MetadataStore


def _open(tmp_path, backing="/srv/a"):
    s = MetadataStore(str(tmp_path))
    s.open(backing, os.stat(tmp_path))
    return s


def test_batches_round_trip_and_drop_then_readd(tmp_path):
    s = _open(tmp_path)
    s.queue_file(10, 4096, 1, 2, b"a/f", 4096)
    s.queue_extent(10, 0, 0xFFFF, 0)
    s.queue_extent(10, 3, 0x1, 0)
    s.commit(s.take_batch(), durable=False)
    s.queue_drop_file(10)                 # identity changed ...
    s.queue_file(10, 8192, 5, 6, None, 9000)          # ... and new data cached in the same batch
    s.queue_extent(10, 1, 0x3, 0)
    s.commit(s.take_batch(), durable=True)
    s.close(clean=True)
    s = _open(tmp_path)
    files, extents = s.load()
    assert files == {10: (8192, 5, 6, None, 9000)}
    assert extents == [(10, 1, 0x3, 0, 0, None)]


def test_clean_flag(tmp_path):
    s = MetadataStore(str(tmp_path))
    assert s.open("/srv/a", os.stat(tmp_path))            # new: nothing to recover
    s.close(clean=False)
    s = MetadataStore(str(tmp_path))
    assert not s.open("/srv/a", os.stat(tmp_path))
    s.close(clean=True)


def test_cache_dir_of_another_backing_is_refused(tmp_path):
    _open(tmp_path, "/srv/a").close(clean=True)
    with pytest.raises(UserError, match="belongs to BACKING /srv/a"):
        _open(tmp_path, "/srv/b")


def test_a_refused_cache_dir_says_what_dirty_data_it_holds_and_how_to_get_it_out(tmp_path):
    """BACKING moved to another path while the cache held dirty data: the refusal said only
    "choose another --cache-dir", which strands the data (a helper's hunt)."""
    s = _open(tmp_path, "/srv/a")
    s.queue_file(10, 4096, 1, 2, b"f", 4096)
    s.queue_extent(10, 0, 0x1, 0x1)
    s.commit(s.take_batch(), durable=True)
    s.close(clean=True)
    with pytest.raises(UserError, match=r"not yet in /srv/a: .* mount it there again"):
        _open(tmp_path, "/srv/b")


def test_corrupt_database_is_a_sentence(tmp_path):
    (tmp_path / "cachefs.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(UserError, match="corrupt"):
        _open(tmp_path)


def test_a_cache_this_version_writes_is_refused_by_a_schema_4_cachefs(tmp_path):
    """Schema-4 versions (c5496da .. bb543e0) open a directory of user_version 4 or less and
    refuse a higher one. This version keeps durable meta keys (birth:, cut:, times:, caps:,
    ...) that the older of them neither know nor clear: a round trip through one lost
    fsynced data (a helper's hunt). What this version writes is above 4 for them; a
    directory of schema 4 (the previous version's, with such keys) is taken as it is."""
    import sqlite3
    s = _open(tmp_path)
    s.queue_meta("birth:7", "123")
    s.commit(s.take_batch(), durable=True)
    s.close(clean=True)
    db = sqlite3.connect(tmp_path / "cachefs.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] > 4    # what a schema-4 one checks
    db.execute("PRAGMA user_version=4")                          # as the previous version left it
    db.commit()
    db.close()
    s = _open(tmp_path)
    assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert s.meta_keys("birth:") == ["birth:7"]
    s.close(clean=True)


def test_schema_2_migrates_to_the_current_one_with_pins_and_unknown_checksums(tmp_path):
    import sqlite3
    db = sqlite3.connect(tmp_path / "cachefs.db")          # a cache directory of schema 2
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE files (ino INTEGER PRIMARY KEY, size INTEGER NOT NULL,
            mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL, path BLOB, lsize INTEGER);
        CREATE TABLE extents (ino INTEGER NOT NULL, ext INTEGER NOT NULL,
            valid INTEGER NOT NULL, dirty INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (ino, ext)) WITHOUT ROWID;
        INSERT INTO files VALUES (7, 100, 1, 2, X'61', 100);
        INSERT INTO extents VALUES (7, 0, 1, 0);
        PRAGMA user_version=2;
    """)
    db.close()
    s = _open(tmp_path)
    assert s._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    # the extent keeps its data; its checksums are unknown (summed 0) until written again
    assert s.load() == ({7: (100, 1, 2, b"a", 100)}, [(7, 0, 1, 0, 0, None)])
    s.queue_extent(7, 0, 1, 0, 1, bytes(64))
    s.commit(s.take_batch(), durable=True)
    assert s.load()[1] == [(7, 0, 1, 0, 1, bytes(64))]
    assert s.load_pins() == []
    s.set_pins([(7, b"a", 100), (8, b"d/b", 5)])
    s.set_pins([(7, b"renamed", 100)])
    s.remove_pins([8])
    s.close(clean=True)
    s = _open(tmp_path)
    assert s.load_pins() == [(7, b"renamed", 100)]


async def test_commit_async_runs_off_the_event_loop_and_excludes_other_db_use(tmp_path):
    """A commit (an fsync) runs in the store's thread: the event loop goes on meanwhile,
    and a database call on the loop waits until the commit is done (one user at a time)."""
    s = _open(tmp_path)
    in_commit = threading.Event()
    release = threading.Event()
    commit = s._commit_locked
    order = []

    def slow_commit(batch, durable):
        in_commit.set()
        release.wait(10)                     # an fsync that takes long
        left_out = commit(batch, durable)
        order.append("commit")
        return left_out

    s._commit_locked = slow_commit
    s.queue_extent(1, 0, 0xFFFF, 0)
    ticks = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.commit_async, s.take_batch(), True)
        while not in_commit.is_set():
            await trio.sleep(0.001)
        for _ in range(20):                  # the loop runs while the commit is in flight
            await trio.sleep(0)
            ticks += 1
        threading.Timer(0.2, release.set).start()
        t0 = time.monotonic()
        s.set_pins([(1, b"f", 10)])          # on the loop: waits for the commit's end
        order.append("pins")
        assert time.monotonic() - t0 >= 0.1
    assert ticks == 20 and order == ["commit", "pins"]
    assert s.load_pins() == [(1, b"f", 10)]
    assert s.load()[1] == [(1, 0, 0xFFFF, 0, 0, None)]
    s.close(clean=True)


def test_a_row_sqlite_cannot_store_costs_that_row_only(tmp_path, caplog):
    """A value out of SQLite's range (an mtime past 2262 was one, xfstests generic/634) made
    the commit raise: the daemon ended and the batch's write-back marks of every file were
    lost. The other rows are committed now, the bad one is left out and logged."""
    s = _open(tmp_path)
    s.queue_file(10, 4096, 1, 2, b"a/good", 4096)
    s.queue_file(11, 1 << 64, 1, 2, b"a/bad", 4096)          # no file is that large
    s.queue_extent(10, 0, 0xFFFF, 0xF)
    s.queue_extent(11, 0, 0xFFFF, [0xF])                      # a type SQLite does not know
    s.queue_meta("k", "v")
    assert s.commit(s.take_batch(), durable=True) == 2
    assert "2 row(s) left out" in caplog.text and "a/bad" in caplog.text
    s.close(clean=True)
    s = _open(tmp_path)
    files, extents = s.load()
    assert files == {10: (4096, 1, 2, b"a/good", 4096)}
    assert extents == [(10, 0, 0xFFFF, 0xF, 0, None)]
    assert s.meta_items("k") == {"k": "v"}
    s.queue_file(12, 1, 3, 4, b"a/next", 1)                   # and the store goes on
    assert s.commit(s.take_batch(), durable=False) == 0
    s.close(clean=True)


def test_times_of_any_size_round_trip(tmp_path):
    """Nanosecond times past 2262 (ext4 and XFS keep up to 2446, btrfs more) and before
    1843 (btrfs) do not fit the wrapping the version before used: 2440 came back as 1855
    and a remount took the file for changed on BACKING. A value that version wrote (a time
    past 2262, wrapped) is still read as it was meant."""
    times = [0, -2_147_483_648 * 10**9, 10_413_792_000 * 10**9, 14_831_769_600 * 10**9,
             (1 << 63) - 1, 1 << 63, 32_503_680_000 * 10**9, -5_364_662_400 * 10**9]
    s = _open(tmp_path)
    for i, t in enumerate(times):
        s.queue_file(i + 1, 1, t, -t, b"f%d" % i, 1)
    assert s.commit(s.take_batch(), durable=True) == 0
    late = 10_413_792_000 * 10**9
    with s._lock:                                   # a row as the version before wrote it
        s._db.execute("INSERT INTO files VALUES (99, 1, ?, 0, NULL, 1)", (late - (1 << 64),))
        s._db.commit()
    s.close(clean=True)
    files, _ = _open(tmp_path).load()
    assert [files[i + 1][1:3] for i in range(len(times))] == [(t, -t) for t in times]
    assert files[99][1] == late
