"""Persistence of the extent map: the batches that make cached data and its metadata
durable, in order, and the release of evicted extents' SSD space after them.

Owns the write-back doubt journal bookkeeping of the current batch (`_journaled`), the cache
files written since the last fdatasync (`_written`), evicted extents whose holes wait for a
commit (`_punch`, `_punch_committing`) or are being punched (`_punching`), and the order of
batches (`_lock`). Durability order (DESIGN.md §4): fdatasync the cache files, commit the
batch (in the store's thread, off the event loop), then punch the holes of extents the
commit forgot. A failed commit puts the batch back (`MetadataStore.requeue`) under newer
changes. Imports only the store, the cache files and stats: the engine reaches it, never the
reverse; what a full SSD means for the pool is the engine's (`Space`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import sqlite3
import time
from typing import Protocol

import trio

from .cachefiles import CacheFiles, fdatasync_paths
from .stats import Stats
from .room import is_full
from .store import MetadataStore

log = logging.getLogger("cachefs.persist")

PUNCH_CHUNK = 256          # holes punched per thread call (~256 fallocate calls, ~ms)


class Space(Protocol):
    """The engine's handling of a full or failing SSD, as the persister reports it."""

    def ssd_failed(self, exc: OSError, what: str) -> None: ...
    def out_of_space(self) -> None: ...
    def reserve_given_up(self) -> None: ...
    def committed(self, batch: tuple) -> None: ...
    def check_room(self) -> None: ...
    def space_released(self) -> None: ...
    def regrow_pool(self) -> None: ...


