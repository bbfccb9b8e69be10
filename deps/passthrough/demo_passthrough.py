#!/usr/bin/env python3
"""Tiny pyfuse3 filesystem mirroring SOURCE at MOUNTPOINT that opens files with FUSE passthrough.

Needs the patched pyfuse3 (deps/passthrough/build.sh) and CAP_SYS_ADMIN. Enough for fio and cat:
lookup, getattr, readdir, open/read/write/release. Prints its request counters as JSON on exit.
    demo_passthrough.py SOURCE MOUNTPOINT [--no-passthrough] [--direct-io] [--honor-odirect]
"""
import argparse, json, mmap, os, signal
import pyfuse3, trio
from pyfuse3 import ROOT_INODE, FileInfo, FUSEError


class Demo(pyfuse3.Operations):
    def __init__(self, src, passthrough=True, direct_io=False, honor_odirect=False):
        super().__init__()
        self.enable_passthrough, self.direct_io, self.honor_odirect = passthrough, direct_io, honor_odirect
        self.paths = {ROOT_INODE: os.path.abspath(src)}   # inode -> path in SOURCE (never forgotten)
        self.fds = {}                                      # fh (= our own fd) -> (inode, backing_id)
        self.backing = {}                                  # inode -> [backing_id, passthrough opens]
        self.stats = dict(open=0, passthrough_open=0, read=0, write=0)
        self.policy = None  # optional callable (inode, flags) -> (passthrough?, direct_io?) for experiments

    def _attr(self, path):
        st, a = os.lstat(path), pyfuse3.EntryAttributes()
        for k in ('st_mode', 'st_nlink', 'st_uid', 'st_gid', 'st_size', 'st_atime_ns', 'st_mtime_ns', 'st_ctime_ns'):
            setattr(a, k, getattr(st, k))
        a.st_ino = ROOT_INODE if path == self.paths[ROOT_INODE] else st.st_ino
        self.paths[a.st_ino] = path
        return a

    def _path(self, inode):
        if inode not in self.paths: raise FUSEError(2)
        return self.paths[inode]

    async def lookup(self, parent, name, ctx):
        try: return self._attr(os.path.join(self._path(parent), os.fsdecode(name)))
        except OSError as e: raise FUSEError(e.errno)

    async def getattr(self, inode, ctx): return self._attr(self._path(inode))
    async def opendir(self, inode, ctx): return inode
    async def releasedir(self, fh): pass

    async def readdir(self, inode, start, token):
        names = sorted(os.listdir(self._path(inode)))
        for i, n in enumerate(names[start:], start):
            if not pyfuse3.readdir_reply(token, os.fsencode(n), self._attr(os.path.join(self._path(inode), n)), i + 1): break

    async def open(self, inode, flags, ctx):
        keep = os.O_DIRECT if self.honor_odirect else 0   # our fd serves the reads that do not pass through
        try: fd = os.open(self._path(inode), flags & ~(os.O_CREAT | os.O_EXCL | os.O_DIRECT) | (flags & keep))
        except OSError as e: raise FUSEError(e.errno)
        use_pt, direct = self.policy(inode, flags) if self.policy else (pyfuse3.passthrough_enabled(), self.direct_io)
        bid = 0
        if use_pt:  # the kernel wants ONE backing id per inode while any passthrough open of it exists
            ent = self.backing.setdefault(inode, [0, 0])
            if not ent[0]:
                try: ent[0] = pyfuse3.passthrough_open(fd)
                except OSError as e: os.close(fd); del self.backing[inode]; raise FUSEError(e.errno)
            ent[1] += 1; bid = ent[0]; self.stats['passthrough_open'] += 1
        self.stats['open'] += 1; self.fds[fd] = (inode, bid)
        return FileInfo(fh=fd, backing_id=bid, direct_io=direct, keep_cache=False)

    async def read(self, fh, off, size):
        self.stats['read'] += 1
        if not self.honor_odirect: return os.pread(fh, size, off)
        buf = mmap.mmap(-1, max(size, 4096)); n = os.preadv(fh, [buf], off)  # page-aligned for O_DIRECT
        return buf[:n]

    async def write(self, fh, off, data):
        self.stats['write'] += 1; return os.pwrite(fh, data, off)

    async def release(self, fh):
        inode, bid = self.fds.pop(fh); os.close(fh)
        if bid:
            ent = self.backing[inode]; ent[1] -= 1
            if not ent[1]: del self.backing[inode]; pyfuse3.passthrough_close(bid)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('source'); p.add_argument('mountpoint')
    p.add_argument('--no-passthrough', action='store_true', help='serve every read/write in the daemon')
    p.add_argument('--direct-io', action='store_true', help='set FileInfo.direct_io on every open')
    p.add_argument('--honor-odirect', action='store_true', help="keep the client's O_DIRECT on our own fd")
    a = p.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # kill -TERM: unmount cleanly too
    ops = Demo(a.source, not a.no_passthrough, a.direct_io, a.honor_odirect)
    pyfuse3.init(ops, a.mountpoint, set(pyfuse3.default_options) | {'fsname=ptdemo'})
    try: trio.run(pyfuse3.main)
    finally: pyfuse3.close(); print(json.dumps(dict(ops.stats, passthrough_enabled=pyfuse3.passthrough_enabled())), flush=True)


if __name__ == '__main__':
    main()
