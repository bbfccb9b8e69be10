"""The durable record of the cache: SQLite schema, migrations, batched persistence, recovery.

Owns the one SQLite connection. The in-memory extent map is the hot index; this module only
receives queued changes and commits them in batches, so no SQL runs per request. A commit
(an fsync with synchronous=FULL) runs in a worker thread (`commit_async`, one at a time), so
the event loop, and with it every cache hit, never waits for it; every use of the connection
holds `_lock`, so it is used by one thread at a time (the trio thread for the rare sync calls:
startup, pins, close). Durability order (DESIGN.md §4): cache data is fdatasync'd before the
commit that claims it; SSD space of an evicted extent is released (hole punched) only after
the commit that forgets it is durable.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time

import trio

from . import room
from .cachefiles import fsync_dir
from .errors import UserError
from .journal import DoubtJournal

log = logging.getLogger("cachefs.store")

# 5: no table changed. Durable state kept in `meta` since schema 4 (times:, ctime:, caps:,
# birth:, cut:, mapped:, backing_mount) is state an older schema-4 cachefs neither knows nor
# clears: one that opened this directory left the keys standing while its files changed, and
# this version trusted them again at its next mount (a helper's hunt: fsynced data taken for
# an orphan's and discarded, flushed data cut by a stale truncation key, an mtime set back
# years, a removed capability put back). From 5 on, those versions refuse the directory with
# their sentence ("written by a newer cachefs"). Any new durable state an older version would
# not keep right bumps this number again.
SCHEMA_VERSION = 5

# meta: key/value facts about this cache directory.
#   backing      real path of the BACKING directory this cache belongs to
#   backing_dev  st_dev:st_ino of BACKING's root when the cache was created (informational)
#   clean        '1' after a clean unmount, '0' while mounted (an unclean stop leaves '0')
#   mode         the mode of the last mount
#   unlinking:INO  write-back: BACKING is about to lose the last name of inode INO, whose
#                cached data this database holds; written durably before the unlink and
#                deleted in the batch that drops the file. After an unclean stop, the file's
#                data is kept only if BACKING still has INO at its path hint with the
#                recorded identity; otherwise it was unlinked (and its number may now belong
#                to a new file), and the data is discarded.
#   lifetime.<counter>  (integer text) a stats counter summed over every mount of this cache
#                directory up to its last save (each commit interval and unmount): the
#                lifetime totals of `cachefs-ctl stats`; a missing key counts 0
#   times:INO    write-back: "atime_ns mtime_ns" set explicitly (utimens: tar x, cp -p, rsync
#                -t) on inode INO while it had dirty data; each destage pass of the file
#                puts them back on BACKING after writing the data; deleted once it is clean
#   lifetime.since  (float text) wall time (epoch seconds) the lifetime totals started
#   abandoned:INO  '1': the unmount left a destage pass of inode INO to its thread, which may
#                have changed BACKING's file after this commit; the next mount takes that
#                change for cachefs's own (as after an unclean stop) and deletes the key
# files: one row per BACKING inode with cached data.
#   ino          BACKING st_ino (also the FUSE inode number and the cache file's name)
#   size, mtime_ns, ctime_ns   BACKING's identity when the extents below were valid; a file
#                whose identity differs when next seen has its clean extents dropped;
#                times before 1843 or past 2262 are a BLOB of their decimal digits (_to_db)
#   path         BACKING path (bytes) where the file was last seen; a hint for destaging
#                after a restart, checked against ino (schema 2)
#   lsize        the file's logical size: larger than `size` while extending writes are
#                dirty (write-back); destaging writes up to it (schema 2)
# extents: one row per cached 64 KiB extent.
#   ext          extent index: bytes [ext*64 KiB, (ext+1)*64 KiB)
#   valid        bitmap of 4 KiB blocks holding BACKING's bytes (bit i = block i)
#   dirty        bitmap of blocks newer than BACKING (write-back; 0 in write-through)
#   summed       bitmap of valid blocks whose checksum is known (schema 4; 0 for extents of
#                older caches: checksummed by the next write or `cachefs-ctl verify`)
#   sums         16 little-endian uint32 block checksums (integrity.py), or NULL
# pins: one row per pinned BACKING file (`cachefs-ctl pin`; schema 3). Its extents are never
#   evicted and are re-loaded when dropped; a row goes with `unpin`, `drop --pinned`, or when
#   the file is unlinked or can no longer be found. Written at once (operator commands only).
#   ino          BACKING st_ino of the pinned file
#   path         its path relative to BACKING's root (bytes), as last seen; checked against
#                ino before use, so a file put in its place is never pinned by mistake
#   size         BACKING's size when last loaded: what the pin holds of the pool (rounded up
#                to whole extents when counted against --max-pinned)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    ino INTEGER PRIMARY KEY, size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL, path BLOB, lsize INTEGER);
CREATE TABLE IF NOT EXISTS extents (
    ino INTEGER NOT NULL, ext INTEGER NOT NULL,
    valid INTEGER NOT NULL, dirty INTEGER NOT NULL DEFAULT 0,
    summed INTEGER NOT NULL DEFAULT 0, sums BLOB,
    PRIMARY KEY (ino, ext)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS pins (
    ino INTEGER PRIMARY KEY, path BLOB NOT NULL, size INTEGER NOT NULL);
"""


