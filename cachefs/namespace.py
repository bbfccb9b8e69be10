"""BACKING's namespace and attributes for the FUSE operations: stats, directories, links,
renames, xattrs, statfs, and the closing of released descriptors.

Owns nothing but the calls: each is one `Backing` thread call (limiter, timeouts) on a path
relative to BACKING's root descriptor (or an fd of an open handle). The engine façade hands
it to `fs` (`Cache.namespace`), so `fs` talks to the engine, never to `Backing` itself.
Engine state (coherence, unlink intents) stays with the callers.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as stat_mod
import time

from . import backingpaths as bp
from .backing import Backing
from .inodes import ROOT_INODE

CAPS = b"security.capability"

log = logging.getLogger("cachefs.namespace")


class Known:
    """Inodes known to lack something (a capability, setuid bits) for a while: `ttl_s` after
    the last look, as the kernel trusts attributes for --attr-timeout. Bounded: expired
    entries go when it holds 4,096."""

    def __init__(self, ttl_s: float):
        self._until: dict[int, float] = {}
        self._ttl_s = ttl_s

    def __contains__(self, ino: int) -> bool:
        until = self._until.get(ino)
        return until is not None and until > time.monotonic()

    def add(self, ino: int) -> None:
        now = time.monotonic()
        if len(self._until) >= 4096:
            self._until = {i: t for i, t in self._until.items() if t > now}
        self._until[ino] = now + self._ttl_s

    def discard(self, ino: int) -> None:
        self._until.pop(ino, None)


CAP_FSETID = 4


class Caller:
    """The credentials of the process behind a request, as far as the kernel's check of
    a setgid bit needs them: its filesystem gid, supplementary groups and CAP_FSETID (from
    /proc/PID/status; a process gone meanwhile: its uid and gid from the request)."""

    def __init__(self, pid: int, uid: int, gid: int):
        self.fsgid, self.groups, self.fsetid = gid, (), uid == 0
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key == "Gid":
                        self.fsgid = int(value.split()[3])
                    elif key == "Groups":
                        self.groups = tuple(int(g) for g in value.split())
                    elif key == "CapEff":
                        self.fsetid = bool(int(value, 16) >> CAP_FSETID & 1)
        except (OSError, ValueError, IndexError):
            pass

    def in_group_or_capable(self, gid: int) -> bool:
        return self.fsetid or gid == self.fsgid or gid in self.groups


class Namespace:
    def __init__(self, backing: Backing, attr_timeout_s: float = 1.0):
        self._backing = backing
        self._root = backing.root_fd
        # The kernel asks for security.capability before every write to a file (to remove
        # it): inode -> until when BACKING is known to have none (a file created here, or
        # asked within --attr-timeout), so those asks do not each cost a BACKING call. An
        # outside setcap on BACKING is seen within --attr-timeout, as attributes are.
        self._no_caps = Known(attr_timeout_s)
        # FUSE_HANDLE_KILLPRIV_V2: every write by a caller without CAP_FSETID asks us to drop
        # the file's setuid/setgid bits: inode -> until when its mode is known to have none
        # (set on a look, dropped by a chmod through the mount; an outside chmod on BACKING
        # is seen within --attr-timeout, as attributes are).
        self._no_sxid = Known(attr_timeout_s)

    async def lstat(self, path: bytes) -> os.stat_result:
        return await self._backing.lstat(path)

    async def fstat(self, fd: int) -> os.stat_result:
        return await self._backing.fstat(fd)

    async def lstat_in(self, parent: bytes, name: bytes
                       ) -> tuple[os.stat_result, os.stat_result | None]:
        return await self._backing.read_call("stat", bp.lstat_in, self._root, parent, name)

    async def setattr(self, path: bytes, fd: int | None, mode: int | None, uid: int,
                      gid: int, times: tuple | None, touch: bool, ino: int | None = None
                      ) -> os.stat_result:
        return await self._backing.write_call(bp.setattr, self._root, path, fd, mode, uid,
                                              gid, times, touch, ino)

    async def readlink(self, path: bytes) -> bytes:
        return await self._backing.read_call("readlink", bp.readlink, self._root, path)

    async def mknod(self, path: bytes, mode: int, rdev: int, uid: int, gid: int,
                    parent: bytes, umask: int) -> os.stat_result:
        return await self._backing.write_call(bp.mknod, self._root, path, mode, rdev, uid,
                                              gid, parent, umask)

    async def mkdir(self, path: bytes, mode: int, uid: int, gid: int, parent: bytes,
                    umask: int) -> os.stat_result:
        return await self._backing.write_call(bp.mkdir, self._root, path, mode, uid, gid,
                                              parent, umask)

    async def symlink(self, target: bytes, path: bytes, uid: int, gid: int, parent: bytes
                      ) -> os.stat_result:
        return await self._backing.write_call(bp.symlink, self._root, target, path, uid,
                                              gid, parent)

    async def unlink(self, path: bytes) -> tuple[os.stat_result, int]:
        """(the stat from just before, an O_PATH holder of a removed file or -1)"""
        return await self._backing.write_call(bp.unlink, self._root, path)

    async def rmdir(self, path: bytes) -> tuple[os.stat_result, int]:
        """(the stat from just before, an O_PATH holder of the removed directory)"""
        return await self._backing.write_call(bp.rmdir, self._root, path)

    async def rename(self, old: bytes, new: bytes, flags: int):
        """(the stat of what `new` named before, or None; the stat of the moved node; an
        O_PATH holder of the replaced file if that was its last name, or -1)"""
        return await self._backing.write_call(bp.rename, self._root, old, new, flags)

    async def link(self, old: bytes | None, new: bytes, fd: int | None = None
                   ) -> os.stat_result:
        """A new name for `old`, or (old None) for the node of descriptor `fd`."""
        return await self._backing.write_call(bp.link, self._root, old, new, fd)

    async def open_dir(self, path: bytes, ino: int | None) -> int:
        return await self._backing.read_call("opendir", bp.open_dir, self._root, path, ino)

    async def scandir_fd(self, fd: int) -> list:
        return await self._backing.read_call("readdir", bp.scandir_fd, fd)

    async def scandir(self, path: bytes, ino: int | None = None) -> list:
        return await self._backing.read_call("readdir", bp.scandir, self._root, path, ino)

    async def fsync_path(self, path: bytes, datasync: bool) -> None:
        await self._backing.write_call(bp.fsync_path, self._root, path, datasync)

    async def statvfs(self) -> os.statvfs_result:
        return await self._backing.read_call("statfs", bp.statvfs, self._root)

    async def kill_suidgid(self, ino: int, path: bytes, fd: int | None,
                           who: tuple[int, int, int]) -> os.stat_result | None:
        """Drop the setuid bit, and the setgid bit of a group-executable file or of any file
        whose group the caller is not in, as Linux (>= 6.2, setattr_should_drop_sgid) does
        for a write, truncate, fallocate or O_TRUNC open by a caller without CAP_FSETID
        (the kernel leaves it to the file system with FUSE_HANDLE_KILLPRIV_V2 and says
        when). `who`: the caller's (pid, uid, gid). Returns BACKING's new stat, or None when
        there was nothing to drop."""
        if ino in self._no_sxid:
            return None
        st = await (self.fstat(fd) if fd is not None else self.lstat(path))
        mode = st.st_mode
        if not mode & (stat_mod.S_ISUID | stat_mod.S_ISGID) or not stat_mod.S_ISREG(mode):
            self._no_sxid.add(ino)
            return None
        keep = mode & ~stat_mod.S_ISUID
        if mode & stat_mod.S_ISGID and (
                mode & stat_mod.S_IXGRP or not Caller(*who).in_group_or_capable(st.st_gid)):
            keep &= ~stat_mod.S_ISGID
        if keep == mode:
            return None
        return await self.setattr(path, fd, stat_mod.S_IMODE(keep), -1, -1, None, False)

    async def acl_kill_sgid(self, path: bytes | None, fd: int | None, caller: Caller
                            ) -> os.stat_result | None:
        """After an access ACL was set: drop the setgid bit where Linux would (the caller is
        not in the node's group and lacks CAP_FSETID, as for a chmod). BACKING applied the
        ACL with cachefs's credentials, which keep it; the kernel asks file systems to do
        this with FUSE_SETXATTR_ACL_KILL_SGID, which pyfuse3 cannot pass on. BACKING's new
        stat, or None if nothing was dropped."""
        st = await (self.fstat(fd) if fd is not None else self.lstat(path))
        if not st.st_mode & stat_mod.S_ISGID or caller.in_group_or_capable(st.st_gid):
            return None
        mode = stat_mod.S_IMODE(st.st_mode) & ~stat_mod.S_ISGID
        return await self.setattr(path or b"", fd, mode, -1, -1, None, False)

    def caps_absent(self, ino: int) -> bool:
        """Whether `ino` is known to have no security.capability now (no BACKING call)."""
        return ino in self._no_caps

    async def kill_caps(self, ino: int, fd: int) -> bool:
        """Drop the file's security.capability before a write, as any Linux write does
        (whoever writes). The kernel asks for it before buffered writes, but not before
        O_DIRECT ones, and a write-back write reaches BACKING (whose own write drops it)
        only when destaged. True if one was dropped. Never fails the write: a BACKING that
        cannot say (failing, hung: the read times out) or refuses is logged, and the
        destage's write drops it there later; while BACKING is failing, writes do not wait
        for it here."""
        if self._backing.health.failing_since_s is not None:
            self._no_caps.add(ino)
            return False
        try:
            await self._backing.read_call("getxattr", bp.getxattr, self._root, b"", fd, CAPS)
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP):
                log.debug("inode %d: security.capability not checked before a write: %s",
                          ino, exc)
            self._no_caps.add(ino)
            return False
        try:
            await self._backing.write_call(bp.removexattr, self._root, b"", fd, CAPS)
        except OSError as exc:
            if exc.errno != errno.ENODATA:
                log.warning("inode %d: its security.capability could not be dropped before "
                            "a write: %s", ino, exc)
        self._no_caps.add(ino)
        return True

    def mode_changed(self, ino: int) -> None:
        """A chmod (or chown) of `ino` through the mount: its setuid/setgid bits may be new."""
        self._no_sxid.discard(ino)

    def created(self, ino: int) -> None:
        """A file was just created through the mount: it has no security.capability."""
        self._no_caps.add(ino)

    async def getxattr(self, path: bytes | None, fd: int | None, name: bytes,
                       ino: int = 0) -> bytes:
        if name == CAPS and ino:
            if ino in self._no_caps:
                raise OSError(errno.ENODATA, os.strerror(errno.ENODATA))
        try:
            return await self._backing.read_call("getxattr", bp.getxattr, self._root, path,
                                                 fd, name, _backing_ino(ino))
        except OSError as exc:
            if exc.errno == errno.ENODATA and name == CAPS and ino:
                self._no_caps.add(ino)
            raise

    def xattrs_changed(self, ino: int) -> None:
        """An xattr of `ino` was set or removed through the mount."""
        self._no_caps.discard(ino)

    async def listxattr(self, path: bytes | None, fd: int | None, ino: int = 0) -> list[str]:
        return await self._backing.read_call("listxattr", bp.listxattr, self._root, path, fd,
                                             _backing_ino(ino))

    async def setxattr(self, path: bytes | None, fd: int | None, name: bytes, value: bytes,
                       ino: int = 0) -> None:
        await self._backing.write_call(bp.setxattr, self._root, path, fd, name, value,
                                       _backing_ino(ino))

    async def removexattr(self, path: bytes | None, fd: int | None, name: bytes,
                          ino: int = 0) -> None:
        await self._backing.write_call(bp.removexattr, self._root, path, fd, name,
                                       _backing_ino(ino))

    async def close_all(self, fds: list[int]) -> list[OSError]:
        """Close released descriptors in one thread call; returns the errors that are not
        BACKING health's (those are counted and logged there)."""
        return await self._backing.close_all(fds)


def _backing_ino(ino: int) -> int:
    """The BACKING inode number an xattr call by path checks its node against (inodes.py:
    a node's FUSE inode is its BACKING st_ino, but for the root, which is not checked)."""
    return 0 if ino == ROOT_INODE else ino
