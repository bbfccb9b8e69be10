"""The pyfuse3 `Operations`: translates FUSE requests into engine and BACKING calls.

Owns request translation and the single errno mapping: the only place that raises FUSEError.
Never runs SQL or touches extent state; BACKING syscalls run through `Backing` (threads with
a limiter and timeouts), cache data through `Cache`.

Also owns the life of the BACKING descriptors of open handles once released: a request that
borrows a handle's descriptor (getattr, setattr, xattrs of an open unlinked file) holds it
(`_borrow`), and a released descriptor is closed only when no borrower uses it any more, so
no descriptor is used after, or while, it is closed (its number would name another file).
Released descriptors are closed in batches by several closer tasks, and open() waits while
too many closes are pending, so descriptors never pile up under open/close churn.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import resource
import stat as stat_mod
import time
from typing import Iterator

import pyfuse3
import trio
from pyfuse3 import FUSEError

from . import backing as bk
from .backing import Backing
from .cache import Cache
from .hit import OpenFile
from .config import EXT_SIZE, Config
from .errors import BackingTimeout
from .inodes import ROOT_INODE, InodeTable

log = logging.getLogger("cachefs.fs")

CONTROL_XATTR = b"user.cachefs.control"
BLKSIZE = 128 * 1024
CLOSERS = 4                 # closer tasks (each closes a batch of fds in one thread call)
CLOSE_BATCH = 256           # fds closed by one thread call at most
MAX_PENDING_CLOSES = 1024   # open() and create() wait while more fds wait to be closed
FD_RESERVE = 256            # descriptors kept for the daemon's own work (cache, SQLite, ...)


def to_fuse_error(exc: OSError) -> FUSEError:
    return FUSEError(exc.errno or errno.EIO)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, cfg: Config, cache: Cache, backing: Backing, inodes: InodeTable,
                 control_path: str):
        super().__init__()
        self._cfg = cfg
        self._cache = cache
        self._backing = backing
        self._inodes = inodes
        self._control_path = os.fsencode(control_path)
        self._open: dict[int, OpenFile] = {}
        self._handles: dict[int, list[OpenFile]] = {}        # ino -> its open handles
        self._dirs: dict[int, tuple[int, list]] = {}
        self._written_ns: dict[int, int] = {}       # write-back: ino -> time of last write
        self._next_fh = 1
        self._root = backing.root_fd
        # Released BACKING fds: queued for the closers; the queue is unbounded, but open()
        # waits while more than MAX_PENDING_CLOSES are queued or being closed.
        self._close_send, self._close_recv = trio.open_memory_channel(math.inf)
        self._closes_pending = 0
        self._close_progress = trio.Event()       # set (and replaced) when a batch closed
        self._borrowed: dict[int, int] = {}       # BACKING fd -> requests using it now
        self._retired: set[int] = set()           # released while borrowed: the last closes
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._handle_budget = (max(soft - FD_RESERVE, 64) if soft != resource.RLIM_INFINITY
                               else 1 << 30)

    # -- helpers -------------------------------------------------------------------------

    def _attr(self, st: os.stat_result, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = self._cfg.entry_timeout_s
        a.attr_timeout = self._cfg.attr_timeout_s
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_rdev = st.st_rdev
        a.st_size = self._cache.logical_size(ino, st.st_size)
        a.st_blksize = BLKSIZE
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        if self._cache.write_back:
            self._dirty_view(a, st, ino)
        return a

    def _dirty_view(self, a: pyfuse3.EntryAttributes, st: os.stat_result, ino: int) -> None:
        """Write-back: attributes of a file with dirty data as they will be once it reaches
        BACKING. BACKING may hold none of the bytes yet, and a file that claims 0 blocks
        is taken for all holes (GNU tar --sparse archived zeros); its mtime must move with
        the writes, or make and rsync miss the change until the destage."""
        cf = self._cache.files.get(ino)
        if cf is None or not cf.dirty_exts:
            self._written_ns.pop(ino, None)
            return
        a.st_blocks = max(st.st_blocks, -(-min(a.st_size, cf.dirty_exts * EXT_SIZE) // 512))
        written = self._written_ns.get(ino)
        if written is not None:
            a.st_mtime_ns = max(st.st_mtime_ns, written)
            a.st_ctime_ns = max(st.st_ctime_ns, written)

    def _fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _path(self, ino: int) -> bytes:
        try:
            return self._inodes.path(ino)
        except OSError as exc:
            raise to_fuse_error(exc) from None

    def _child(self, parent: int, name: bytes) -> bytes:
        try:
            return self._inodes.child_path(parent, name)
        except OSError as exc:
            raise to_fuse_error(exc) from None

    def _add_handle(self, of: OpenFile) -> None:
        self._open[of.fh] = of
        self._handles.setdefault(of.ino, []).append(of)

    @contextlib.contextmanager
    def _borrow(self, inode: int, fh: int | None = None, writable: bool = False
                ) -> Iterator[int | None]:
        """Hold a BACKING fd of an open handle of `inode` (the one named by `fh` if it fits),
        or None: it reaches the file even after its last name is gone. While held, a release
        of the handle does not close it (the last borrower queues the close), so the number
        cannot name another file meanwhile. After a timed-out call (its thread may still run
        with the fd) the fd is never closed: a leak, never a use of a reused number."""
        def fits(of: OpenFile) -> bool:
            return not writable or of.flags & os.O_ACCMODE != os.O_RDONLY
        of = self._open.get(fh) if fh is not None else None
        if of is None or not fits(of):
            of = next((o for o in self._handles.get(inode, ()) if fits(o)), None)
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
                    self._queue_close(fd)

    def _queue_close(self, fd: int) -> None:
        self._closes_pending += 1
        self._close_send.send_nowait(fd)

    async def _wait_for_fds(self) -> None:
        """Before opening: wait while released fds pile up unclosed; refuse (ENFILE) when
        the handles would take the descriptors the daemon needs for its own work."""
        while self._closes_pending > MAX_PENDING_CLOSES:
            await self._close_progress.wait()
        if 2 * len(self._open) + self._closes_pending >= self._handle_budget:
            raise FUSEError(errno.ENFILE)

    def _entry(self, parent: int, name: bytes, st: os.stat_result,
               token: tuple | None = None) -> pyfuse3.EntryAttributes:
        ino = self._inodes.remember(parent, name, st)
        if token is not None:
            self._cache.attributes_seen(ino, st, token)
        return self._attr(st, ino)

    async def run_invalidator(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Ask the kernel to drop its cached pages and attributes of the inodes the engine
        reports changed behind the cache (Cache.stale_inodes)."""
        task_status.started()
        async for ino in self._cache.stale_inodes:
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False)
            except OSError as exc:              # ENOENT: the kernel no longer knows the inode
                if exc.errno not in (errno.ENOENT, errno.EBADF):
                    log.warning("kernel invalidation of inode %d failed: %s", ino, exc)

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
                errors = await self._backing.write_call(bk.close_all, batch)
            finally:
                self._closes_pending -= len(batch)
                self._close_progress.set()
                self._close_progress = trio.Event()
            for err in errors:
                log.warning("closing a BACKING file failed: %s", err)

    # -- namespace -----------------------------------------------------------------------

    async def lookup(self, parent_inode, name, ctx=None):
        token = self._cache.stat_token(None)
        path = self._child(parent_inode, name)
        try:
            st = await self._backing.lstat(path)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        return self._entry(parent_inode, name, st, token)

    async def forget(self, inode_list):
        for ino, nlookup in inode_list:
            self._inodes.forget(ino, nlookup)
            self._cache.forget(ino)

    async def getattr(self, inode, ctx=None):
        token = self._cache.stat_token(inode)
        try:
            with self._borrow(inode) as fd:
                if fd is not None:
                    st = await self._backing.fstat(fd)
                else:
                    st = await self._backing.lstat(self._path(inode))
        except OSError as exc:
            raise to_fuse_error(exc) from None
        self._cache.attributes_seen(inode, st, token)
        return self._attr(st, inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        with self._borrow(inode, fh, writable=bool(fields.update_size)) as fd:
            return await self._setattr(inode, attr, fields, fd)

    async def _setattr(self, inode, attr, fields, fd: int | None):
        try:
            path = self._inodes.path(inode)
        except OSError:
            if fd is None:
                raise FUSEError(errno.ENOENT) from None
            path = b""                          # unlinked but open: the fd does it all
        try:
            if fields.update_size:
                await self._cache.truncate(inode, attr.st_size, path, fd)
            mode = stat_mod.S_IMODE(attr.st_mode) if fields.update_mode else None
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            times = None
            if fields.update_atime or fields.update_mtime:
                times = (attr.st_atime_ns if fields.update_atime else None,
                         attr.st_mtime_ns if fields.update_mtime else None)
            # chown(f, -1, -1) reaches us with nothing to change, but it changes the ctime
            # on Linux: BACKING gets the same call.
            touch = not (fields.update_size or mode is not None or uid != -1 or gid != -1
                         or times is not None)
            st = await self._backing.write_call(bk.setattr, self._root, path, fd, mode, uid,
                                                gid, times, touch)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        self._cache.own_metadata_change(inode, st, times_set=bool(fields.update_mtime))
        if fields.update_mtime:
            self._written_ns.pop(inode, None)       # an explicit mtime wins over our writes
        elif fields.update_size and self._cache.write_back:
            self._written_ns[inode] = time.time_ns()
        return self._attr(st, inode)

    async def readlink(self, inode, ctx):
        try:
            return await self._backing.read_call("readlink", bk.readlink, self._root,
                                                 self._path(inode))
        except OSError as exc:
            raise to_fuse_error(exc) from None

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        parent = self._path(parent_inode)
        path = self._child(parent_inode, name)
        try:
            st = await self._backing.write_call(bk.mknod, self._root, path, mode, rdev,
                                                ctx.uid, ctx.gid, parent)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        return self._entry(parent_inode, name, st)

    async def mkdir(self, parent_inode, name, mode, ctx):
        parent = self._path(parent_inode)
        path = self._child(parent_inode, name)
        try:
            st = await self._backing.write_call(bk.mkdir, self._root, path, mode,
                                                ctx.uid, ctx.gid, parent)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        return self._entry(parent_inode, name, st)

    async def symlink(self, parent_inode, name, target, ctx):
        parent = self._path(parent_inode)
        path = self._child(parent_inode, name)
        try:
            st = await self._backing.write_call(bk.symlink, self._root, target, path,
                                                ctx.uid, ctx.gid, parent)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        return self._entry(parent_inode, name, st)

    async def unlink(self, parent_inode, name, ctx):
        path = self._child(parent_inode, name)
        ino = self._inodes.child(parent_inode, name)
        try:
            guarded = await self._last_link(ino, path)
            if guarded:
                st = await self._cache.unlink_guarded(
                    ino, lambda: self._backing.write_call(bk.unlink, self._root, path))
            else:
                st = await self._backing.write_call(bk.unlink, self._root, path)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        self._inodes.unlinked(parent_inode, name)
        if stat_mod.S_ISREG(st.st_mode):
            if st.st_nlink <= 1:
                self._cache.last_link_removed(self._inodes.ino_of(st))
            else:                       # the other names' inode lost a link: its ctime moved
                if guarded:
                    self._cache.unlink_intent_clear(ino)
                self._cache.own_metadata_change(self._inodes.ino_of(st), None)

    async def _last_link(self, ino: int | None, path: bytes) -> bool:
        """Whether removing `path` removes the last name of cached file `ino` (write-back
        guards that against a crash half-way, see Cache.unlink_guarded)."""
        if not self._cache.needs_unlink_guard(ino):
            return False
        try:
            st = await self._backing.lstat(path)
        except FileNotFoundError:
            return False
        return st.st_nlink <= 1 and self._inodes.ino_of(st) == ino

    async def rmdir(self, parent_inode, name, ctx):
        path = self._child(parent_inode, name)
        try:
            await self._backing.write_call(bk.rmdir, self._root, path)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        self._inodes.unlinked(parent_inode, name)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags & ~(pyfuse3.RENAME_EXCHANGE | pyfuse3.RENAME_NOREPLACE):
            raise FUSEError(errno.EINVAL)
        old = self._child(parent_inode_old, name_old)
        new = self._child(parent_inode_new, name_new)
        target = self._inodes.child(parent_inode_new, name_new)
        try:
            if not flags & pyfuse3.RENAME_EXCHANGE and await self._last_link(target, new):
                replaced, st = await self._cache.unlink_guarded(
                    target, lambda: self._backing.write_call(bk.rename, self._root, old, new,
                                                             flags))
            else:
                replaced, st = await self._backing.write_call(bk.rename, self._root, old, new,
                                                              flags)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        exchange = bool(flags & pyfuse3.RENAME_EXCHANGE)
        self._inodes.renamed(parent_inode_old, name_old, parent_inode_new, name_new, exchange)
        moved = self._inodes.ino_of(st)
        self._cache.own_metadata_change(moved, st)
        self._cache.renamed(moved, new)
        if (replaced is not None and not exchange and stat_mod.S_ISREG(replaced.st_mode)
                and replaced.st_ino != st.st_ino):
            if replaced.st_nlink <= 1:
                self._cache.last_link_removed(self._inodes.ino_of(replaced))
            else:
                if target is not None:
                    self._cache.unlink_intent_clear(target)
                self._cache.own_metadata_change(self._inodes.ino_of(replaced), None)

    async def link(self, inode, new_parent_inode, new_name, ctx):
        new = self._child(new_parent_inode, new_name)
        old = self._path(inode)
        try:
            st = await self._backing.write_call(bk.link, self._root, old, new)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        self._cache.own_metadata_change(inode, st)
        return self._entry(new_parent_inode, new_name, st)

    # -- files ---------------------------------------------------------------------------

    def _file_info(self, of: OpenFile, keep_cache: bool) -> pyfuse3.FileInfo:
        direct = bool(of.flags & getattr(os, "O_DIRECT", 0))
        return pyfuse3.FileInfo(fh=of.fh, direct_io=direct, keep_cache=keep_cache and not direct,
                                nonseekable=False)

    async def open(self, inode, flags, ctx):
        path = self._path(inode)
        await self._wait_for_fds()
        fh = self._fh()
        try:
            of, keep = await self._cache.open(fh, inode, path, flags)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        self._add_handle(of)
        return self._file_info(of, keep)

    async def create(self, parent_inode, name, mode, flags, ctx):
        parent = self._path(parent_inode)
        path = self._child(parent_inode, name)
        await self._wait_for_fds()
        fh = self._fh()
        try:
            of, st = await self._cache.create(fh, path, flags, mode,
                                              ctx.uid, ctx.gid, parent,
                                              lambda st: self._inodes.remember(parent_inode,
                                                                               name, st))
        except OSError as exc:
            raise to_fuse_error(exc) from None
        self._add_handle(of)
        return self._file_info(of, True), self._attr(st, of.ino)

    async def read(self, fh, off, size):
        of = self._open[fh]
        try:
            data = of.read_hit(off, size)
            if data is None:
                data = await self._cache.read_miss(of, off, size)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        return data

    async def write(self, fh, off, buf):
        of = self._open[fh]
        try:
            n = await self._cache.write(of, off, buf)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        if self._cache.write_back:
            self._written_ns[of.ino] = time.time_ns()
        return n

    async def flush(self, fh):
        pass

    async def release(self, fh):
        of = self._open.pop(fh)
        handles = self._handles[of.ino]
        handles.remove(of)
        if not handles:
            del self._handles[of.ino]
        for fd in self._cache.release(of):
            if fd in self._borrowed:
                self._retired.add(fd)           # the last borrower queues the close
            else:
                self._queue_close(fd)

    async def fsync(self, fh, datasync):
        try:
            await self._cache.fsync(self._open[fh], datasync)
        except OSError as exc:
            raise to_fuse_error(exc) from None

    # -- directories ---------------------------------------------------------------------

    async def opendir(self, inode, ctx):
        self._path(inode)                       # ENOENT for a directory no longer known
        fh = self._fh()
        self._dirs[fh] = (inode, [])
        return fh

    async def readdir(self, fh, start_id, token):
        parent, entries = self._dirs[fh]
        if start_id == 0:
            # Listed from the start (first read, or after rewinddir): the entries as they are
            # now, as on a plain directory; later reads continue this snapshot.
            try:
                entries = await self._backing.read_call(
                    "readdir", bk.scandir, self._root, self._inodes.path(parent))
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise to_fuse_error(exc) from None
                entries = []                    # removed meanwhile: empty, as on Linux
            self._dirs[fh] = (parent, entries)
        for i in range(start_id, len(entries)):
            name, st = entries[i]
            ino = self._inodes.ino_of(st)
            if not pyfuse3.readdir_reply(token, name, self._attr(st, ino), i + 1):
                break
            self._inodes.remember(parent, name, st)

    async def releasedir(self, fh):
        self._dirs.pop(fh, None)

    async def fsyncdir(self, fh, datasync):
        inode = self._dirs[fh][0]
        try:
            await self._backing.write_call(bk.fsync_path, self._root, self._path(inode),
                                           datasync)
        except OSError as exc:
            raise to_fuse_error(exc) from None

    async def statfs(self, ctx):
        try:
            sv = await self._backing.read_call("statfs", bk.statvfs, self._root)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        out = pyfuse3.StatvfsData()
        for field in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                      "f_ffree", "f_favail", "f_namemax"):
            setattr(out, field, getattr(sv, field))
        return out

    # -- extended attributes -------------------------------------------------------------
    # FUSE names the node by inode only: by its path while it has one, else (open and
    # unlinked) through a descriptor of an open handle of it.

    def _xattr_target(self, inode: int) -> bytes | None:
        try:
            return self._inodes.path(inode)
        except OSError as exc:
            if inode in self._handles:
                return None
            raise to_fuse_error(exc) from None

    async def getxattr(self, inode, name, ctx):
        if inode == ROOT_INODE and name == CONTROL_XATTR:
            return self._control_path
        path = self._xattr_target(inode)
        try:
            with self._borrow(inode) if path is None else contextlib.nullcontext() as fd:
                return await self._backing.read_call("getxattr", bk.getxattr, self._root,
                                                     path, fd, name)
        except OSError as exc:
            raise to_fuse_error(exc) from None

    async def listxattr(self, inode, ctx):
        path = self._xattr_target(inode)
        try:
            with self._borrow(inode) if path is None else contextlib.nullcontext() as fd:
                names = await self._backing.read_call("listxattr", bk.listxattr, self._root,
                                                      path, fd)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        return [os.fsencode(n) for n in names]

    async def setxattr(self, inode, name, value, ctx):
        if inode == ROOT_INODE and name == CONTROL_XATTR:
            raise FUSEError(errno.EPERM)
        path = self._xattr_target(inode)
        try:
            with self._borrow(inode) if path is None else contextlib.nullcontext() as fd:
                await self._backing.write_call(bk.setxattr, self._root, path, fd, name, value)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        self._cache.own_metadata_change(inode, None)        # only BACKING's ctime moved

    async def removexattr(self, inode, name, ctx):
        path = self._xattr_target(inode)
        try:
            with self._borrow(inode) if path is None else contextlib.nullcontext() as fd:
                await self._backing.write_call(bk.removexattr, self._root, path, fd, name)
        except OSError as exc:
            raise to_fuse_error(exc) from None
        self._cache.own_metadata_change(inode, None)        # only BACKING's ctime moved