class CorruptStore(UserError):
    """The database cannot be read (garbage, truncated inside, not SQLite), or its dirty data
    cannot be BACKING's (`_dirty_elsewhere`)."""


def _dirty_note(db: sqlite3.Connection, backing: str) -> str:
    """For the refusal of a cache directory of another BACKING: what it holds that BACKING
    does not have yet, and how to get it there (a BACKING moved to another path: following
    the advice alone left it stranded, a helper's hunt)."""
    try:
        n = db.execute("SELECT count(*) FROM extents WHERE dirty != 0").fetchone()[0]
    except sqlite3.DatabaseError:
        return ""
    if not n:
        return ""
    return (f" It holds write-back data of {n} extents not yet in {backing}: if that is "
            f"this BACKING under its old path, mount it there again (a bind mount of it at "
            f"{backing} will do) and flush, or the data stays in this cache directory only.")


# Times in nanoseconds past 2262-04-11 do not fit SQLite's signed 64-bit INTEGER (ext4 and
# XFS keep times up to 2446: `touch -d 2300-01-01`; btrfs further): the commit raised
# OverflowError, the daemon ended and write-back data not yet destaged was lost (xfstests
# generic/634). Such times, and times before _WRAPPED_BELOW (1843), are stored as a BLOB of
# their decimal digits, which SQLite keeps as it is whatever the column's type. (The version
# before stored them wrapped, minus 2**64, read back below _WRAPPED_BELOW: times past about
# 2319 were then read back as times before 1970, and a remount took such a file for changed
# on BACKING, a conflict in write-back. INTEGERs below _WRAPPED_BELOW are still read so.)
_I64 = 1 << 63
_WRAPPED_BELOW = -4 * 10**18


def _to_db(ns: int) -> int | bytes:
    return ns if _WRAPPED_BELOW <= ns < _I64 else str(ns).encode()


def _from_db(v: int | bytes) -> int:
    if isinstance(v, bytes):
        return int(v)
    return v + (1 << 64) if v < _WRAPPED_BELOW else v


def _file_row(row: tuple) -> tuple:
    """A files row as stored: (ino, size, mtime_ns, ctime_ns, path, lsize), times _to_db."""
    ino, size, mt, ct, path, lsize = row
    return ino, size, _to_db(mt), _to_db(ct), path, lsize


# What SQLite raises for a value it cannot bind (out of range, an unknown type); the
# ProgrammingError/InterfaceError kinds only when their text says binding (_unstorable).
_UNSTORABLE = (OverflowError, TypeError, ValueError, sqlite3.InterfaceError,
               sqlite3.ProgrammingError)


def _unstorable(exc: Exception) -> bool:
    return (not isinstance(exc, (sqlite3.InterfaceError, sqlite3.ProgrammingError))
            or "binding" in str(exc).lower())


def _read_tables(db: sqlite3.Connection) -> tuple[dict, list]:
    """The files and extents rows (MetadataStore.load)."""
    files = {ino: (size, _from_db(mt), _from_db(ct), path, size if lsize is None else lsize)
             for ino, size, mt, ct, path, lsize in db.execute(
                 "SELECT ino, size, mtime_ns, ctime_ns, path, lsize FROM files")}
    extents = list(db.execute("SELECT ino, ext, valid, dirty, summed, sums FROM extents"))
    return files, extents


