"""BACKING I/O in worker threads: a bounded limiter and timeouts.

Owns every syscall on BACKING. Threads get paths, fds, offsets and bytes; they never touch
extents, the store or stats. Read-only calls are abandoned when they exceed the timeout (the
caller gets EIO, the mount stays responsive); mutations are never abandoned, because giving up
on a write that may still land would break ordering.
"""

from __future__ import annotations

import ctypes
import inspect
import os
from typing import Any, Callable

import trio

from . import aio
from .errors import BackingTimeout
from .statx import fresh_fstat

_ABANDON_KW = ("abandon_on_cancel" if "abandon_on_cancel"
               in inspect.signature(trio.to_thread.run_sync).parameters else "cancellable")


class Backing:
    def __init__(self, threads: int, timeout_s: float):
        self._limiter = trio.CapacityLimiter(threads)
        self.timeout_s = timeout_s

    async def read_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a read-only call in a thread; raise BackingTimeout (EIO) if it stalls."""
        with trio.move_on_after(self.timeout_s):
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter,
                                                 **{_ABANDON_KW: True})
        raise BackingTimeout(what, self.timeout_s)

    async def write_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a mutating call in a thread and wait for it, however long BACKING takes."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def pread(self, fd: int, size: int, off: int) -> bytes:
        return await self.read_call("read", os.pread, fd, size, off)

    async def pwrite_stat(self, fd: int, direct_fd: int, data: bytes, off: int
                          ) -> tuple[int, os.stat_result]:
        return await self.write_call(_pwrite_stat, fd, direct_fd, data, off)

    async def lstat(self, path: bytes) -> os.stat_result:
        return await self.read_call("stat", os.lstat, path)

    async def fstat(self, fd: int) -> os.stat_result:
        return await self.read_call("stat", os.fstat, fd)


def _pwrite_stat(fd: int, direct_fd: int, data: bytes, off: int
                 ) -> tuple[int, os.stat_result]:
    """Write all of `data` at `off`, then fstat: one thread hop. An aligned write goes as
    asynchronous direct I/O, so writes to one file of a FUSE BACKING can overlap."""
    aio.pwrite_all(fd, direct_fd, [(data, off)])
    return len(data), fresh_fstat(fd)        # not the kernel's cached attributes (issue 9)


# -- namespace operations, each one thread call ---------------------------------------------

def chown_new(path: bytes, uid: int, gid: int, parent: bytes) -> os.stat_result:
    """Give a new node to the caller, as BACKING would if the caller had made it.

    Inside a set-group-ID directory the group is inherited (BACKING already set it).
    """
    if os.geteuid() == 0:
        if os.stat(parent).st_mode & 0o2000:
            gid = -1
        os.chown(path, uid, gid, follow_symlinks=False)
    return os.lstat(path)


def create(path: bytes, flags: int, mode: int, uid: int, gid: int, parent: bytes
           ) -> tuple[int, os.stat_result]:
    fd = os.open(path, flags | os.O_CREAT, mode)
    try:
        chown_new(path, uid, gid, parent)
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def mknod(path: bytes, mode: int, rdev: int, uid: int, gid: int, parent: bytes
          ) -> os.stat_result:
    os.mknod(path, mode, rdev)
    return chown_new(path, uid, gid, parent)


def mkdir(path: bytes, mode: int, uid: int, gid: int, parent: bytes) -> os.stat_result:
    os.mkdir(path, mode)
    return chown_new(path, uid, gid, parent)


def symlink(target: bytes, path: bytes, uid: int, gid: int, parent: bytes) -> os.stat_result:
    os.symlink(target, path)
    return chown_new(path, uid, gid, parent)


def unlink(path: bytes) -> os.stat_result:
    st = os.lstat(path)
    os.unlink(path)
    return st


def link(old: bytes, new: bytes) -> os.stat_result:
    os.link(old, new, follow_symlinks=False)
    return os.lstat(new)


_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100


def rename(old: bytes, new: bytes, flags: int) -> tuple[os.stat_result | None, os.stat_result]:
    """Rename with renameat2 flags; returns (the replaced target's stat or None, new stat)."""
    try:
        target = os.lstat(new)
    except FileNotFoundError:
        target = None
    if flags:
        if _libc.renameat2(_AT_FDCWD, old, _AT_FDCWD, new, ctypes.c_uint(flags)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    else:
        os.rename(old, new)
    return target, os.lstat(new)


def setattr(path: bytes, fd: int | None, mode: int | None, uid: int, gid: int,
            times: tuple[int | None, int | None] | None) -> os.stat_result:
    """chmod/chown/utimens in one thread call (size changes go through the engine)."""
    st = os.lstat(path) if fd is None else os.fstat(fd)
    is_link = (st.st_mode & 0o170000) == 0o120000
    if mode is not None and not is_link:
        if fd is not None:
            os.fchmod(fd, mode)
        else:
            os.chmod(path, mode)
    if uid != -1 or gid != -1:
        if fd is not None:
            os.fchown(fd, uid, gid)
        else:
            os.chown(path, uid, gid, follow_symlinks=False)
    if times is not None:
        atime, mtime = times
        ns = (st.st_atime_ns if atime is None else atime,
              st.st_mtime_ns if mtime is None else mtime)
        if fd is not None:
            os.utime(fd, ns=ns)
        else:
            os.utime(path, ns=ns, follow_symlinks=False)
    return os.lstat(path) if fd is None else os.fstat(fd)


def scandir(path: bytes) -> list[tuple[bytes, os.stat_result]]:
    """A directory's entries with their lstat, as a snapshot."""
    out = []
    with os.scandir(path) as it:
        for entry in it:
            try:
                out.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue                            # removed while listing
    return out


def fsync_path(path: bytes, datasync: bool) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        (os.fdatasync if datasync else os.fsync)(fd)
    finally:
        os.close(fd)
