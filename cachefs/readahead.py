"""Read-ahead for sequential streams that bypass the cache.

A stream past --sequential-cutoff is served from BACKING. One request at a time leaves the
BACKING link idle while each answer travels back through FUSE, so the stream would run
slower than BACKING alone. While serving request N the engine starts reads of the next
requests past the furthest one seen (same size, one thread call each; up to `WINDOW` bytes),
and those requests then take the bytes read ahead instead of reading BACKING.

Bytes read ahead are used only if nothing could have changed them: cachefs made no change
to the file's BACKING data between the read and its use (`CachedFile.change_seq`,
`trunc_seq`, no write in flight at either time), and they are at most `MAX_AGE_S` old (a
change by another BACKING client is seen no later than with --attr-timeout). Otherwise the
request reads BACKING as without read-ahead. Write-back's dirty blocks are laid over them by
the caller, as over any BACKING read.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from .extents import CachedFile

WINDOW = 16 << 20          # bytes read ahead of a stream, at most
MAX_DEPTH = 16             # requests read ahead of a stream, at most
MAX_AGE_S = 1.0            # older bytes read ahead are not used


def depth(size: int) -> int:
    """How many requests of `size` bytes to keep read ahead. Measured on the emulator
    (seq-read-1m, 1 MiB requests, QD 4, BACKING alone 105 IOPS): 2 ahead 92, 4 ahead 93-95,
    8 ahead 97-99, 16 ahead 103 (97 with the thread cap in readpath.py). Linux's NFS client
    long read ahead about as much (15 x rsize)."""
    return max(1, min(MAX_DEPTH, WINDOW // max(size, 1)))


class Ahead:
    """One read ahead: its range, the file's change token when it started, its bytes."""

    __slots__ = ("off", "size", "token", "born", "done", "data")

    def __init__(self, off: int, size: int, token: tuple[int, int]):
        self.off = off
        self.size = size
        self.token = token
        self.born = time.monotonic()
        self.done = trio.Event()
        self.data: bytes | None = None


def token(cf: "CachedFile") -> tuple[int, int]:
    return cf.change_seq, cf.trunc_seq


def usable(ahead: Ahead, cf: "CachedFile") -> bool:
    return (ahead.data is not None and ahead.token == token(cf) and not cf.writes_inflight
            and time.monotonic() - ahead.born <= MAX_AGE_S)


def pread_close(fd: int, size: int, off: int) -> bytes:
    """pread from a descriptor dup'ed for this read, then close it (runs in a thread): the
    handle's own descriptor may be closed and its number reused while the read waits."""
    try:
        return os.pread(fd, size, off)
    finally:
        os.close(fd)
