#!/usr/bin/env python3
"""Probe how the kernel mixes passthrough, cached and direct_io opens of one inode.

Mounts a variant of demo_passthrough.Demo in-process over SCRATCH/src at SCRATCH/mnt, drives it
from a worker thread (the daemon keeps running in the trio thread), prints one line per
observation plus a JSON list at the end, and unmounts (also on failure). Needs the patched
pyfuse3 and root.
    passthrough_facts.py SCRATCH_DIR
"""
import ctypes, errno, inspect, json, mmap, os, sys, time
import pyfuse3, trio
from pyfuse3 import FileInfo
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_passthrough import Demo


def sys_admin(on):
    """Raise or drop CAP_SYS_ADMIN in this thread's effective set (capabilities are per thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()   # v3 header, 2 x (eff, perm, inh)
    libc.capget(hdr, data)
    data[0] = data[0] | (1 << 21) if on else data[0] & ~(1 << 21)               # CAP_SYS_ADMIN = 21
    if libc.capset(hdr, data) != 0:
        raise OSError(ctypes.get_errno(), 'capset')


class Probe(Demo):
    """Every open follows the next entry of self.plan: pt = None | 'shared' | 'new', direct,
    close = backing ids to passthrough_close() first. Backing ids are otherwise never closed."""

    def __init__(self, src):
        super().__init__(src)
        self.plan, self.shared, self.replied, self.released = [], {}, 0, 0

    async def open(self, inode, flags, ctx):
        how = self.plan.pop(0)
        for bid in how.get('close', ()):
            pyfuse3.passthrough_close(bid)
        fd = os.open(self.paths[inode], flags & ~(os.O_CREAT | os.O_EXCL))
        bid = 0
        if how.get('nocap'):
            sys_admin(False)
            try: how['error'] = 'backing id %d' % pyfuse3.passthrough_open(fd)
            except OSError as e: how['error'] = errno.errorcode[e.errno]
            finally: sys_admin(True)
        elif how['pt'] == 'new' or (how['pt'] == 'shared' and inode not in self.shared):
            bid = pyfuse3.passthrough_open(fd)
            if how['pt'] == 'shared':
                self.shared[inode] = bid
        elif how['pt'] == 'shared':
            bid = self.shared[inode]
        elif how['pt'] is not None:
            bid = how['pt']                      # an explicit (possibly stale) backing id
        self.fds[fd] = (inode, bid); self.replied += 1; how['bid'] = bid
        fi = FileInfo(fh=fd, backing_id=bid, direct_io=how.get('direct', False), keep_cache=how.get('keep', False),
                      nonseekable=how.get('nonseekable', False))
        how['keep_cache_sent'] = fi.keep_cache
        return fi

    async def release(self, fh):
        self.fds.pop(fh); os.close(fh); self.released += 1


results = []


def note(what, outcome, **extra):
    results.append(dict(what=what, outcome=outcome, **extra))
    print(f'- {what}: {outcome}' + (f' {extra}' if extra else ''), flush=True)


def probe(ops, mnt, src):
    def op(name, pt=None, direct=False, flags=os.O_RDONLY, close=(), nocap=False, keep=False, nonseekable=False):
        how = dict(pt=pt, direct=direct, close=close, nocap=nocap, keep=keep, nonseekable=nonseekable)
        ops.plan.append(how)
        try:
            return os.open(os.path.join(mnt, name), flags), how
        except OSError as e:
            if how in ops.plan: ops.plan.remove(how)
            return errno.errorcode[e.errno], how

    def daemon_reads(fd):
        before = ops.stats['read']; n = len(os.pread(fd, 4096, 0))
        return dict(read_bytes=n, daemon_reads=ops.stats['read'] - before)

    def res(fd): return 'ok' if isinstance(fd, int) else f'open() fails with {fd}'

    x, _ = op('a', 'shared', keep=True)
    note('passthrough open with FileInfo(keep_cache=True), pyfuse3\'s default', res(x))
    if isinstance(x, int): os.close(x)
    x, _ = op('a', 'shared', nonseekable=True); note('passthrough open with FileInfo(nonseekable=True)', res(x))
    if isinstance(x, int): os.close(x)
    a1, _ = op('a', 'shared'); note('passthrough open', res(a1), **daemon_reads(a1))
    x, _ = op('a'); note('cached (no backing_id, no direct_io) open while a passthrough open exists', res(x))
    d, _ = op('a', direct=True)
    note('direct_io open (no backing_id) while a passthrough open exists', res(d),
         **(daemon_reads(d) if isinstance(d, int) else {}))
    x, how = op('a', 'new'); note('passthrough open with a SECOND backing id of the same inode', res(x),
                                  second_id=how.get('bid'))
    a2, _ = op('a', 'shared'); note('second passthrough open with the SAME backing id', res(a2))
    for f in (a1, d, a2):
        if isinstance(f, int): os.close(f)
    c, _ = op('a'); note('cached open after all passthrough opens were closed', res(c))
    x, _ = op('a', 'shared'); note('passthrough open while a cached open exists', res(x))
    os.close(c)
    x, _ = op('a', 'shared'); note('passthrough open after the cached open was closed (old backing id reused)', res(x))
    if isinstance(x, int): os.close(x)

    d, _ = op('b', direct=True); p, _ = op('b', 'shared')
    note('passthrough open while a direct_io open exists', res(p), **(daemon_reads(p) if isinstance(p, int) else {}))
    for f in (d, p):
        if isinstance(f, int): os.close(f)

    pd, _ = op('c', 'shared', direct=True)
    note('open with backing_id AND direct_io=True', res(pd), **(daemon_reads(pd) if isinstance(pd, int) else {}))
    x, _ = op('c'); note('cached open while a backing_id+direct_io open exists', res(x))
    if isinstance(x, int): os.close(x)
    if isinstance(pd, int): os.close(pd)

    m, _ = op('d', 'shared'); before = ops.stats['read']
    with mmap.mmap(m, 8192, prot=mmap.PROT_READ) as mm: ok = mm[:4] == b'dddd'
    note('mmap of a passthrough file', 'ok' if ok else 'wrong data', daemon_reads=ops.stats['read'] - before)
    os.close(m)

    w, _ = op('e', 'shared', flags=os.O_RDWR); w0 = ops.stats['write']
    os.pwrite(w, b'XYZ', 8192); os.fsync(w)
    with open(os.path.join(src, 'e'), 'rb') as f: f.seek(8192); tail = f.read()
    note('write through passthrough', 'ok' if tail == b'XYZ' else f'backing has {tail!r}',
         daemon_writes=ops.stats['write'] - w0, size_via_mount=os.fstat(w).st_size)
    os.close(w)

    f1, how = op('f', 'new'); fid = how['bid']
    g, _ = op('g', close=[fid]); os.close(g)           # passthrough_close(f's id) inside g's open handler
    note('read after passthrough_close() of the id while the file stays open', 'ok', **daemon_reads(f1))
    x, _ = op('f', fid); note('new open of the same inode with the closed backing id', res(x))
    if isinstance(x, int): os.close(x)
    os.close(f1)
    x, how = op('g', nocap=True); os.close(x)
    note('passthrough_open() without CAP_SYS_ADMIN (effective set of the daemon thread)', how['error'])
    deadline = time.monotonic() + 2          # RELEASE is sent asynchronously after close()
    while ops.released < ops.replied and time.monotonic() < deadline: time.sleep(0.01)
    note('opens the daemon replied to (incl. those the kernel then failed with EIO) vs releases received',
         f'{ops.replied} vs {ops.released}')


class WritebackToo(Demo):
    def init(self): self.granted = pyfuse3.passthrough_enabled()


def mount_and_run(ops, mnt, fn):
    # If the daemon loop dies (a handler raising something other than FUSEError), the client
    # thread stays blocked in its syscall: abandon it, and pyfuse3.close() ends the connection.
    params = inspect.signature(trio.to_thread.run_sync).parameters
    abandon = {'abandon_on_cancel' if 'abandon_on_cancel' in params else 'cancellable': True}
    pyfuse3.init(ops, mnt, set(pyfuse3.default_options) | {'fsname=ptfacts'})

    async def run():
        async with trio.open_nursery() as n:
            n.start_soon(pyfuse3.main)
            try: await trio.to_thread.run_sync(fn, **abandon)
            finally: pyfuse3.terminate()
    try: trio.run(run)
    finally: pyfuse3.close()


def main():
    scratch = sys.argv[1]
    src, mnt = os.path.join(scratch, 'src'), os.path.join(scratch, 'mnt')
    os.makedirs(src, exist_ok=True); os.makedirs(mnt, exist_ok=True)
    for name in 'abcdefg':
        with open(os.path.join(src, name), 'wb') as f: f.write(name.encode() * 8192)
    ops = Probe(src)
    mount_and_run(ops, mnt, lambda: probe(ops, mnt, src))
    wb = WritebackToo(src); wb.enable_writeback_cache = True
    mount_and_run(wb, mnt, lambda: os.stat(mnt))   # stat waits for INIT (and so for init())
    note('enable_passthrough together with enable_writeback_cache', f'passthrough_enabled() = {wb.granted}')
    print(json.dumps(results))


if __name__ == '__main__':
    main()
