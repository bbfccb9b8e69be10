"""The doubt journal of write-back mode: extents whose clean blocks are being overwritten.

A write-back write that modifies blocks the database may record as clean appends (ino, ext)
here first (one 16-byte `write`, through the file's own descriptor). The journal is rotated
when a batch is taken (`rotate`) and the previous generation removed once that batch is
committed (`committed`); after an unclean stop, recovery treats every valid block of a
journaled extent as dirty (`read`), so data newer than BACKING is never mistaken for clean.
Owns the files doubt.log and doubt.log.prev in the cache directory.
"""

from __future__ import annotations

import os
import struct


class DoubtJournal:
    def __init__(self, cache_dir: str):
        self._cache_dir = cache_dir
        self._fd = -1

    def _path(self, suffix: str) -> str:
        return os.path.join(self._cache_dir, "doubt.log" + suffix)

    def append(self, ino: int, ext: int) -> None:
        if self._fd < 0:
            self._fd = os.open(self._path(""), os.O_WRONLY | os.O_APPEND | os.O_CREAT
                               | os.O_CLOEXEC, 0o600)
        os.write(self._fd, struct.pack("<QQ", ino, ext))

    def rotate(self) -> None:
        """A batch was taken: what is journaled so far belongs to it (the .prev generation)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            if os.path.exists(self._path(".prev")):
                # The previous batch was not committed (requeued): its entries still count.
                with open(self._path(""), "rb") as f:
                    raw = f.read()
                with open(self._path(".prev"), "ab") as f:
                    f.write(raw)
                os.unlink(self._path(""))
            else:
                os.replace(self._path(""), self._path(".prev"))

    def committed(self) -> None:
        """The batch of the .prev generation is committed: its extents' state is recorded."""
        try:
            os.unlink(self._path(".prev"))
        except FileNotFoundError:
            pass

    def read(self) -> set[tuple[int, int]]:
        """Extents in doubt after an unclean stop (both generations)."""
        out: set[tuple[int, int]] = set()
        for suffix in (".prev", ""):
            try:
                with open(self._path(suffix), "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                continue
            for i in range(0, len(raw) - 15, 16):
                out.add(struct.unpack_from("<QQ", raw, i))
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def clear(self) -> None:
        """A clean stop: nothing is in doubt."""
        for suffix in (".prev", ""):
            try:
                os.unlink(self._path(suffix))
            except FileNotFoundError:
                pass
