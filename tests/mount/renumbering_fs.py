#!/usr/bin/env python3
"""A FUSE filesystem over a directory that numbers its files anew at every mount, in lookup
order, with whole-second times and ctime = mtime, as sshfs does without -o use_ino (libfuse's
high-level API hands out node ids in lookup order). The BACKING of
tests/mount/test_renumbering_backing.py (after a helper's seqino_fs.py).

    renumbering_fs.py SOURCE MOUNTPOINT        (foreground; fusermount3 -u to stop)
"""

from __future__ import annotations

import os
import stat
import sys

import pyfuse3
import trio


class Renumbering(pyfuse3.Operations):
    def __init__(self, src: str):
        super().__init__()
        self.path = {pyfuse3.ROOT_INODE: src}
        self.ino = {src: pyfuse3.ROOT_INODE}
        self.next = 1000
        self.src = src

    def _ino(self, p: str) -> int:
        if p not in self.ino:
            self.next += 1
            self.ino[p] = self.next
            self.path[self.next] = p
        return self.ino[p]

    def _attr(self, p: str, ino: int) -> pyfuse3.EntryAttributes:
        st = os.lstat(p)
        a = pyfuse3.EntryAttributes()
        a.st_ino, a.st_mode, a.st_nlink = ino, st.st_mode, st.st_nlink
        a.st_uid, a.st_gid, a.st_size = st.st_uid, st.st_gid, st.st_size
        a.st_blksize, a.st_blocks = 4096, st.st_blocks
        sec = int(st.st_mtime) * 10**9
        a.st_mtime_ns = a.st_ctime_ns = sec
        a.st_atime_ns = int(st.st_atime) * 10**9
        a.attr_timeout = a.entry_timeout = 1
        return a

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None

    async def lookup(self, parent, name, ctx=None):
        p = os.path.join(self.path[parent], os.fsdecode(name))
        return self._call(lambda: self._attr(p, self._ino(p)))

    async def getattr(self, inode, ctx=None):
        return self._call(self._attr, self.path[inode], inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        p = self.path[inode]
        if fields.update_size:
            self._call(os.truncate, p, attr.st_size)
        if fields.update_mtime or fields.update_atime:
            st = os.lstat(p)
            self._call(os.utime, p, None, (
                attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
        if fields.update_mode:
            self._call(os.chmod, p, stat.S_IMODE(attr.st_mode))
        return self._call(self._attr, p, inode)

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, off, token):
        names = sorted(os.listdir(self.path[fh]))
        for i, n in enumerate(names[off:], off):
            p = os.path.join(self.path[fh], n)
            if not pyfuse3.readdir_reply(token, os.fsencode(n), self._attr(p, self._ino(p)),
                                         i + 1):
                break

    async def releasedir(self, fh):
        pass

    async def open(self, inode, flags, ctx):
        flags &= ~(os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_APPEND)
        return pyfuse3.FileInfo(fh=self._call(os.open, self.path[inode], flags),
                                keep_cache=False)

    async def read(self, fh, off, size):
        return self._call(os.pread, fh, size, off)

    async def write(self, fh, off, buf):
        return self._call(os.pwrite, fh, buf, off)

    async def fsync(self, fh, datasync):
        self._call(os.fsync, fh)

    async def flush(self, fh):
        pass

    async def release(self, fh):
        os.close(fh)

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        sv = os.statvfs(self.src)
        for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                  "f_ffree", "f_favail", "f_namemax"):
            setattr(s, k, getattr(sv, k))
        return s


def main() -> None:
    src, mnt = os.path.abspath(sys.argv[1]), sys.argv[2]
    opts = set(pyfuse3.default_options) | {"fsname=renumbering", "allow_other"}
    pyfuse3.init(Renumbering(src), mnt, opts)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()


if __name__ == "__main__":
    main()
