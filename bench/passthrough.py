#!/usr/bin/env python3
"""A bare pyfuse3 passthrough: the reference for what Python FUSE does on this machine.

No latency model, no cache, no counters: each read/write is one synchronous os.pread /
os.pwrite inside the async handler (the fastest pyfuse3 shape, see STYLE.md section 1).
Enough of POSIX for fio and simple tools; not a general-purpose filesystem.

    passthrough.py mount [-f] SOURCE MOUNTPOINT
"""

from __future__ import annotations

import argparse
import os
import signal
import stat
import subprocess
import sys
import time

import pyfuse3
import trio
from pyfuse3 import FUSEError, ROOT_INODE

_OPEN_MASK = ~(os.O_APPEND | os.O_DIRECT | os.O_CREAT | os.O_EXCL | os.O_NOCTTY)


class Passthrough(pyfuse3.Operations):
    def __init__(self, source: str) -> None:
        super().__init__()
        self._paths: dict[int, bytes] = {ROOT_INODE: os.fsencode(os.path.abspath(source))}
        self._src_ino = os.lstat(self._paths[ROOT_INODE]).st_ino
        self._lookups: dict[int, int] = {}
        self._fds: dict[int, int] = {}
        self._dirs: dict[int, list] = {}
        self._next_fh = 1

    def _attrs(self, st: os.stat_result, path: bytes | None = None) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        ino = st.st_ino
        a.st_ino = ROOT_INODE if ino == self._src_ino else (self._src_ino if ino == 1 else ino)
        if path is not None:
            self._paths[a.st_ino] = path
        for key in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                    "st_blksize", "st_blocks", "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(a, key, getattr(st, key))
        a.entry_timeout = a.attr_timeout = 1.0
        return a

    def _stat(self, path: bytes, remember: bool = True) -> pyfuse3.EntryAttributes:
        try:
            attrs = self._attrs(os.lstat(path), path)
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        if remember:
            self._lookups[attrs.st_ino] = self._lookups.get(attrs.st_ino, 0) + 1
        return attrs

    def _child(self, parent: int, name: bytes) -> bytes:
        return self._paths[parent] + b"/" + name

    async def lookup(self, parent_inode, name, ctx=None):
        return self._stat(self._child(parent_inode, name))

    async def forget(self, inode_list):
        for ino, n in inode_list:
            left = self._lookups.get(ino, 0) - n
            if left > 0:
                self._lookups[ino] = left
            else:
                self._lookups.pop(ino, None)
                if ino != ROOT_INODE:
                    self._paths.pop(ino, None)

    async def getattr(self, inode, ctx=None):
        return self._stat(self._paths[inode], remember=False)

    async def setattr(self, inode, attr, fields, fh, ctx):
        target = self._fds[fh] if fh is not None else self._paths[inode]
        try:
            if fields.update_size:
                os.truncate(target, attr.st_size)
            if fields.update_mode:
                os.chmod(target, stat.S_IMODE(attr.st_mode))
            if fields.update_atime or fields.update_mtime:
                st = os.stat(target)
                os.utime(target, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                     attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        return self._stat(self._paths[inode], remember=False)

    async def mkdir(self, parent_inode, name, mode, ctx):
        path = self._child(parent_inode, name)
        try:
            os.mkdir(path, stat.S_IMODE(mode))
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        return self._stat(path)

    async def unlink(self, parent_inode, name, ctx):
        try:
            os.unlink(self._child(parent_inode, name))
        except OSError as exc:
            raise FUSEError(exc.errno) from None

    async def rmdir(self, parent_inode, name, ctx):
        try:
            os.rmdir(self._child(parent_inode, name))
        except OSError as exc:
            raise FUSEError(exc.errno) from None

    async def rename(self, parent_old, name_old, parent_new, name_new, flags, ctx):
        new = self._child(parent_new, name_new)
        try:
            os.rename(self._child(parent_old, name_old), new)
            self._attrs(os.lstat(new), new)        # the inode's path is now the new one
        except OSError as exc:
            raise FUSEError(exc.errno) from None

    async def symlink(self, parent_inode, name, target, ctx):
        path = self._child(parent_inode, name)
        try:
            os.symlink(target, path)
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        return self._stat(path)

    async def readlink(self, inode, ctx):
        try:
            return os.readlink(self._paths[inode])
        except OSError as exc:
            raise FUSEError(exc.errno) from None

    async def link(self, inode, new_parent_inode, new_name, ctx):
        path = self._child(new_parent_inode, new_name)
        try:
            os.link(self._paths[inode], path)
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        return self._stat(path)

    async def statfs(self, ctx):
        sv = os.statvfs(self._paths[ROOT_INODE])
        out = pyfuse3.StatvfsData()
        for key in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                    "f_ffree", "f_favail", "f_namemax"):
            setattr(out, key, getattr(sv, key))
        return out

    def _fileinfo(self, fd: int, flags: int) -> pyfuse3.FileInfo:
        fh = self._next_fh
        self._next_fh += 1
        self._fds[fh] = fd
        return pyfuse3.FileInfo(fh=fh, direct_io=bool(flags & os.O_DIRECT), keep_cache=False)

    async def open(self, inode, flags, ctx):
        try:
            fd = os.open(self._paths[inode], flags & _OPEN_MASK)
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        return self._fileinfo(fd, flags)

    async def create(self, parent_inode, name, mode, flags, ctx):
        path = self._child(parent_inode, name)
        try:
            fd = os.open(path, (flags & _OPEN_MASK) | os.O_CREAT, stat.S_IMODE(mode))
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        return self._fileinfo(fd, flags), self._stat(path)

    async def read(self, fh, off, size):
        try:
            return os.pread(self._fds[fh], size, off)
        except OSError as exc:
            raise FUSEError(exc.errno) from None

    async def write(self, fh, off, buf):
        try:
            return os.pwrite(self._fds[fh], buf, off)
        except OSError as exc:
            raise FUSEError(exc.errno) from None

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        try:
            (os.fdatasync if datasync else os.fsync)(self._fds[fh])
        except OSError as exc:
            raise FUSEError(exc.errno) from None

    async def release(self, fh):
        os.close(self._fds.pop(fh))

    async def opendir(self, inode, ctx):
        path = self._paths[inode]
        try:
            names = os.listdir(path)
        except OSError as exc:
            raise FUSEError(exc.errno) from None
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = [(inode, path + b"/" + n, n) for n in sorted(names)]
        return fh

    async def readdir(self, fh, start_id, token):
        entries = self._dirs[fh]
        for i in range(start_id, len(entries)):
            _, path, name = entries[i]
            try:
                st = os.lstat(path)
            except OSError:
                continue
            attrs = self._attrs(st, path)
            if not pyfuse3.readdir_reply(token, name, attrs, i + 1):
                break
            self._lookups[attrs.st_ino] = self._lookups.get(attrs.st_ino, 0) + 1

    async def releasedir(self, fh):
        self._dirs.pop(fh, None)