def path_text(path: str) -> str:
    """A path as the database's TEXT keeps it: bytes that are not UTF-8 (a name Python
    holds as surrogate escapes, which SQLite cannot store) as backslash escapes (\\xff).
    UTF-8 paths are unchanged, as stored by every earlier version."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _dirty_elsewhere(db: sqlite3.Connection, backing_real: str, root: os.stat_result
                     ) -> str | None:
    """A sentence if the cache holds dirty data and BACKING's root is not the directory it
    was (another inode: BACKING's file system is not mounted over it, or another one is).
    Destaging there would find none of the files and discard their dirty data. The device
    number is not compared: an NFS mount gets a new one at every mount."""
    row = db.execute("SELECT value FROM meta WHERE key='backing_dev'").fetchone()
    if row is None or row[0].rpartition(":")[2] == str(root.st_ino):
        return None
    if db.execute("SELECT 1 FROM extents WHERE dirty != 0 LIMIT 1").fetchone() is None:
        return None
    return (f"BACKING {backing_real} is not the directory this cache's dirty write-back data "
            f"belongs to (its root was inode {row[0].rpartition(':')[2]}, it is inode "
            f"{root.st_ino} now): is BACKING's file system mounted?")


def _connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    # The WAL's index in the daemon's heap, not in a mapped cachefs.db-shm: on a
    # copy-on-write cache filesystem that filled up (btrfs) dirtying a page of that
    # mapping again failed with SIGBUS, which ended the daemon. The price: no other
    # process can open the database while the mount is up (none needs to).
    db.execute("PRAGMA locking_mode=EXCLUSIVE")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


def _ident(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the database file, None if it is gone. Not statx.file_id, which
    takes any error for "nothing there": a stat failing with EIO on a failing SSD must fail
    the commit (retried), not pass for a database removed and be written again."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class MetadataStore:
    """Schema and batched persistence for one cache directory."""

    def __init__(self, cache_dir: str):
        self.cache_dir = cache_dir
        self.path = os.path.join(cache_dir, "cachefs.db")
        self._db: sqlite3.Connection | None = None
        self._loaded: tuple[dict, list] | None = None   # the rows read at open (load)
        self._dropped: set[int] = set()                # files whose rows go first
        self._files: dict[int, tuple[int, int, int, bytes | None, int]] = {}
        self._extents: dict[tuple[int, int], tuple | None] = {}
        self._meta: dict[str, str | None] = {}         # meta rows to set (None: delete)
        self.commits = 0
        self.last_commit_s = 0.0
        # When the last mount last wrote the database (its files' mtimes, before this one
        # opens it): the identities it holds were seen before then (CacheState.load: racy).
        self.written_before_ns = max(
            (os.stat(self.path + tail).st_mtime_ns for tail in ("", "-wal")
             if os.path.exists(self.path + tail)), default=0)
        self.journal = DoubtJournal(cache_dir)        # write-back: extents in doubt
        self._lock = threading.Lock()                  # held by every use of self._db
        self._ident: tuple[int, int] | None = None     # (st_dev, st_ino) of the open db
        self.previous_backing_dev: str | None = None   # BACKING's "dev:ino" at the last mount
        self.previous_backing_mount: str | None = None  # and its mount's unique id
        self.backing_mount: int | None = None          # this mount's (statx.mount_id), if known
        self._limiter = trio.CapacityLimiter(1)        # commits run one at a time, in order

    # -- opening -------------------------------------------------------------------------

    def open(self, backing_real: str, backing_root: os.stat_result,
             discard_dirty: bool = False) -> bool:
        """Open or create the database; returns True if the last stop was clean.

        Raises UserError if the database is corrupt, missing or empty while the directory
        holds cached data (which may be dirty: only `discard_dirty` starts cold then, with
        the damaged state moved aside), or belongs to another BACKING.
        """
        problem = self._damaged()
        if problem is None:
            try:
                return self._open(backing_real, backing_root)
            except CorruptStore as exc:
                # SQLite cannot make its -wal and -shm files on a full filesystem and says
                # "disk I/O error": that is no damage (--discard-dirty would throw away data
                # that is fine), so room is made with the reserve file or asked for.
                if room.free_bytes(self.cache_dir) >= room.MIN_FREE_TO_OPEN:
                    problem = str(exc)
                elif self.release_reserve():
                    log.warning("the cache filesystem is full: the reserve file was "
                                "released so that the metadata database can be opened")
                    return self.open(backing_real, backing_root, discard_dirty)
                else:
                    raise UserError(room.full_sentence(self.cache_dir)) from None
        if not discard_dirty:
            raise UserError(f"{problem} It may have named dirty write-back data that is not in "
                            "BACKING; recover it by hand, or mount with --discard-dirty to "
                            "set the damaged state aside and start with a cold cache.")
        aside = self._set_aside()
        log.warning("%s --discard-dirty: the damaged state was moved to %s and the cache "
                    "starts cold (any dirty data in it is not in BACKING)", problem, aside)
        return self._open(backing_real, backing_root)

    def _damaged(self) -> str | None:
        """A sentence if the database is missing or empty while cached data is here (a
        deleted or truncated cachefs.db, or a WAL left without its database)."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = -1
        if size > 0:
            return None
        data = os.path.join(self.cache_dir, "data")
        has_data = os.path.isdir(data) and any(
            files for _, _, files in os.walk(data))
        if os.path.exists(self.path + "-wal") and size <= 0:
            return (f"the cache directory {self.cache_dir} has a write-ahead log "
                    f"(cachefs.db-wal) but its database is {'missing' if size < 0 else 'empty'}.")
        if has_data:
            return (f"the metadata database of {self.cache_dir} is "
                    f"{'missing' if size < 0 else 'empty'} but the directory holds cached data.")
        return None

    def _set_aside(self) -> str:
        """Move the database, its WAL, the doubt journal and the cache files into
        damaged-<time>/ of the cache directory; returns that path."""
        aside = os.path.join(self.cache_dir, time.strftime("damaged-%Y%m%d-%H%M%S"))
        os.makedirs(aside, mode=0o700, exist_ok=True)
        for name in ("cachefs.db", "cachefs.db-wal", "cachefs.db-shm", "doubt.log",
                     "doubt.log.prev", "data"):
            src = os.path.join(self.cache_dir, name)
            if os.path.lexists(src):
                os.rename(src, os.path.join(aside, name))
        return aside

    def _open(self, backing_real: str, backing_root: os.stat_result) -> bool:
        self._create_private()
        db = None
        try:
            db = _connect(self.path)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            foreign = None
            if version > SCHEMA_VERSION:
                foreign = (f"the cache directory {self.cache_dir} was written by a newer "
                           f"cachefs (schema {version}); upgrade cachefs or use another "
                           "--cache-dir.")
            elif version >= 1:                  # refused before anything is migrated
                row = db.execute("SELECT value FROM meta WHERE key='backing'").fetchone()
                if row is not None and row[0] != path_text(backing_real):
                    foreign = (f"the cache directory {self.cache_dir} belongs to BACKING "
                               f"{row[0]}, not {backing_real}; choose another --cache-dir."
                               + _dirty_note(db, row[0]))
            if foreign is not None:
                db.close()
                raise UserError(foreign)
            if version >= 1:
                elsewhere = _dirty_elsewhere(db, backing_real, backing_root)
                if elsewhere is not None:
                    db.close()
                    raise CorruptStore(elsewhere)
            if version < SCHEMA_VERSION:
                db.executescript(_SCHEMA)
            if version == 1:
                db.execute("ALTER TABLE files ADD COLUMN path BLOB")
                db.execute("ALTER TABLE files ADD COLUMN lsize INTEGER")
            # 2 -> 3: the pins table, created empty by _SCHEMA above.
            if 1 <= version < 4:
                db.execute("ALTER TABLE extents ADD COLUMN summed INTEGER NOT NULL DEFAULT 0")
                db.execute("ALTER TABLE extents ADD COLUMN sums BLOB")
            if version < SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            meta = dict(db.execute("SELECT key, value FROM meta"))
            # Read every row now, before anything is written: damage anywhere in the tables
            # is found here, where --discard-dirty can still set the database aside (load()
            # hands these rows on).
            self._loaded = _read_tables(db)
        except sqlite3.DatabaseError as exc:
            if db is not None:
                db.close()
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                # Another process has it open: in use, not damaged (called corrupt, it was
                # offered to --discard-dirty, which set a live daemon's state aside).
                raise UserError(f"the metadata database {self.path} is in use by another "
                                "process (database is locked): one cachefs per cache "
                                "directory; unmount the other first.") from None
            raise CorruptStore(f"the metadata database {self.path} is corrupt or unreadable "
                               f"({exc}).") from None
        clean = meta.get("clean", "1") == "1"
        self.previous_backing_dev = meta.get("backing_dev")     # before they are replaced
        self.previous_backing_mount = meta.get("backing_mount")

        def mark_in_use() -> None:
            with db:
                db.execute("BEGIN")
                db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [
                    ("backing", path_text(backing_real)),
                    ("clean", "0"),
                ])
        try:
            room.with_room(self.cache_dir, mark_in_use)
        except sqlite3.Error as exc:
            db.close()
            if not room.is_full(exc):
                raise CorruptStore(f"the metadata database {self.path} cannot be written "
                                   f"({exc}).") from None
            raise UserError(room.full_sentence(self.cache_dir)) from None
        self._db = db
        self._ident = _ident(self.path)
        return clean

    def _create_private(self) -> None:
        """Create the database file 0600 (or make an existing one 0600) before SQLite opens
        it: SQLite gives the -wal and -shm files the database file's mode, and the daemon
        runs with umask 0. The file holds BACKING's paths and sizes."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o600)
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
            for suffix in ("-wal", "-shm"):
                try:
                    os.chmod(self.path + suffix, 0o600)
                except FileNotFoundError:
                    pass
        except OSError as exc:
            raise UserError(f"cannot open the metadata database {self.path} as a private "
                            f"file: {exc.strerror}.") from None

    def record_backing(self, root: os.stat_result) -> None:
        """BACKING's root and mount as this mount found them: after the map was loaded
        against the ones recorded before (a mount refused there must not replace them: the
        next one took a remounted BACKING for the same mount, Daemon._renumbered)."""
        self.set_meta("backing_dev", f"{root.st_dev}:{root.st_ino}")
        if self.backing_mount is not None:
            self.set_meta("backing_mount", str(self.backing_mount))

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    # -- lifetime totals (stats that span remounts; kept in meta, see the schema) --------

    def load_lifetime(self) -> tuple[dict[str, int], float]:
        """The saved lifetime totals and the wall time they started (now, for a new cache)."""
        with self._lock:
            rows = self._db.execute("SELECT key, value FROM meta WHERE key LIKE 'lifetime.%'")
            saved = {key[len("lifetime."):]: value for key, value in rows}
        since = saved.pop("since", None)
        totals = {}
        for name, value in saved.items():
            try:
                totals[name] = int(value)
            except ValueError:
                continue                        # a damaged total restarts from 0
        if since is None:
            since = repr(time.time())
            self.set_meta("lifetime.since", since)
        return totals, float(since)

    def save_lifetime(self, totals: dict[str, int]) -> None:
        """Record the lifetime totals in one small transaction (no fsync: WAL, synchronous
        NORMAL; a clean close makes them durable). Runs in any thread (see run_async)."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                 [(f"lifetime.{k}", str(v)) for k, v in totals.items()])

    def load(self) -> tuple[dict[int, tuple[int, int, int, bytes | None, int]],
                            list[tuple]]:
        """All files (ino -> (size, mtime_ns, ctime_ns, path, lsize)) and extents
        (ino, ext, valid, dirty, summed, sums)."""
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            return loaded                       # read (and so checked) at open
        try:
            with self._lock:
                return _read_tables(self._db)
        except sqlite3.DatabaseError as exc:
            raise UserError(f"the metadata database {self.path} is corrupt ({exc}); move the "
                            "cache directory away to start a cold cache (dirty write-back "
                            "data in it needs recovery by hand).") from None

    # -- pins (operator commands: written at once, not batched) ---------------------------

    def load_pins(self) -> list[tuple[int, bytes, int]]:
        """Every pin: (ino, path relative to BACKING's root, size)."""
        with self._lock:
            return [(ino, bytes(path), size) for ino, path, size in
                    self._db.execute("SELECT ino, path, size FROM pins")]

    def set_pins(self, pins: list[tuple[int, bytes, int]]) -> None:
        """Record (or update) pins (ino, path, size) in one transaction."""
        self._write("INSERT OR REPLACE INTO pins VALUES (?, ?, ?)", pins)

    def remove_pins(self, inos: list[int]) -> None:
        self._write("DELETE FROM pins WHERE ino=?", [(ino,) for ino in inos])

    def _write(self, sql: str, rows: list[tuple]) -> None:
        """One small transaction on the calling (trio) thread: it waits for a commit in
        flight, if any (pins change only on operator commands, renames and unlinks)."""
        if not rows:
            return
        db = self._db
        with self._lock:
            try:
                db.execute("BEGIN")
                db.executemany(sql, rows)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    # -- queueing (sync, cheap, called by the engine) ------------------------------------

    def queue_file(self, ino: int, size: int, mtime_ns: int, ctime_ns: int,
                   path: bytes | None, lsize: int) -> None:
        self._files[ino] = (size, mtime_ns, ctime_ns, path, lsize)

    def queue_drop_file(self, ino: int) -> None:
        """Forget a file and all its extents (a later queue_file starts it afresh)."""
        self._dropped.add(ino)
        self._files.pop(ino, None)
        for key in [k for k in self._extents if k[0] == ino]:
            del self._extents[key]

    def queue_extent(self, ino: int, ext: int, valid: int, dirty: int, summed: int = 0,
                     sums: bytes | None = None) -> None:
        self._extents[(ino, ext)] = (valid, dirty, summed, sums)

    def queue_drop_extent(self, ino: int, ext: int) -> None:
        self._extents[(ino, ext)] = None

    def queue_meta(self, key: str, value: str | None) -> None:
        """Set (or, with None, delete) a meta row in the next batch."""
        self._meta[key] = value

    def meta_keys(self, prefix: str) -> list[str]:
        return list(self.meta_items(prefix))

    def meta_items(self, prefix: str) -> dict[str, str]:
        with self._lock:
            return dict(self._db.execute("SELECT key, value FROM meta WHERE key >= ? AND "
                                         "key < ?", (prefix, prefix + "\uffff")))

    def pending(self) -> int:
        return len(self._dropped) + len(self._files) + len(self._extents) + len(self._meta)

    # -- committing ----------------------------------------------------------------------

    def take_batch(self) -> tuple[set, dict, dict, dict]:
        """Detach the queued changes; the caller syncs their data, then calls commit()."""
        batch = (self._dropped, self._files, self._extents, self._meta)
        self._dropped, self._files, self._extents, self._meta = set(), {}, {}, {}
        self.journal.rotate()
        return batch

    def requeue(self, batch: tuple[set, dict, dict, dict]) -> None:
        """Put back a batch whose commit failed, under the changes queued since (newer)."""
        dropped, files, extents, meta = batch
        self._meta = {**meta, **self._meta}
        newer_drops = self._dropped
        self._dropped = dropped | newer_drops
        self._files = {**{i: v for i, v in files.items() if i not in newer_drops},
                       **self._files}
        self._extents = {**{k: v for k, v in extents.items() if k[0] not in newer_drops},
                         **self._extents}

    def ensure_reserve(self) -> bool:
        return room.ensure_reserve(self.cache_dir)

    def release_reserve(self) -> bool:
        return room.release_reserve(self.cache_dir)

    async def run_async(self, fn, *args):
        """Run `fn(*args)` (a method of this store that uses the database) in a worker
        thread, one at a time and in the order asked: the event loop goes on meanwhile."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def commit_async(self, batch: tuple[set, dict, dict, dict], durable: bool) -> int:
        """commit() in the store's worker thread (see run_async)."""
        return await self.run_async(self.commit, batch, durable)

    def commit(self, batch: tuple[set, dict, dict, dict], durable: bool) -> int:
        """Write one batch in one transaction; `durable` makes the commit survive power loss.
        Runs in any thread; the connection is held meanwhile.

        A row SQLite cannot hold (a value out of its range or of a type it does not know:
        a bug in cachefs) is left out and logged, and the rest of the batch is written. An
        OverflowError once ended the daemon here and every file's write-back marks of the
        batch were lost (xfstests generic/634); one bad row costs its own row only now.

        Returns:
            How many rows were left out (0 but for such a bug).
        """
        with self._lock:
            try:
                return len(self._commit_locked(batch, durable))
            except _UNSTORABLE as exc:
                if not _unstorable(exc):
                    raise
                left_out = self._commit_locked(batch, durable, row_by_row=True)
                log.error("a metadata commit failed on a value SQLite cannot store (%s: %s), "
                          "an error in cachefs: %d row(s) left out, the rest committed: %s",
                          type(exc).__name__, exc, len(left_out),
                          "; ".join(f"{table} {row!r}" for table, row in left_out[:5]))
                return len(left_out)

    def _commit_locked(self, batch: tuple[set, dict, dict, dict], durable: bool,
                       row_by_row: bool = False) -> list[tuple[str, tuple]]:
        """One transaction; row_by_row leaves out (and returns) the rows SQLite refuses."""
        dropped, files, extents, meta = batch
        if _ident(self.path) != self._ident:
            self._write_again()
        db = self._db
        self._loaded = None                     # the rows read at open are old now
        if durable:
            db.execute("PRAGMA synchronous=FULL")
        left_out: list[tuple[str, tuple]] = []
        try:
            db.execute("BEGIN")
            same = tuple                        # (rows stored as they are)
            for table, sql, rows, stored in (
                    ("extents", "DELETE FROM extents WHERE ino=?", [(i,) for i in dropped],
                     same),
                    ("files", "DELETE FROM files WHERE ino=?", [(i,) for i in dropped], same),
                    ("files", "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)",
                     [(ino, *v) for ino, v in files.items()], _file_row),
                    ("extents", "DELETE FROM extents WHERE ino=? AND ext=?",
                     [k for k, v in extents.items() if v is None], same),
                    ("extents", "INSERT OR REPLACE INTO extents VALUES (?, ?, ?, ?, ?, ?)",
                     [(*k, *v) for k, v in extents.items() if v is not None], same),
                    ("meta", "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                     [(k, v) for k, v in meta.items() if v is not None], same),
                    ("meta", "DELETE FROM meta WHERE key=?",
                     [(k,) for k, v in meta.items() if v is None], same)):
                if not row_by_row:
                    db.executemany(sql, map(stored, rows))
                    continue
                for row in rows:
                    try:
                        db.execute(sql, stored(row))
                    except _UNSTORABLE as exc:
                        if not _unstorable(exc):
                            raise
                        left_out.append((table, row))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            if durable:
                db.execute("PRAGMA synchronous=NORMAL")
        self.commits += 1
        self.last_commit_s = time.monotonic()
        self.journal.committed()
        return left_out

    def _write_again(self) -> None:
        """cachefs.db was removed (or replaced) behind the daemon while mounted (a cleanup
        script, an operator): SQLite went on writing the removed file, and at the next
        mount the cache directory had cached data and no database: refused, its dirty
        data stranded (fsynced writes never reached BACKING; a helper's hunt). The
        daemon's database is copied under its name again (SQLite's backup), and used from
        then on. A file found in its place is set aside, not overwritten. Fails (the disk
        full): logged, tried again at the next commit."""
        tmp = self.path + ".rewrite"
        try:
            for tail in ("", "-wal", "-journal"):
                if os.path.exists(tmp + tail):
                    os.unlink(tmp + tail)
            new = sqlite3.connect(tmp)
            try:
                self._db.backup(new)
            finally:
                new.close()
            os.chmod(tmp, 0o600)
            self._db.close()                # its -wal too, if that still had the name
            self._db = None
            there = _ident(self.path)
            aside = f"{self.path}.found-{time.strftime('%Y%m%d-%H%M%S')}"
            if there is not None:
                os.rename(self.path, aside)
            for tail in ("-wal", "-shm"):
                if os.path.exists(self.path + tail):
                    os.rename(self.path + tail, (aside if there is not None else
                                                 self.path + ".found") + tail)
            os.rename(tmp, self.path)
            fsync_dir(self.cache_dir)
        except (OSError, sqlite3.Error) as exc:
            if self._db is None:
                self._db = _connect(tmp if os.path.exists(tmp) else self.path)
            log.error("the metadata database %s was removed or replaced behind cachefs "
                      "while mounted, and writing it again failed (%s): tried again at the "
                      "next commit", self.path, exc)
            return
        self._db = _connect(self.path)
        self._ident = _ident(self.path)
        log.error("the metadata database %s was removed or replaced behind cachefs while "
                  "mounted: written again from the daemon's copy%s; keep cleaners and "
                  "scripts out of the cache directory", self.path,
                  f" (the file found in its place is now {aside})" if there is not None
                  else "")

    def close(self, clean: bool) -> None:
        if self._db is None:
            return
        self.journal.close()
        try:
            if clean:
                self.journal.clear()
                with self._lock:
                    self._db.execute("PRAGMA synchronous=FULL")
                room.with_room(self.cache_dir, lambda: self.set_meta("clean", "1"))
                with self._lock:
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            with self._lock:
                self._db.close()
                self._db = None
