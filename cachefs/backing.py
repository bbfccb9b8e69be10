"""BACKING I/O in worker threads: a bounded limiter, timeouts, and the report of every call's
outcome to `BackingHealth` (health.py).

Owns how every syscall on BACKING runs (the calls on paths are in backingpaths.py; the data
calls are here). Threads get paths, fds, offsets and bytes; they never touch extents, the
store or stats. Read-only calls are abandoned when they exceed the timeout (the caller gets
EIO, the mount stays responsive); mutations are never abandoned, because giving up on a
write that may still land would break ordering.
"""

from __future__ import annotations

import errno
import inspect
import os
import time
from typing import Any, Callable

import trio

from . import aio
from .backingpaths import lstat, setxattr, symlink
from .errors import BackingTimeout
from .health import COUNTED, BackingHealth
from .statx import fresh_fstat

ABANDON_KW = ("abandon_on_cancel" if "abandon_on_cancel"
               in inspect.signature(trio.to_thread.run_sync).parameters else "cancellable")


# Filesystems whose metadata calls answer from local memory or a local disk (statfs f_type):
# on them those calls run on the event loop, where a thread hand-off would cost more than
# the call (about 300 us a call here; `tar x` of small files makes ~12 such calls a file).
LOCAL_FS_TYPES = {0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs",
                  0x01021994: "tmpfs", 0xF2F52010: "f2fs", 0x2FC12FC1: "zfs",
                  0xCA451A4E: "bcachefs"}
# The calls that may run inline there: metadata, small writes to the page cache, and small
# reads of what the page cache holds already (RWF_NOWAIT: never a wait for the disk).
# Other data reads, directory listings, fsync and destage writes always go to threads.
INLINE_OPS = frozenset({"stat", "open", "getxattr", "listxattr", "readlink", "statfs",
                        "setattr", "setxattr", "removexattr", "mkdir", "mknod", "symlink",
                        "link", "unlink", "rename", "rmdir", "create", "truncate"})
INLINE_WRITE_MAX = 64 << 10
INLINE_READ_MAX = 128 << 10      # a FUSE read (max_read), a promotion's 64 KiB extent
# Inline calls are followed by a schedule point at most this often: a pass through trio's
# scheduler costs more than most inline calls, and pyfuse3 (pyfuse3-queued-requests.patch)
# already lets the other tasks run every 16 requests; this bounds loops of inline calls
# outside FUSE requests (a destage pass of small runs, a cancelled caller's loop).
INLINE_YIELD_S = 0.001


