"""Admission, sequential detection and eviction order. Pure bookkeeping: never does I/O.

- `Admission`: an extent is promoted after `promote_after` misses within a recent window, or at
  once if it was evicted recently (a hit in the ghost queue counts as the second access).
- `SequentialDetector`: per open file, bytes read in one forward stream; past the cutoff the
  stream bypasses the cache.
- `Clock`: LRU approximation, the baseline.
- `S3Fifo`: scan-resistant eviction (Yang et al., SOSP 2023): new extents enter a small FIFO
  (10 % of the pool); those used again move to the main FIFO, the rest leave a ghost entry.
  The main FIFO gives used extents another round (a 2-bit frequency). Dirty extents are never
  chosen.
- Both policies never choose an extent of a *protected* inode (pinned files, files being
  prefetched; the set is kept by `cachefs/warm.py` through `protect`/`unprotect`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from .extents import Extent

SMALL, MAIN = 1, 2


class Admission:
    def __init__(self, promote_after: int, window: int = 1 << 16):
        self.promote_after = promote_after
        self._window = window
        self._seen: dict[tuple[int, int], int] = {}
        # ino -> its extents in _seen: forget_file scanned the whole window (up to 65,536
        # keys, ~10 ms on the event loop) at every unlink; `rm -rf` ran ~100 files/s.
        self._by_ino: dict[int, set[int]] = {}

    def note_miss(self, key: tuple[int, int], in_ghost: bool) -> bool:
        """Count one missed access to `key`; True when the extent should be promoted."""
        if in_ghost or self.promote_after <= 1:
            if key in self._seen:
                self._forget(key)
            return True
        n = self._seen.get(key, 0) + 1
        if n >= self.promote_after:
            self._forget(key)
            return True
        if n == 1:
            if len(self._seen) >= self._window:
                for old in list(self._seen)[: self._window // 2]:    # forget the oldest half
                    self._forget(old)
            self._by_ino.setdefault(key[0], set()).add(key[1])
        self._seen[key] = n
        return False

    def forget_file(self, ino: int) -> None:
        for e in self._by_ino.pop(ino, ()):
            del self._seen[(ino, e)]

    def _forget(self, key: tuple[int, int]) -> None:
        del self._seen[key]
        exts = self._by_ino[key[0]]
        exts.discard(key[1])
        if not exts:
            del self._by_ino[key[0]]


class SequentialDetector:
    """Tracks one forward stream; tolerant of the kernel's slightly reordered readahead."""

    __slots__ = ("next_off", "run")
    SLACK = 256 * 1024

    def __init__(self):
        self.next_off = -1
        self.run = 0

    def note(self, off: int, size: int) -> int:
        """Record a read; returns the length in bytes of the stream it belongs to."""
        if self.next_off >= 0 and abs(off - self.next_off) <= self.SLACK:
            self.run += size
        else:
            self.run = size
        self.next_off = max(off + size, self.next_off if self.run > size else 0)
        return self.run


def protect(protected: dict[int, int], ino: int) -> None:
    """One more holder of inode `ino` (pins, prefetches, passthrough opens: each counts)."""
    protected[ino] = protected.get(ino, 0) + 1


def unprotect(protected: dict[int, int], ino: int) -> None:
    n = protected.get(ino, 0) - 1
    if n > 0:
        protected[ino] = n
    else:
        protected.pop(ino, None)


class S3Fifo:
    def __init__(self, capacity_exts: int):
        self.capacity = capacity_exts
        self._small: OrderedDict[tuple[int, int], Extent] = OrderedDict()
        self._main: OrderedDict[tuple[int, int], Extent] = OrderedDict()
        self._ghost: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.protected: dict[int, int] = {}    # inodes whose extents are never chosen

    def protect(self, ino: int) -> None:
        protect(self.protected, ino)

    def unprotect(self, ino: int) -> None:
        unprotect(self.protected, ino)

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def in_ghost(self, key: tuple[int, int]) -> bool:
        return key in self._ghost

    def insert(self, x: Extent) -> None:
        key = x.key
        if self._ghost.pop(key, 0) is None:      # was in the ghost queue: a proven re-use
            x.queue = MAIN
            self._main[key] = x
        else:
            x.queue = SMALL
            self._small[key] = x

    def insert_main(self, x: Extent) -> None:
        """Insert an extent known to be hot (a warm restart) straight into the main FIFO."""
        x.queue = MAIN
        self._main[x.key] = x

    def remove(self, x: Extent) -> None:
        if x.queue == SMALL:
            self._small.pop(x.key, None)
        elif x.queue == MAIN:
            self._main.pop(x.key, None)
        x.queue = None

    def victim(self) -> Extent | None:
        """Choose and unlink the next extent to evict; None if only dirty extents remain."""
        small_target = max(1, self.capacity // 10)
        for _ in range(4 * (len(self) + 1)):
            if self._small and (len(self._small) >= small_target or not self._main):
                key, x = self._small.popitem(last=False)
                if x.dirty or x.freq > 0 or x.ino in self.protected:
                    # used again, written (dirty data cannot leave) or protected: to main.
                    # (Put back into the small queue, a dirty head was met again and again
                    # until the search gave up, with clean extents waiting in main.)
                    x.freq = 0
                    x.queue = MAIN
                    self._main[key] = x
                    continue
                x.queue = None
                self._ghost[key] = None
                while len(self._ghost) > self.capacity:
                    self._ghost.popitem(last=False)
                return x
            if self._main:
                key, x = self._main.popitem(last=False)
                if x.dirty or x.freq > 0 or x.ino in self.protected:
                    if x.freq > 0:
                        x.freq -= 1
                    self._main[key] = x
                    continue
                x.queue = None
                return x
            return None
        return None

    def extents(self) -> Iterator[Extent]:
        yield from self._small.values()
        yield from self._main.values()


class Clock:
    """CLOCK (second chance), the usual LRU approximation: the baseline S3-FIFO is measured
    against (`--eviction clock`)."""

    def __init__(self, capacity_exts: int):
        self.capacity = capacity_exts
        self._q: OrderedDict[tuple[int, int], Extent] = OrderedDict()
        self.protected: dict[int, int] = {}    # inodes whose extents are never chosen

    def protect(self, ino: int) -> None:
        protect(self.protected, ino)

    def unprotect(self, ino: int) -> None:
        unprotect(self.protected, ino)

    def __len__(self) -> int:
        return len(self._q)

    def in_ghost(self, key: tuple[int, int]) -> bool:
        return False

    def insert(self, x: Extent) -> None:
        x.queue = MAIN
        self._q[x.key] = x

    insert_main = insert

    def remove(self, x: Extent) -> None:
        self._q.pop(x.key, None)
        x.queue = None

    def victim(self) -> Extent | None:
        # The hit path only bumps freq (no reordering there); fold it in lazily here.
        for _ in range(2 * (len(self._q) + 1)):
            if not self._q:
                return None
            key, x = self._q.popitem(last=False)
            if x.dirty or x.freq > 0 or x.ino in self.protected:
                x.freq = 0
                self._q[key] = x
                continue
            x.queue = None
            return x
        return None

    def extents(self) -> Iterator[Extent]:
        yield from self._q.values()
