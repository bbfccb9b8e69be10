"""The pyfuse3 `Operations`: translates FUSE requests into engine calls.

Owns request translation and the single errno mapping (`to_fuse_error`, applied by
`_errno_mapped`): the only place that raises FUSEError. Never runs SQL, touches extent state
or calls `Backing`: cache data goes through `Cache`, BACKING's namespace through
`Cache.namespace`, open handles and their descriptors through `handles.Handles`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat as stat_mod
import traceback
from time import perf_counter_ns

import pyfuse3
import trio
from pyfuse3 import FUSEError

from . import controlpath, trace
from .attrs import Attributes
from .cache import Cache
from .config import Config
from .errors import BackingTimeout
from .handles import Handles
from .hit import install_fast_hits
from .inodes import ROOT_INODE, InodeTable
from .integrity import Damaged
from .namespace import CAPS as CAPS_XATTR
from .namespace import Caller
from .openmode import DIRECT, JOINED, Answer, Kernel
from .oplog import RateLimitedLog

log = logging.getLogger("cachefs.fs")

CONTROL_XATTR = os.fsencode(controlpath.CONTROL_XATTR)
ACL_ACCESS_XATTR = b"system.posix_acl_access"
RENAME_WHITEOUT = 4             # linux/fs.h; pyfuse3 names only EXCHANGE and NOREPLACE


def to_fuse_error(exc: OSError) -> FUSEError:
    """The errno mapping: an OSError (BACKING's, or the engine's with its errno) as the
    FUSEError the kernel gets (EIO when it has no errno). ENOTCONN and ECONNABORTED, a FUSE
    BACKING whose server died, are EIO too: passed on, it made this live mount look dead to
    programs and to `cachefs mount`, which then unmounted it (a helper's hunt)."""
    e = exc.errno
    return FUSEError(errno.EIO if not e or e in _DEAD_SERVER else e)


# What a FUSE (or network) BACKING whose server died answers: no errno of ours.
_DEAD_SERVER = (errno.ENOTCONN, errno.ECONNABORTED)


def _errno_mapped(handler):
    """Apply to_fuse_error to every OSError leaving an async handler (all handlers but
    `read`, which maps its own to keep the hit path one frame deep)."""
    @functools.wraps(handler)
    async def mapped(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except OSError as exc:
            raise to_fuse_error(exc) from None
    return mapped


# How long a path is looked up again while a rename of the node, or of a directory above
# it, is under way (done on BACKING, not yet in the inode table): ~60 ms in all.
RENAME_PAUSES_S = (0.001, 0.01, 0.05)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    # FUSE_HANDLE_KILLPRIV_V2 (a pyfuse3 and libfuse with deps/passthrough's kill-suidgid
    # patches): the kernel stops asking for security.capability before every write(2), and
    # cachefs drops setuid/setgid bits itself where the kernel says so (write, truncate,
    # O_TRUNC open by a caller without CAP_FSETID); chown drops them in BACKING itself.
    enable_killpriv_v2 = True
    # POSIX ACLs: the kernel checks them (they live on BACKING, read through getxattr), and
    # with FUSE_CAP_DONT_MASK (deps/passthrough's acl-dont-mask patch) new nodes get the
    # parent's default ACL instead of the umask (backingpaths.creating_under).
    enable_acl = True
    # FUSE_CAP_DIRECT_IO_ALLOW_MMAP (deps/passthrough's direct-io-mmap patch): O_DIRECT opens
    # are answered with direct_io, whose shared mappings the kernel refuses (ENODEV) unless
    # asked for this; with it they go through the page cache, coherent with direct I/O, and
    # their writeback reaches `write` marked writepage=True.
    enable_direct_io_mmap = True

    def __init__(self, cfg: Config, cache: Cache, inodes: InodeTable, control_path: str):
        super().__init__()
        self._cfg = cfg
        self._cache = cache
        self._ns = cache.namespace                # BACKING's namespace, through the engine
        self._backing_health = cache.backing.health
        self._inodes = inodes
        self._control_path = os.fsencode(control_path)
        # fh -> (ino, snapshot, dir_seq, BACKING descriptor of the directory or -1)
        self._dirs: dict[int, tuple[int, list, int, int]] = {}
        # Directories removed while the kernel still knows them (a process's cwd): their last
        # attributes, so stat(".") and opendir(".") work there as on Linux (nlink 0, empty).
        self._removed_dirs: dict[int, os.stat_result] = {}
        self._limited = RateLimitedLog(log)       # errors a loop of requests may repeat
        self._attrs = Attributes(cfg, cache)
        self._attr = self._attrs.of
        self._next_fh = 1
        self._fds = Handles(cache.namespace, cache.write_back)   # open handles, BACKING fds
        self._modes = cache.modes                   # how each open is answered
        self._modes.bind(Kernel(hasattr(pyfuse3, "passthrough_open"),
                                getattr(pyfuse3, "passthrough_open", None),
                                getattr(pyfuse3, "passthrough_close", None)))
        self.enable_passthrough = self._modes.wanted
        self._open = self._fds.open                 # fh -> OpenFile (the same dict: read())
        if cfg.debug:
            trace.wrap(self)        # --debug: one line per request (unwrapped otherwise)

    def init(self):
        self._modes.negotiated(bool(self.enable_passthrough
                                    and getattr(pyfuse3, "passthrough_enabled", bool)()))
        killpriv = bool(getattr(pyfuse3, "killpriv_v2_enabled", bool)())
        self._cache.stats.killpriv_v2 = int(killpriv)
        if killpriv:
            log.info("FUSE_HANDLE_KILLPRIV_V2: on (no security.capability request before "
                     "each write; setuid/setgid bits are dropped by cachefs)")
        else:
            log.info("FUSE_HANDLE_KILLPRIV_V2: off (%s): the kernel asks for "
                     "security.capability before each write",
                     "not granted: it needs libfuse with deps/passthrough/libfuse-kill-"
                     "suidgid.patch and a kernel that offers it"
                     if hasattr(pyfuse3, "killpriv_v2_enabled")
                     else "pyfuse3 without deps/passthrough/pyfuse3-kill-suidgid.patch")
        dio_mmap = bool(getattr(pyfuse3, "direct_io_mmap_enabled", bool)())
        self._cache.stats.direct_io_mmap = int(dio_mmap)
        if not dio_mmap:
            log.info("shared mappings of O_DIRECT opens: off (%s): mmap(MAP_SHARED) of a file "
                     "opened with O_DIRECT fails with ENODEV",
                     "not offered by the kernel (Linux >= 6.6)"
                     if hasattr(pyfuse3, "direct_io_mmap_enabled")
                     else "pyfuse3 without deps/passthrough/pyfuse3-direct-io-mmap.patch")
        why_not = ("--no-fast-hits" if not self._cfg.fast_hits
                   else "--debug traces every request" if self._cfg.debug
                   else install_fast_hits(self._open))
        self._cache.stats.fast_hits = int(why_not is None)
        if why_not is None:
            log.info("fast hits: on (4 KiB cache hits are answered in C before the Python "
                     "read handler)")
        else:
            log.info("fast hits: off (%s): every hit goes through the Python read handler",
                     why_not)

    def flush_log(self) -> None:
        """At unmount: the counts of error lines held back (RateLimitedLog)."""
        self._limited.flush()

    # -- helpers -------------------------------------------------------------------------

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

    def _entry(self, parent: int, name: bytes, st: os.stat_result,
               token: tuple | None = None) -> pyfuse3.EntryAttributes:
        if self._inodes.foreign(st):
            self._foreign(parent, name, st)
            raise FUSEError(errno.EXDEV)
        ino = self._inodes.remember(parent, name, st)
        self._removed_dirs.pop(ino, None)       # BACKING reused the number
        if token is not None:
            self._cache.attributes_seen(ino, st, token)
        return self._attr(st, ino)

    def _foreign(self, parent: int, name: bytes, st: os.stat_result) -> None:
        """Log (once a minute per device) that an entry is another filesystem, mounted
        inside BACKING: it is left out of listings and its lookup fails with EXDEV."""
        self._limited.warning(
            ("foreign", st.st_dev), "%s is on another filesystem than BACKING (device %d:%d, "
            "mounted inside BACKING): cachefs serves one filesystem and does not cross into "
            "it (it is not listed; its lookup fails with EXDEV); mount it with cachefs on its "
            "own", os.fsdecode(self._child(parent, name)), os.major(st.st_dev),
            os.minor(st.st_dev))

    async def run_closer(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The service that closes released BACKING descriptors (Handles.run_closer)."""
        await self._fds.run_closer(task_status=task_status)

    async def run_invalidator(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Ask the kernel to drop its cached pages and attributes of the inodes the engine
        reports changed behind the cache (Cache.stale_inodes)."""
        task_status.started()
        async for ino in self._cache.stale_inodes:
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False)
            except OSError as exc:
                # ENOENT: the kernel no longer knows the inode; ENOSYS, EINVAL: FUSE is not
                # up yet (a mount re-loading a pinned file that changed while it was down:
                # the kernel has nothing of it to drop; it was a WARNING at such mounts)
                if exc.errno not in (errno.ENOENT, errno.EBADF, errno.ENOSYS, errno.EINVAL):
                    log.warning("kernel invalidation of inode %d failed: %s", ino, exc)

    # -- namespace -----------------------------------------------------------------------

    @_errno_mapped
    async def lookup(self, parent_inode, name, ctx=None):
        token = self._cache.stat_token(None)
        if parent_inode == ROOT_INODE:
            st = await self._ns.lstat(name)
        else:
            for last in (False, True):
                parent = self._path(parent_inode)
                dst, st = await self._ns.lstat_in(parent, name)
                if self._inodes.ino_of(dst) == parent_inode:
                    break
                if last:
                    raise FUSEError(errno.ESTALE)
                await self._check_dir(parent_inode, parent)     # ESTALE, or it settled
            if st is None:
                raise FUSEError(errno.ENOENT)
        return self._entry(parent_inode, name, st, token)

    async def _check_dir(self, ino: int, path: bytes | None = None) -> None:
        """Directory `ino`'s remembered path still leads to it. Another program may have
        renamed it on BACKING and put another directory at its path: lookups, creates and
        removals by the kernel's handle of it (a process's cwd, a directory descriptor)
        reached that other directory's entries (a helper's hunt). A rename of it under way
        here resolves within RENAME_PAUSES_S; otherwise ESTALE (local file systems and NFS
        follow the moved directory by its handle, which cachefs does not keep)."""
        if ino == ROOT_INODE:
            return
        path = self._path(ino) if path is None else path
        try:
            st = await self._ns.lstat(path)
        except FileNotFoundError:
            st = None
        if st is None or self._inodes.ino_of(st) != ino:
            await self._stat_by_path(ino, path)     # ESTALE (or ENOENT) unless it settles

    async def forget(self, inode_list):
        for ino, nlookup in inode_list:
            self._inodes.forget(ino, nlookup)
            self._cache.forget(ino)
            self._removed_dirs.pop(ino, None)

    @_errno_mapped
    async def getattr(self, inode, ctx=None):
        cf = self._cache.files.get(inode)
        last = cf.open_st if cf is not None else None
        if last is not None and self._backing_health.reads_hung(self._cfg.backing_timeout_s):
            return self._attrs_last_seen(cf)
        token = self._cache.stat_token(inode)
        try:
            st = await self._stat(inode)
        except BackingTimeout:
            if last is None:
                raise
            return self._attrs_last_seen(cf)
        if isinstance(st, pyfuse3.EntryAttributes):
            return st
        self._cache.attributes_seen(inode, st, token)
        if cf is not None and cf.open_count:
            cf.open_st = st
        return self._attr(st, inode, token)

    def _attrs_last_seen(self, cf) -> pyfuse3.EntryAttributes:
        """BACKING does not answer (a stat of it timed out, or one has hung for
        --backing-timeout): a file with open handles gets the attributes last seen, with
        the size the engine knows (own writes since that stat moved it). The kernel asks
        for them before reads once --attr-timeout has passed (auto_inval_data), and an EIO
        failed the reads of descriptors opened before the hang, which the cache serves (a
        helper's hunt); new opens and lookups still fail."""
        self._limited.info(("attrs last seen",), "BACKING does not answer: files with open "
                           "descriptors get the attributes last seen (inode %d)", cf.ino)
        a = self._attr(cf.open_st, cf.ino)
        a.st_size = cf.size
        return a

    async def _stat(self, inode: int) -> os.stat_result | pyfuse3.EntryAttributes:
        with self._fds.borrow(inode) as fd:
            if fd is not None:
                return await self._ns.fstat(fd)
            if inode in self._removed_dirs:
                a = self._attr(self._removed_dirs[inode], inode)
                a.st_nlink = 0
                return a
            try:
                path = self._inodes.path(inode)
            except OSError as exc:
                held = self._inodes.held_fd(inode)      # no known name reaches it
                if held < 0:
                    raise to_fuse_error(exc) from None
                return await self._ns.fstat(held)
            return await self._stat_by_path(inode, path)

    async def setattr(self, inode, attr, fields, fh, ctx):
        with self._fds.borrow(inode, fh, writable=bool(fields.update_size)) as fd:
            return await self._setattr(inode, attr, fields, fd, ctx)

    @_errno_mapped
    async def _setattr(self, inode, attr, fields, fd: int | None, ctx):
        try:
            path = self._inodes.path(inode)
        except OSError as exc:
            if fd is None and not fields.update_size:
                fd = self._inodes.held_fd(inode)    # no name, no handle: an O_PATH holder
            if fd is None or fd < 0:
                raise to_fuse_error(exc) from None
            path = b""                          # unlinked but open: the fd does it all
        if fields.update_size:
            await self._cache.truncate(inode, attr.st_size, path, fd)
        if fields.update_mode or fields.update_uid or fields.update_gid:
            self._ns.mode_changed(inode)
        mode = stat_mod.S_IMODE(attr.st_mode) if fields.update_mode else None
        uid = attr.st_uid if fields.update_uid else -1
        gid = attr.st_gid if fields.update_gid else -1
        times = None
        if fields.update_atime or fields.update_mtime:
            times = (attr.st_atime_ns if fields.update_atime else None,
                     attr.st_mtime_ns if fields.update_mtime else None)
        # chown(f, -1, -1) reaches us with nothing to change, but on Linux it changes the
        # ctime and drops the setuid/setgid bits: BACKING gets the same call. (The kernel's
        # empty setattr after it removed security.capability before a root write looks the
        # same, so such a write drops the setuid bits too: see docs/operations.md.)
        touch = not (fields.update_size or mode is not None or uid != -1 or gid != -1
                     or times is not None)
        async with self._cache.destage_guard(inode, bool(fields.update_mtime
                                                         or fields.update_atime)):
            with self._cache.changing(inode):
                st = await self._ns.setattr(path, fd, mode, uid, gid, times, touch,
                                            None if inode == ROOT_INODE else inode)
                if getattr(fields, "kill_suidgid", False) or touch:
                    # Truncated by a caller without CAP_FSETID; or the kernel's empty
                    # setattr (a fallocate's removal of privileges, a chown(f, -1, -1)):
                    # BACKING's chown by root kept the setgid bit of a file whose group the
                    # caller is not in (xfstests generic/683).
                    st = await self._ns.kill_suidgid(inode, path, fd,
                                                     (ctx.pid, ctx.uid, ctx.gid)) or st
                self._cache.own_metadata_change(inode, st,
                                                times_set=bool(fields.update_mtime))
                self._cache.backing_changed(inode)
            if fields.update_mtime:
                self._cache.times_set(inode, st)
            elif fields.update_atime:
                self._cache.atime_set(inode)
        return self._attr(st, inode)

    @_errno_mapped
    async def readlink(self, inode, ctx):
        return await self._ns.readlink(self._path(inode))

    @_errno_mapped
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        parent = self._path(parent_inode)
        await self._check_dir(parent_inode, parent)
        path = self._child(parent_inode, name)
        st = await self._ns.mknod(path, mode, rdev, ctx.uid, ctx.gid, parent, ctx.umask)
        return self._entry(parent_inode, name, st)

    @_errno_mapped
    async def mkdir(self, parent_inode, name, mode, ctx):
        parent = self._path(parent_inode)
        await self._check_dir(parent_inode, parent)
        path = self._child(parent_inode, name)
        st = await self._ns.mkdir(path, mode, ctx.uid, ctx.gid, parent, ctx.umask)
        return self._entry(parent_inode, name, st)

    @_errno_mapped
    async def symlink(self, parent_inode, name, target, ctx):
        parent = self._path(parent_inode)
        await self._check_dir(parent_inode, parent)
        path = self._child(parent_inode, name)
        st = await self._ns.symlink(target, path, ctx.uid, ctx.gid, parent)
        return self._entry(parent_inode, name, st)

    @_errno_mapped
    async def unlink(self, parent_inode, name, ctx):
        await self._check_dir(parent_inode)
        path = self._child(parent_inode, name)
        ino = self._inodes.child(parent_inode, name)
        guarded = await self._last_link(ino, path)
        with self._cache.changing(ino):
            if guarded:
                st, held = await self._cache.unlink_guarded(ino, lambda: self._ns.unlink(path))
            else:
                st, held = await self._ns.unlink(path)
            self._inodes.unlinked(parent_inode, name)
            self._hold(self._inodes.ino_of(st), held)
            if stat_mod.S_ISREG(st.st_mode):
                if st.st_nlink <= 1:
                    self._cache.last_link_removed(self._inodes.ino_of(st))
                else:                   # the other names' inode lost a link: its ctime moved
                    if guarded:
                        self._cache.unlink_intent_clear(ino)
                    self._cache.own_metadata_change(self._inodes.ino_of(st), None)

    async def _last_link(self, ino: int | None, path: bytes) -> bool:
        """Whether removing `path` removes the last name of cached file `ino` (write-back
        guards that against a crash half-way, see Cache.unlink_guarded)."""
        if not self._cache.needs_unlink_guard(ino):
            return False
        try:
            st = await self._ns.lstat(path)
        except FileNotFoundError:
            return False
        return st.st_nlink <= 1 and self._inodes.ino_of(st) == ino

    @_errno_mapped
    async def rmdir(self, parent_inode, name, ctx):
        await self._check_dir(parent_inode)
        path = self._child(parent_inode, name)
        st, held = await self._ns.rmdir(path)
        ino = self._inodes.ino_of(st)
        if self._inodes.child(parent_inode, name) == ino:
            self._removed_dirs[ino] = st
        self._inodes.unlinked(parent_inode, name)
        self._inodes.hold(ino, held)

    @_errno_mapped
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags & ~(pyfuse3.RENAME_EXCHANGE | pyfuse3.RENAME_NOREPLACE | RENAME_WHITEOUT):
            raise FUSEError(errno.EINVAL)       # WHITEOUT: BACKING leaves one at `old` (overlayfs)
        await self._check_dir(parent_inode_old)
        if parent_inode_new != parent_inode_old:
            await self._check_dir(parent_inode_new)
        old = self._child(parent_inode_old, name_old)
        new = self._child(parent_inode_new, name_new)
        target = self._inodes.child(parent_inode_new, name_new)
        with self._cache.changing(self._inodes.child(parent_inode_old, name_old), target):
            if not flags & pyfuse3.RENAME_EXCHANGE and await self._last_link(target, new):
                replaced, st, held = await self._cache.unlink_guarded(
                    target, lambda: self._ns.rename(old, new, flags))
            else:
                replaced, st, held = await self._ns.rename(old, new, flags)
            exchange = bool(flags & pyfuse3.RENAME_EXCHANGE)
            self._inodes.renamed(parent_inode_old, name_old, parent_inode_new, name_new,
                                 exchange)
            if held >= 0:
                self._hold(self._inodes.ino_of(replaced), held)
            moved = self._inodes.ino_of(st)
            self._cache.own_metadata_change(moved, st)
            self._cache.renamed(moved, new)
            if exchange:                    # the other node moved too (its ctime with it)
                other = self._inodes.ino_of(replaced)
                self._cache.own_metadata_change(other, replaced)
                self._cache.renamed(other, old)
        if (replaced is not None and not exchange and stat_mod.S_ISREG(replaced.st_mode)
                and replaced.st_ino != st.st_ino):
            if replaced.st_nlink <= 1:
                self._cache.last_link_removed(self._inodes.ino_of(replaced))
            else:
                if target is not None:
                    self._cache.unlink_intent_clear(target)
                self._cache.own_metadata_change(self._inodes.ino_of(replaced), None)

    @_errno_mapped
    async def link(self, inode, new_parent_inode, new_name, ctx):
        await self._check_dir(new_parent_inode)
        new = self._child(new_parent_inode, new_name)
        try:
            old = self._inodes.path(inode)
        except OSError as exc:
            old = None          # no known name (a hard link held through the name that went)
            if not self._fds.has(inode) and self._inodes.held_fd(inode) < 0:
                raise to_fuse_error(exc) from None
        with self._cache.changing(inode), \
                self._node_fd(inode) if old is None else contextlib.nullcontext() as fd:
            st = await self._ns.link(old, new, fd)
            self._cache.own_metadata_change(inode, st)
        return self._entry(new_parent_inode, new_name, st)

    # -- files ---------------------------------------------------------------------------

    @_errno_mapped
    async def open(self, inode, flags, ctx):
        try:
            path = self._inodes.path(inode)
        except OSError as exc:
            # No known name reaches the file (open and unlinked: `cat /dev/fd/3`; another
            # link's directory forgotten by the kernel): through a descriptor of it.
            with self._fds.borrow(inode) as fd:
                fd = fd if fd is not None else self._inodes.held_fd(inode)
                if fd < 0:
                    raise to_fuse_error(exc) from None
                return await self._open_file(inode, b"/proc/self/fd/%d" % fd, flags, ctx,
                                             False)
        return await self._open_file(inode, path, flags, ctx, True)

    async def _open_file(self, inode, path: bytes, flags, ctx, named: bool):
        await self._fds.wait_for_fds()
        fh = self._fh()
        of, keep = await self._cache.open(fh, inode, path, flags, named)
        of.opener = (ctx.pid, ctx.uid, ctx.gid)
        self._fds.add(of)
        try:
            if getattr(ctx, "kill_suidgid", False):     # O_TRUNC by a caller w/o CAP_FSETID
                await self._kill_suidgid(of)
            answer = self._modes.answer(of, keep)
            if of.cfile.attrs_stale:
                # BACKING changed behind the mount (another host, another program): the
                # kernel's attributes, its size among them, are dropped before the open is
                # answered, so that its first read asks for them again (close-to-open): up
                # to --attr-timeout later, reads stopped at the old size (appended bytes
                # missing) or went past the new one (zeros). (O_APPEND writes: see write.)
                of.cfile.attrs_stale = False
                await trio.to_thread.run_sync(_invalidate, of.ino, True)
            if answer.refresh is not None:      # its cache file is to hold BACKING's bytes
                await self._modes.refresh(answer.refresh)
            if answer.mappable is not None:     # before the kernel lets the caller map it
                await self._modes.mappable(answer)
            if answer.durable:
                await self._cache.persist(durable=True)
        except BaseException:
            with trio.CancelScope(shield=True):     # no reply: no release will come
                await self.release(fh)
            raise
        return _file_info(answer)

    @_errno_mapped
    async def create(self, parent_inode, name, mode, flags, ctx):
        parent = self._path(parent_inode)
        await self._check_dir(parent_inode, parent)
        path = self._child(parent_inode, name)
        await self._fds.wait_for_fds()
        fh = self._fh()
        of, st = await self._cache.create(fh, path, flags, mode,
                                          ctx.uid, ctx.gid, ctx.umask, parent,
                                          lambda st: self._inodes.remember(parent_inode,
                                                                           name, st))
        of.opener = (ctx.pid, ctx.uid, ctx.gid)
        self._fds.add(of)
        if getattr(ctx, "kill_suidgid", False):     # it existed, O_TRUNC, no CAP_FSETID
            st = await self._kill_suidgid(of) or st
        if st.st_size == 0:
            self._ns.created(of.ino)            # new (or emptied): no security.capability
        return _file_info(self._modes.answer(of, True)), self._attr(st, of.ino)

    async def read(self, fh, off, size):
        of = self._open[fh]
        t0 = perf_counter_ns()
        try:
            data = of.read_hit(off, size)
            if data is None:
                data = await self._cache.read_miss(of, off, size)
                of.miss_lat.add(perf_counter_ns() - t0)     # read_miss chose miss or bypass
                return data
        except Damaged as exc:                  # cached blocks failed their checksums
            try:
                return await self._cache.read_damaged(of, off, size, exc)
            except OSError as err:
                raise to_fuse_error(err) from None
        except OSError as exc:
            raise to_fuse_error(exc) from None
        except FUSEError:
            raise
        except Exception:                       # a bug: this read fails, not the mount
            of.stats.internal_errors += 1       # (anything but FUSEError ends pyfuse3's loop)
            self._limited.error(("read", fh), "read of inode %d at %d (%d bytes) failed "
                                "with an error in cachefs (EIO):\n%s", of.ino, off, size,
                                traceback.format_exc())
            raise FUSEError(errno.EIO) from None
        of.stats.lat_hit.add(perf_counter_ns() - t0)
        return data

    @_errno_mapped
    async def write(self, fh, off, buf, kill_suidgid=False, writepage=False):
        of = self._open[fh]
        if kill_suidgid and await self._kill_suidgid(of) is not None:
            # By a caller without CAP_FSETID (KILLPRIV_V2). A buffered write's kill came in
            # a setattr, whose reply gave the kernel the new mode; an O_DIRECT write's comes
            # in the write: the kernel's cached mode is stale (`stat -c %A` showed the bits
            # for --attr-timeout: xfstests generic/355).
            await trio.to_thread.run_sync(_invalidate, of.ino, True)
        if not self._ns.caps_absent(of.ino) and await self._ns.kill_caps(of.ino, of.backing_fd):
            self._cache.own_metadata_change(of.ino, None)   # only BACKING's ctime moved
        if of.cfile.caps is not None:       # a write drops it: no destage puts it back
            self._cache.caps_dropped(of.cfile)
        if of.flags & os.O_APPEND and of.mode in (DIRECT, JOINED):
            # The file's end, not the kernel's size, which is older than the file's when it
            # changed behind the mount (another host appended to a log: the write landed
            # on that host's line): such opens are direct_io (OpenModes.answer).
            off = of.cfile.size
        t0 = perf_counter_ns()
        n = await self._cache.write(of, off, buf)
        of.stats.lat_write.add(perf_counter_ns() - t0)
        if self._modes.wrote_direct(of) and not writepage:
            # Page-cache opens may have read older bytes: dropped. Not after the kernel's
            # writeback of a shared mapping of this direct_io open (FUSE_CAP_DIRECT_IO_ALLOW_
            # MMAP): the bytes came from those pages, and the kernel holds them until this
            # write is answered (dropping them waited for it: xfstests generic/095 hung).
            await trio.to_thread.run_sync(_invalidate, of.ino, False)
        return n

    async def _kill_suidgid(self, of) -> os.stat_result | None:
        """Drop the setuid/setgid bits of an open file where Linux would (Namespace);
        BACKING's new stat if it had some."""
        st = await self._ns.kill_suidgid(of.ino, b"", of.backing_fd, of.opener)
        if st is not None:
            self._cache.own_metadata_change(of.ino, st)
        return st

    @_errno_mapped
    async def fallocate(self, fh, mode, offset, length):
        # (a pyfuse3 with deps/passthrough's fallocate patch calls this; the stock one does
        # not, and the kernel answers fallocate(2) with EOPNOTSUPP)
        of = self._open[fh]
        await self._cache.fallocate(of, mode, offset, length)

    @_errno_mapped
    async def lseek(self, fh, offset, whence):
        # SEEK_DATA/SEEK_HOLE (deps/passthrough's lseek patch; with the stock pyfuse3 the
        # kernel treats every file as all data)
        return await self._cache.seek(self._open[fh], offset, whence)

    async def flush(self, fh):
        # Nothing to do at a close(2): ENOSYS makes the kernel stop sending FLUSH at all, one
        # request less per close (it still writes dirty mmap pages back before it would ask).
        raise FUSEError(errno.ENOSYS)

    async def release(self, fh):
        self._release(fh)

    def release_all(self) -> None:
        """The kernel ended the session at an unmount, every file closed: the handles it did
        not release are released now. It sends RELEASE in the background and drops the
        ones the daemon has not read yet when the connection ends: an O_RDWR open of a
        held file seemed to be there still, its file kept its mapped mark and the next
        mount took it as written (a full suite run)."""
        self._modes.session_ended()
        for fh in list(self._fds.open):
            self._release(fh)

    def _release(self, fh: int) -> None:
        of = self._fds.remove(fh)
        self._modes.release(of)
        if not self._fds.has(of.ino) and self._inodes.hold_deferred(of.ino):
            try:                        # its last handle: a holder of the node from it
                held = os.open(f"/proc/self/fd/{of.backing_fd}", os.O_PATH | os.O_CLOEXEC)
            except OSError:
                held = -1
            self._inodes.hold(of.ino, held)
        self._fds.close_later(self._cache.release(of))

    def _hold(self, ino: int, held: int) -> None:
        """Keep `held`, an O_PATH descriptor of BACKING's node `ino` a name of which was just
        removed (InodeTable.hold). While handles of it are open they hold the node: the
        holder is made from the last one at its release instead (a descriptor per open
        file unlinked, thousands of them, ran the daemon out: fsync failed with EIO)."""
        if held >= 0 and self._fds.has(ino):
            os.close(held)
            self._inodes.defer_hold(ino)
        else:
            self._inodes.hold(ino, held)

    @_errno_mapped
    async def fsync(self, fh, datasync):
        of = self._open[fh]
        t0 = perf_counter_ns()
        await self._cache.fsync(of, datasync)
        of.stats.lat_fsync.add(perf_counter_ns() - t0)

    # -- directories ---------------------------------------------------------------------

    async def opendir(self, inode, ctx):
        fd = -1
        if inode not in self._removed_dirs:     # (those are listed empty)
            path = self._path(inode)            # ESTALE for a directory no longer known
            try:                # listed through this descriptor: renames do not matter
                fd = await self._ns.open_dir(path, None if inode == ROOT_INODE else inode)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ESTALE, errno.EMFILE, errno.ENFILE):
                    raise to_fuse_error(exc) from None
                fd = -1                         # (mid-rename, or no descriptor: by path)
        fh = self._fh()
        self._dirs[fh] = (inode, [], 0, fd)
        return fh

    async def readdir(self, fh, start_id, token):
        parent, entries, seq, fd = self._dirs[fh]
        if start_id == 0:
            # Listed from the start (first read, or after rewinddir): the entries as they are
            # now, as on a plain directory; later reads continue this snapshot.
            seq = self._inodes.dir_seq(parent)
            if fd >= 0:
                try:
                    listed = await self._ns.scandir_fd(fd)
                except OSError as exc:
                    raise to_fuse_error(exc) from None
            else:
                listed = await self._listing(parent)
            entries = [(b".", None), (b"..", None), *listed]
            self._dirs[fh] = (parent, entries, seq, fd)
        # An entry of the snapshot that cachefs renamed or unlinked since must not be
        # remembered: its name would lead to whatever took that name. Then each is looked at
        # again (gone: left out; replaced: the new node).
        recheck = seq != self._inodes.dir_seq(parent)
        for i in range(start_id, len(entries)):
            name, st = entries[i]
            if st is None:              # "." or "..": no lookup is counted for them
                ino = parent if name == b"." else self._inodes.parent_of(parent)
                if not pyfuse3.readdir_reply(token, name, _dot_attr(ino), i + 1):
                    break
                continue
            if recheck:
                try:
                    st = await self._ns.lstat(self._inodes.child_path(parent, name))
                except OSError:
                    continue
            if self._inodes.foreign(st):
                # Not listed: an entry with no node (id 0) has d_ino 0, which glibc and Go
                # skip anyway, and a node would alias one of BACKING's (_entry).
                self._foreign(parent, name, st)
                continue
            ino = self._inodes.ino_of(st)
            if not pyfuse3.readdir_reply(token, name, self._attr(st, ino), i + 1):
                break
            self._inodes.remember(parent, name, st)

    async def _stat_by_path(self, inode: int, path: bytes) -> os.stat_result:
        """lstat of `inode` by its path. While a rename of it or of a directory above it is
        under way (on BACKING, not yet in the inode table) the path may lead elsewhere or
        nowhere: looked up again a few times before the answer is ESTALE (the kernel looks
        the name up again) or ENOENT."""
        for pause in RENAME_PAUSES_S:
            try:
                st = await self._ns.lstat(path)
                if self._inodes.ino_of(st) == inode:
                    return st
            except FileNotFoundError:
                pass
            await trio.sleep(pause)
            path = self._path(inode)
        st = await self._ns.lstat(path)             # the last try: ENOENT goes to the caller
        if self._inodes.ino_of(st) != inode:
            raise FUSEError(errno.ESTALE)           # the name leads elsewhere: look again
        return st

    async def _listing(self, parent: int) -> list:
        """BACKING's entries of directory `parent`. Its path may lead elsewhere, or nowhere,
        while a rename of it or of a directory above it is under way (on BACKING, not yet in
        the inode table): looked up again a few times; empty only once it is removed (as
        on Linux, "." and ".." too). A path taken as it was listed another directory's
        entries (and the kernel kept them as this one's), or none."""
        for pause in (*RENAME_PAUSES_S, None):
            try:
                return await self._ns.scandir(self._inodes.path(parent),
                                              None if parent == ROOT_INODE else parent)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ESTALE):
                    raise to_fuse_error(exc) from None
                if parent in self._removed_dirs or pause is None:
                    return []           # removed meanwhile: listed empty
                await trio.sleep(pause)
        return []

    async def releasedir(self, fh):
        d = self._dirs.pop(fh, None)
        if d is not None and d[3] >= 0:
            await self._ns.close_all([d[3]])

    @_errno_mapped
    async def fsyncdir(self, fh, datasync):
        inode = self._dirs[fh][0]
        await self._ns.fsync_path(self._path(inode), datasync)

    @_errno_mapped
    async def statfs(self, ctx):
        sv = await self._ns.statvfs()
        out = pyfuse3.StatvfsData()
        for field in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                      "f_ffree", "f_favail", "f_namemax"):
            setattr(out, field, getattr(sv, field))
        return out

    # -- extended attributes -------------------------------------------------------------
    # FUSE names the node by inode only: by its path while it has one, else (open and
    # unlinked) through a descriptor of an open handle of it.

    def _xattr_target(self, inode: int) -> bytes | None:
        """The path to name `inode` by in an xattr call, or None: through a descriptor
        (_node_fd). An open handle's descriptor comes first: it is this file whatever
        happened to its name (renamed on BACKING behind the mount and another file put
        there, an fsetxattr by path reached that other file)."""
        if self._fds.has(inode):
            return None
        try:
            return self._inodes.path(inode)
        except OSError as exc:
            if self._inodes.held_fd(inode) >= 0:
                return None
            raise to_fuse_error(exc) from None

    @contextlib.contextmanager
    def _node_fd(self, inode: int):
        """A BACKING descriptor of a node no known name reaches: an open handle's, else the
        O_PATH one kept since a name of it went (InodeTable.hold)."""
        if self._fds.has(inode):
            with self._fds.borrow(inode) as fd:
                yield fd
        else:
            yield self._inodes.held_fd(inode)

    async def _xattr_call(self, inode: int, call):
        """`call(path, fd)` on `inode`: by path (which BACKING checks leads to the node, see
        backingpaths) or through a descriptor. While a rename of it or of a directory above
        it is under way the path may lead elsewhere (ESTALE) or nowhere: looked up again a
        few times, as for getattr, before the error goes to the kernel."""
        for pause in (*RENAME_PAUSES_S, None):
            path = self._xattr_target(inode)
            with self._node_fd(inode) if path is None else contextlib.nullcontext() as fd:
                try:
                    return await call(path, fd)
                except OSError as exc:
                    if (path is None or pause is None
                            or exc.errno not in (errno.ESTALE, errno.ENOENT)):
                        raise
            await trio.sleep(pause)

    @_errno_mapped
    async def getxattr(self, inode, name, ctx):
        if inode == ROOT_INODE and name == CONTROL_XATTR:
            return self._control_path
        return await self._xattr_call(
            inode, lambda path, fd: self._ns.getxattr(path, fd, name, inode))

    @_errno_mapped
    async def listxattr(self, inode, ctx):
        names = await self._xattr_call(
            inode, lambda path, fd: self._ns.listxattr(path, fd, inode))
        return [os.fsencode(n) for n in names]

    @_errno_mapped
    async def setxattr(self, inode, name, value, ctx):
        if inode == ROOT_INODE and name == CONTROL_XATTR:
            raise FUSEError(errno.EPERM)
        caps = name == CAPS_XATTR
        try:
            async with self._cache.destage_guard(inode, caps):   # not during a destage pass
                await self._xattr_call(
                    inode, lambda path, fd: self._ns.setxattr(path, fd, name, value, inode))
                if name == ACL_ACCESS_XATTR:
                    caller = Caller(ctx.pid, ctx.uid, ctx.gid)
                    st = await self._xattr_call(
                        inode, lambda path, fd: self._ns.acl_kill_sgid(path, fd, caller))
                    if st is not None:
                        self._ns.mode_changed(inode)
                if caps and self._cache.caps_set(inode, value):
                    await self._cache.persister.persist(durable=True)    # before the answer
        finally:
            self._ns.xattrs_changed(inode)
        self._cache.own_metadata_change(inode, None)        # only BACKING's ctime moved
        self._cache.backing_changed(inode)

    @_errno_mapped
    async def removexattr(self, inode, name, ctx):
        caps = name == CAPS_XATTR
        try:
            async with self._cache.destage_guard(inode, caps):   # not during a destage pass
                await self._xattr_call(
                    inode, lambda path, fd: self._ns.removexattr(path, fd, name, inode))
                if caps:
                    self._cache.caps_set(inode, None)
        finally:
            self._ns.xattrs_changed(inode)
        self._cache.own_metadata_change(inode, None)        # only BACKING's ctime moved
        self._cache.backing_changed(inode)


def _invalidate(ino: int, attr_only: bool) -> None:
    """Drop the kernel's cached attributes of `ino` (and its pages unless `attr_only`), in a
    worker thread: dropping pages may need the daemon to answer the writes of dirty ones."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only)
    except OSError:                     # the kernel no longer knows the inode: nothing cached
        pass


def _file_info(a: Answer) -> pyfuse3.FileInfo:
    """pyfuse3's reply to an open (keep_cache and nonseekable always explicit: pyfuse3
    defaults keep_cache on)."""
    if a.backing_id:
        return pyfuse3.FileInfo(fh=a.fh, direct_io=a.direct_io, keep_cache=False,
                                nonseekable=False, backing_id=a.backing_id)
    return pyfuse3.FileInfo(fh=a.fh, direct_io=a.direct_io, keep_cache=a.keep_cache,
                            nonseekable=False)


def _dot_attr(ino: int) -> pyfuse3.EntryAttributes:
    """The entry of "." or ".." in a listing: only its inode number and type are used (the
    kernel links neither name from a listing)."""
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.st_mode = stat_mod.S_IFDIR | 0o755
    return a