class Backing:
    """Every BACKING call runs through `read_call` or `write_call` (or `close_all`), which
    report its outcome to `health`: counted failures (health.COUNTED) and timeouts there,
    and a success only as one attribute set and one test.

    With `inline` (a BACKING on a local filesystem, LOCAL_FS_TYPES) the calls of INLINE_OPS
    and small page-cache writes run on the event loop instead of in a thread. Never on a
    network or FUSE BACKING, whose calls can hang: there every call is in a thread, bounded
    by the limiter and (reads) by the timeout."""

    def __init__(self, threads: int, timeout_s: float, root_fd: int = -1,
                 health: BackingHealth | None = None, inline: bool = False):
        self._limiter = trio.CapacityLimiter(threads)
        self.timeout_s = timeout_s
        self.root_fd = root_fd          # BACKING's root (open_root): paths are relative to it
        self.health = health if health is not None else BackingHealth()
        self.inline = inline
        self._yielded_s = 0.0           # the last schedule point after an inline call

    def _inline_call(self, what: str, fn: Callable[..., Any], args: tuple) -> Any:
        health = self.health
        period = health.period
        try:
            result = fn(*args)
        except OSError as exc:
            if counted(fn, exc):
                health.failed(what, exc, self.describe(fn, args))
            raise
        health.ok_s = _now()
        if health.failing_since_s is not None:
            health.succeeded(what, period)
        return result

    def _yield_due(self) -> bool:
        """After an inline call: whether a schedule point is due (INLINE_YIELD_S)."""
        now = self.health.ok_s
        if now - self._yielded_s < INLINE_YIELD_S:
            return False
        self._yielded_s = now
        return True

    async def read_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a read-only call in a thread; raise BackingTimeout (EIO) if it stalls."""
        if self.inline and what in INLINE_OPS:
            result = self._inline_call(what, fn, args)
            if self._yield_due():
                await trio.lowlevel.checkpoint()
            return result
        health = self.health
        period = health.period
        n = health.read_seq = health.read_seq + 1
        health.reads[n] = _now()                # the thread takes it out when fn returns
        try:
            with trio.move_on_after(self.timeout_s):
                result = await trio.to_thread.run_sync(_read_done, health.reads, n, fn, args,
                                                       limiter=self._limiter,
                                                       **{ABANDON_KW: True})
                health.ok_s = _now()
                if health.failing_since_s is not None:
                    health.succeeded(what, period)
                return result
        except OSError as exc:
            if counted(fn, exc):
                health.failed(what, exc, self.describe(fn, args))
            raise
        health.timed_out(what, self.describe(fn, args), self.timeout_s)
        raise BackingTimeout(what, self.timeout_s)

    async def write_call(self, fn: Callable[..., Any], *args: Any,
                         abandon_on_cancel: bool = False) -> Any:
        """Run a mutating call in a thread and wait for it, however long BACKING takes;
        `abandon_on_cancel`: unless the caller is cancelled (the destager, at unmount: its
        pass then never completes, so its data stays dirty on the SSD, and the unmount
        does not wait for a hung BACKING)."""
        if self.inline:
            what = op_name(fn)
            if what in INLINE_OPS or (fn is _pwrite_stat and _small_buffered(*args[1:4])):
                result = self._inline_call(what, fn, args)
                if self._yield_due():
                    await trio.lowlevel.checkpoint()
                return result
        health = self.health
        period = health.period
        n = health.write_seq = health.write_seq + 1
        health.writes[n] = (fn, args, _now())          # a write that never returns shows
        try:
            result = await trio.to_thread.run_sync(fn, *args, limiter=self._limiter,
                                                   **{ABANDON_KW: abandon_on_cancel})
        except OSError as exc:
            if counted(fn, exc):
                health.failed(op_name(fn), exc, self.describe(fn, args))
            raise
        finally:
            del health.writes[n]
        health.ok_s = _now()
        if health.failing_since_s is not None:
            health.succeeded(op_name(fn), period)
        return result

    async def close_all(self, fds: list[int]) -> list[OSError]:
        """Close released BACKING fds in one thread call. Counted failures (a close on NFS
        may report a failed flush) go to `health`; returns the others."""
        errors = await trio.to_thread.run_sync(close_all, fds, limiter=self._limiter)
        rest = []
        for exc in errors:
            if exc.errno in COUNTED:
                self.health.failed("close", exc, "a released file")
            else:
                rest.append(exc)
        return rest

    def describe(self, fn: Callable[..., Any], args: tuple) -> str:
        """What a failed call was on, for the log: a BACKING path (absolute) or the path of
        the descriptor it used. Only called on a failure; never touches BACKING (the paths
        of descriptors come from /proc)."""
        root = self.root_fd
        try:
            if args and args[0] == root and isinstance(args[0], int):
                rest = args[2:] if fn is symlink else args[1:]
                for a in rest:
                    if isinstance(a, bytes):
                        base = _fd_path(root)
                        return base if not a or a == b"." else \
                            f"{base.rstrip('/')}/{os.fsdecode(a)}"
                for a in rest[:2]:
                    if isinstance(a, int) and a >= 0:
                        return _fd_path(a)
                return _fd_path(root)
            for a in args[:2]:
                if isinstance(a, int) and not isinstance(a, bool) and a >= 0:
                    return _fd_path(a)
        except OSError:
            pass
        return "BACKING"

    def what(self, fn: Callable[..., Any], args: tuple) -> str:
        """A call for the log: `write of /srv/slow/f`."""
        return f"{op_name(fn)} of {self.describe(fn, args)}"

    async def pread(self, fd: int, size: int, off: int) -> bytes:
        if self.inline and size <= INLINE_READ_MAX:
            # Bytes BACKING's page cache holds (a file just written through the mount, read
            # back by git, a compiler, tar): on the loop, ~50x cheaper than a thread hop.
            data = self._inline_call("read", pread_cached, (fd, size, off))
            if data is not None:
                if self._yield_due():
                    await trio.lowlevel.checkpoint()
                return data
        return await self.read_call("read", os.pread, fd, size, off)

    async def pwrite_stat(self, fd: int, direct_fd: int, data: bytes, off: int
                          ) -> tuple[int, os.stat_result]:
        return await self.write_call(_pwrite_stat, fd, direct_fd, data, off, not self.inline)

    async def lstat(self, path: bytes) -> os.stat_result:
        return await self.read_call("stat", lstat, self.root_fd, path)

    async def fstat(self, fd: int) -> os.stat_result:
        return await self.read_call("stat", os.fstat, fd)


_now = time.monotonic


def _read_done(reads: dict, n: int, fn: Callable[..., Any], args: tuple) -> Any:
    """A read call in its thread: done (returned or raised), also after its caller timed
    out and went on (BackingHealth.reads_hung)."""
    try:
        return fn(*args)
    finally:
        reads.pop(n, None)

# The operation a function performs, for the log (read_call callers name theirs).
_OP_NAMES = {"_pwrite_stat": "write", "pwrite_all": "write", "truncate_stat": "truncate",
             "fsync_path": "fsync", "fallocate_stat": "fallocate", "fdatasync": "fsync",
             "_destage_io": "destage write",
             "open_by_ino": "open", "_writable_twin": "open", "open_direct": "open",
             "_open_fstat": "open", "_create_twin": "create", "close_all": "close",
             "create": "create", "dio_align": "open"}


def counted(fn: Callable[..., Any], exc: OSError) -> bool:
    """Whether a failed call tells of BACKING's health (health.COUNTED). ENOSPC from
    setxattr is this attribute not fitting (ext4: the xattr space of one inode), not a full
    file system, and ENXIO from lseek is SEEK_DATA/SEEK_HOLE's answer past the end or after
    the last data (a file that shrank meanwhile), not a device gone: the caller gets them,
    as on BACKING itself."""
    return exc.errno in COUNTED and not (fn is setxattr and exc.errno == errno.ENOSPC
                                         or fn is os.lseek and exc.errno == errno.ENXIO)


def op_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", "call")
    return _OP_NAMES.get(name, name.lstrip("_"))


def _fd_path(fd: int) -> str:
    """The path of a descriptor, for the log. The kernel marks it " (deleted)" also when it
    merely dropped the name from its cache (a FUSE or network BACKING after an error):
    said only of a file with no link left."""
    path = os.readlink(f"/proc/self/fd/{fd}")
    if path.endswith(" (deleted)"):
        try:
            if os.fstat(fd).st_nlink:
                path = path[:-len(" (deleted)")]
        except OSError:
            pass
    return path


def pread_cached(fd: int, size: int, off: int) -> bytes | None:
    """`size` bytes at `off` (fewer at the end of the file) if the page cache holds them all,
    else None: preadv2 with RWF_NOWAIT, which never waits for the disk (or a lock)."""
    buf = bytearray(size)
    try:
        n = os.preadv(fd, [buf], off, _RWF_NOWAIT)
        if 0 < n < size and os.preadv(fd, [memoryview(buf)[n:]], off + n, _RWF_NOWAIT):
            return None                 # more follows, but not all of it was cached
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
            return None                 # not cached, or the filesystem cannot say
        raise
    return bytes(buf) if n == size else bytes(buf[:n])


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0x8)


def _small_buffered(direct_fd: int, data: bytes, off: int) -> bool:
    """A write that goes to the page cache (not through the O_DIRECT twin) and is small."""
    return len(data) <= INLINE_WRITE_MAX and (direct_fd < 0 or not aio.aligned(off, len(data)))


def _pwrite_stat(fd: int, direct_fd: int, data: bytes, off: int, fresh: bool = True
                 ) -> tuple[int, os.stat_result]:
    """Write `data` at `off`, then fstat: one thread hop; (bytes written, stat): all of
    them, or fewer if BACKING stopped part way (full). An aligned write goes as
    asynchronous direct I/O, so writes to one file of a FUSE BACKING can overlap. `fresh`:
    the attributes from the filesystem, not the kernel's cache of them (a network or FUSE
    BACKING, issue 9); a local filesystem's fstat is never stale, and 7x cheaper (2 us
    against 14 us for statx through ctypes)."""
    written = len(data)
    try:
        if direct_fd < 0:
            aio.pwrite_plain(fd, data, off)
        else:
            aio.pwrite_all(fd, direct_fd, [(data, off)])
    except aio.ShortWrite as exc:       # BACKING filled up part way: the count, as write(2)
        written = exc.done
    return written, fresh_fstat(fd) if fresh else os.fstat(fd)


def close_all(fds: list[int]) -> list[OSError]:
    """Close released BACKING fds (one thread call for a batch); returns the errors."""
    errors = []
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            errors.append(exc)
    return errors