class Persister:
    def __init__(self, store: MetadataStore, cachefiles: CacheFiles, stats: Stats,
                 space: Space, commit_interval_s: float):
        self._store = store
        self._files = cachefiles
        self._stats = stats
        self._space = space
        self._interval_s = commit_interval_s
        self._written: set[int] = set()              # inos with cache data not yet fdatasync'd
        self._punch: dict[tuple[int, int], None] = {}          # evicted, not yet committed
        self._punch_committing: dict[tuple[int, int], None] = {}
        self._punching: set[tuple[int, int]] = set()           # holes being punched now
        self._punched = trio.Event()                           # set when those are done
        self._journaled: set[tuple[int, int]] = set()          # in the doubt journal already
        self._lock = trio.Lock()                 # batches commit in the order they are taken
        self._warned_s = -1e9

    # -- what the engine reports (sync) ------------------------------------------------------

    def written(self, ino: int) -> None:
        """Cache data of `ino` changed: fdatasync it before the next commit."""
        self._written.add(ino)

    def evicted(self, key: tuple[int, int]) -> None:
        """Extent `key` was forgotten: release its SSD space after the next commit."""
        self._punch[key] = None

    def reused(self, key: tuple[int, int]) -> None:
        """Extent `key` holds cached data again: its hole must not be punched."""
        self._punch.pop(key, None)
        self._punch_committing.pop(key, None)

    def punching(self, key: tuple[int, int]) -> bool:
        """True while the hole of extent `key` is being punched (no data may go there)."""
        return key in self._punching

    def releasing(self, key: tuple[int, int]) -> bool:
        """True if the SSD space of extent `key` is to be released or being released."""
        return key in self._punch or key in self._punch_committing or key in self._punching

    async def wait_punched(self) -> None:
        """Wait until the holes being punched now are punched (a writer that needs one of
        those extents must not put data there before: the punch would zero it)."""
        if self._punching:
            await self._punched.wait()

    def journal_dirtying(self, key: tuple[int, int]) -> None:
        """Clean blocks of extent `key` are about to be overwritten with dirty data: note it
        in the doubt journal first (once per batch)."""
        if key not in self._journaled:
            self._store.journal.append(*key)
            self._journaled.add(key)

    # -- committing --------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Commit queued metadata in batches, every commit interval."""
        task_status.started()
        while True:
            await trio.sleep(self._interval_s)
            self._space.check_room()
            await self.persist()

    async def persist(self, durable: bool = False) -> None:
        """fdatasync cache data, commit the metadata claiming it, then release evicted space.

        Batches commit in the order they were taken (one at a time); a durable request
        waits for its own batch, so everything queued before it is on the SSD when it returns.
        """
        async with self._lock:
            await self._persist_locked(durable)

    async def _persist_locked(self, durable: bool) -> None:
        store = self._store
        if not store.pending() and not self._punch and not self._written:
            return
        # Once taken, a batch is committed (or requeued) and its holes punched whatever
        # cancels the caller (the unmount cancelling the periodic commit, a flush with a
        # timeout): a batch lost half-way would lose its drops, whose holes the next commit
        # punches (valid rows over holes), and its dirty marks. Only the SSD is waited for.
        with trio.CancelScope(shield=True):
            await self._commit_batch(durable)

    async def _commit_batch(self, durable: bool) -> None:
        store = self._store
        self._journaled = set()                 # the journal rotates with the batch
        batch = store.take_batch()
        self._punch_committing.update(self._punch)
        self._punch = {}
        written = set(self._written)
        self._written = set()
        try:
            if written:
                await trio.to_thread.run_sync(fdatasync_paths,
                                              [self._files.path(i) for i in written])
            try:      # in the store's thread: the event loop (and every hit) goes on
                left_out = await store.commit_async(batch,
                                                    durable or bool(self._punch_committing))
            except sqlite3.OperationalError as exc:
                if not is_full(exc) or not store.release_reserve():
                    raise
                # The reserve file made room for this commit (it forgets evicted extents,
                # whose holes free more once punched).
                self._metadata_failed(exc)
                left_out = await store.commit_async(batch,
                                                    durable or bool(self._punch_committing))
            self._stats.internal_errors += left_out     # (the store logged them)
        except (OSError, sqlite3.Error) as exc:
            # A full or failing SSD: keep everything queued for the next try (the mount
            # goes on; a durable request fails, as an fsync of a failing disk must).
            store.requeue(batch)
            self._written |= written
            self._punch.update(self._punch_committing)
            self._punch_committing = {}
            self._metadata_failed(exc)
            if durable:
                raise OSError(errno.EIO, f"the cache's metadata could not be committed: "
                              f"{exc}") from None
            return
        self._space.committed(batch)
        punched = bool(self._punch_committing)
        while self._punch_committing:
            # A bounded chunk at a time: a writer that needs one of these extents waits for
            # its chunk only, and a key reused before its chunk starts (`reused`) leaves
            # `_punch_committing` and is never punched.
            keys = list(itertools.islice(self._punch_committing, PUNCH_CHUNK))
            for key in keys:
                del self._punch_committing[key]
            self._punching = set(keys)
            self._punched = trio.Event()
            try:
                await trio.to_thread.run_sync(self._files.punch_holes, keys)
            except OSError as exc:      # the space stays used; the map no longer claims it
                self._space.ssd_failed(exc, "releasing evicted space")
                self._punch_committing = {}
            finally:
                self._punching = set()
                self._punched.set()
        if punched and store.ensure_reserve():     # space was released: try the SSD again
            self._space.space_released()
        self._space.regrow_pool()

    def _metadata_failed(self, exc: Exception) -> None:
        """A commit failed (SQLite or the SSD): out of space, release the reserve file so the
        next commit (which forgets evicted extents, whose holes then free space) fits."""
        self._stats.metadata_errors += 1
        full = is_full(exc)
        if full:
            self._store.release_reserve()
            self._space.reserve_given_up()
            self._space.out_of_space()
        now = time.monotonic()
        if now - self._warned_s >= 60:
            self._warned_s = now
            log.warning("committing cache metadata failed (%s); it stays queued and is "
                        "retried%s", exc, "; the cache filesystem is full: evicting clean "
                        "data" if full else "")
