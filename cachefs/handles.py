"""Open file handles and the life of their BACKING descriptors.

Owns `Handles`: fh -> OpenFile, the handles of each inode, and the descriptors of released
handles. A request that borrows a handle's descriptor (getattr, setattr, xattrs of an open
unlinked file) holds it (`borrow`), and a released descriptor is closed only when no
borrower uses it any more, so no descriptor is used after, or while, it is closed (its
number would name another file). Released descriptors are closed in batches by several
closer tasks (`run_closer`, through `Namespace.close_all`), and opens wait while too many
closes are pending (`wait_for_fds`), so descriptors never pile up under open/close churn.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import resource
from typing import Iterator

import trio

from .errors import BackingTimeout
from .hit import OpenFile
from .namespace import Namespace

log = logging.getLogger("cachefs.fs")

CLOSERS = 4                 # closer tasks (each closes a batch of fds in one thread call)
CLOSE_BATCH = 256           # fds closed by one thread call at most
MAX_PENDING_CLOSES = 1024   # open() and create() wait while more fds wait to be closed
FD_RESERVE = 256            # descriptors kept for the daemon's own work (cache, SQLite, ...)
FDS_PER_HANDLE = 4          # at most: BACKING's, an O_DIRECT one, its file's cache file and
                            # the destager's BACKING descriptor (write-back)
RECOUNT_EVERY = 32          # opens between two counts of the descriptors really in use


class Handles:
    def __init__(self, namespace: Namespace, write_back: bool = False):
        self._ns = namespace
        self._write_back = write_back
        self.open: dict[int, OpenFile] = {}
        self._by_ino: dict[int, list[OpenFile]] = {}         # ino -> its open handles
        # Released BACKING fds: queued for the closers; the queue is unbounded, but open()
        # waits while more than MAX_PENDING_CLOSES are queued or being closed.
        self._close_send, self._close_recv = trio.open_memory_channel(math.inf)
        self._closes_pending = 0
        self._close_progress = trio.Event()       # set (and replaced) when a batch closed
        self._borrowed: dict[int, int] = {}       # BACKING fd -> requests using it now
        self._retired: set[int] = set()           # released while borrowed: the last closes
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        # (A floor above the limit itself let handles take every descriptor under a small
        # limit: a write-back fsync then failed with EIO, its commit out of descriptors.)
        self._handle_budget = (max(soft - FD_RESERVE, soft // 4)
                               if soft != resource.RLIM_INFINITY else 1 << 30)
        self._counted = (0, -RECOUNT_EVERY)     # (descriptors in use, len(open)) when counted

    def has(self, ino: int) -> bool:
        """True while inode `ino` has an open handle."""
        return ino in self._by_ino

    def remove(self, fh: int) -> OpenFile:
        """Forget a released handle (its descriptors: close_later)."""
        of = self.open.pop(fh)
        handles = self._by_ino[of.ino]
        handles.remove(of)
        if not handles:
            del self._by_ino[of.ino]
        return of

    def close_later(self, fds: list[int]) -> None:
        """Close a released handle's descriptors once no borrower holds them."""
        for fd in fds:
            if fd in self._borrowed:
                self._retired.add(fd)           # the last borrower queues the close
            else:
                self.queue_close(fd)

    def add(self, of: OpenFile) -> None:
        self.open[of.fh] = of
        self._by_ino.setdefault(of.ino, []).append(of)

    @contextlib.contextmanager
    def borrow(self, inode: int, fh: int | None = None, writable: bool = False
                ) -> Iterator[int | None]:
        """Hold a BACKING fd of an open handle of `inode` (the one named by `fh` if it fits),
        or None: it reaches the file even after its last name is gone. While held, a release
        of the handle does not close it (the last borrower queues the close), so the number
        cannot name another file meanwhile. After a timed-out call (its thread may still run
        with the fd) the fd is never closed: a leak, never a use of a reused number."""
        def fits(of: OpenFile) -> bool:
            return not writable or of.flags & os.O_ACCMODE != os.O_RDONLY
        of = self.open.get(fh) if fh is not None else None
        if of is None or not fits(of):
            of = next((o for o in self._by_ino.get(inode, ()) if fits(o)), None)
        if of is None:
            yield None
            return
        fd = of.backing_fd
        self._borrowed[fd] = self._borrowed.get(fd, 0) + 1
        abandoned = False
        try:
            yield fd
        except BackingTimeout:
            abandoned = True
            raise
        finally:
            n = self._borrowed.pop(fd) - 1
            if n:
                self._borrowed[fd] = n
            elif fd in self._retired:
                self._retired.discard(fd)
                if abandoned:
                    log.warning("a BACKING call on a released file timed out; its descriptor "
                                "stays open")
                else:
                    self.queue_close(fd)

    def queue_close(self, fd: int) -> None:
        self._closes_pending += 1
        self._close_send.send_nowait(fd)

    async def wait_for_fds(self) -> None:
        """Before opening: wait while released fds pile up unclosed; refuse (ENFILE) when
        the handles would take the descriptors the daemon needs for its own work."""
        while self._closes_pending > MAX_PENDING_CLOSES:
            await self._close_progress.wait()
        if self._fds_in_use() >= self._handle_budget:
            raise OSError(errno.ENFILE, os.strerror(errno.ENFILE))

    def _fds_in_use(self) -> int:
        """The daemon's descriptors in use, or more. A handle takes 1 to FDS_PER_HANDLE of
        them (a write-back handle of a file of its own: 3; the guard's old estimate of 2
        let write-back opens run the daemon out of descriptors, and destages, commits and
        fsyncs failed with EMFILE). Far below the budget even at that rate: no count. Near
        it: /proc/self/fd is counted every RECOUNT_EVERY opens, FDS_PER_HANDLE for each
        handle opened since, and in write-back one for each file written through an open
        handle that has no destager descriptor yet (its first write dups one)."""
        n = len(self.open)
        if FDS_PER_HANDLE * n + self._closes_pending < self._handle_budget // 2:
            return 0
        counted, at = self._counted
        if abs(n - at) >= RECOUNT_EVERY:
            try:
                counted, at = len(os.listdir("/proc/self/fd")), n
            except OSError:
                counted, at = FDS_PER_HANDLE * n + self._closes_pending, n
            if self._write_back:
                counted += len({id(of.cfile) for of in self.open.values()
                                if of.flags & os.O_ACCMODE != os.O_RDONLY
                                and of.cfile.wb_fd < 0})
            self._counted = (counted, at)
        return counted + FDS_PER_HANDLE * max(0, n - at)

    async def run_closer(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Close released BACKING fds in threads, so release() answers the kernel at once
        (a close on NFS may flush for a long time): CLOSERS tasks, each taking every queued
        fd (up to CLOSE_BATCH) into one thread call."""
        async with trio.open_nursery() as nursery:
            for _ in range(CLOSERS):
                nursery.start_soon(self._closer)
            task_status.started()

    async def _closer(self) -> None:
        async for fd in self._close_recv:
            batch = [fd]
            while len(batch) < CLOSE_BATCH:
                try:
                    batch.append(self._close_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                errors = await self._ns.close_all(batch)
            finally:
                self._closes_pending -= len(batch)
                self._close_progress.set()
                self._close_progress = trio.Event()
            for err in errors:
                log.warning("closing a BACKING file failed: %s", err)