def main() -> int:
    parser = argparse.ArgumentParser(prog="passthrough.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mount")
    m.add_argument("-f", "--foreground", action="store_true")
    m.add_argument("source", metavar="SOURCE")
    m.add_argument("mountpoint", metavar="MOUNTPOINT")
    args = parser.parse_args()
    for what, path in (("SOURCE", args.source), ("MOUNTPOINT", args.mountpoint)):
        if not os.path.isdir(path):
            print(f"passthrough: {what} {path!r} is not a directory.", file=sys.stderr)
            return 2
    if not args.foreground:                     # detach, return once mounted
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "mount", "-f",
                                 args.source, args.mountpoint], start_new_session=True,
                                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not os.path.ismount(args.mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                print("passthrough: the daemon did not mount.", file=sys.stderr)
                return 1
            time.sleep(0.02)
        return 0

    os.umask(0)
    options = set(pyfuse3.default_options) | {"fsname=passthrough", "subtype=passthrough"}
    if os.geteuid() == 0:
        options.add("allow_other")
    pyfuse3.init(Passthrough(args.source), args.mountpoint, options)
    # Same kernel queue as cachefs and slowfs (64 async requests, not 12): the reference
    # must not be handicapped against what it is the reference for.
    from slowfs import _raise_max_background
    _raise_max_background(args.mountpoint, 64)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            async def on_signal():
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
                    async for _ in sigs:
                        pyfuse3.terminate()
                        return
            nursery.start_soon(on_signal)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
