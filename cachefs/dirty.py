"""The dirty index of write-back mode: which extents hold data newer than BACKING, oldest
first, how many 4 KiB blocks that is, and the events that wake the destager and writers.

Owns `DirtyIndex`: the only code that changes `Extent.dirty` and `CachedFile.dirty_exts`
(through `set` and `clear`, synchronous, so atomic under trio). Knows nothing of I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Iterator

import trio

from .config import BLK_SIZE
from .extents import CachedFile, Extent, popcount


class DirtyIndex:
    """Dirty extents in the order they turned dirty: (ino, ext) -> monotonic time since."""

    def __init__(self) -> None:
        self._since: OrderedDict[tuple[int, int], float] = OrderedDict()
        self.blocks = 0                          # dirty 4 KiB blocks in all extents
        self.files = 0                           # files with dirty extents
        self._dirtied = trio.Event()             # set when data turns dirty (the destager)
        self._cleaned = trio.Event()             # set when data turns clean (writers, flush)

    def __len__(self) -> int:
        return len(self._since)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(ino, ext) of every dirty extent, oldest first."""
        return iter(self._since)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._since

    def set(self, cf: CachedFile, x: Extent, mask: int) -> None:
        """Mark blocks `mask` of extent `x` (of file `cf`) dirty."""
        new = mask & ~x.dirty
        if not new:
            return
        if not x.dirty:
            self._since[x.key] = time.monotonic()
            cf.dirty_exts += 1
            self.files += cf.dirty_exts == 1
            self._dirtied.set()
        x.dirty |= new
        self.blocks += popcount(new)

    def clear(self, cf: CachedFile, x: Extent, mask: int) -> None:
        """Blocks `mask` of extent `x` are no longer dirty (destaged, truncated, dropped)."""
        gone = mask & x.dirty
        if not gone:
            return
        x.dirty &= ~gone
        self.blocks -= popcount(gone)
        if not x.dirty:
            del self._since[x.key]
            cf.dirty_exts -= 1
            self.files -= cf.dirty_exts == 0
            self._cleaned.set()
            self._cleaned = trio.Event()

    def restamp(self, keys: list[tuple[int, int]], since: float) -> None:
        """Extents a destage pass left dirty: every block still dirty was written after the
        pass's snapshot at `since` (the older ones are on BACKING now), so their age starts
        there, not when the extent first turned dirty; otherwise an extent rewritten during
        every pass would look ever older, be "due" forever and be destaged again and again
        instead of letting its rewrites coalesce. Keeps the oldest-first order: extents
        dirtied after `since` stay behind the restamped ones."""
        order = self._since
        later: list[tuple[tuple[int, int], float]] = []
        while order:
            key = next(reversed(order))
            if order[key] <= since:
                break
            later.append((key, order.pop(key)))
        for key in keys:
            if order.get(key, since) < since:
                del order[key]
                order[key] = since
        for key, t in reversed(later):
            order[key] = t

    def bytes(self) -> int:
        return self.blocks * BLK_SIZE

    def oldest_age_s(self) -> float:
        for since in self._since.values():
            return time.monotonic() - since
        return 0.0

    async def wait_dirtied(self, timeout_s: float) -> None:
        """Wait until data turns dirty from now on (or `timeout_s`)."""
        self._dirtied = trio.Event()
        with trio.move_on_after(timeout_s):
            await self._dirtied.wait()

    def wake(self) -> None:
        """Wake the destager as if data had turned dirty (a writer needs room now)."""
        self._dirtied.set()

    async def wait_cleaned(self, timeout_s: float) -> None:
        """Wait until some dirty extent turns clean (or `timeout_s`)."""
        cleaned = self._cleaned
        with trio.move_on_after(timeout_s):
            await cleaned.wait()
