"""An O_DIRECT write and buffered readers of the same file (xfstests generic/451, found by a
helper): after the write returns, a buffered read must see it, through a new open and
through one the reader kept open. The kernel drops its cached pages of the range before it
sends a direct_io write, but a buffered read by another process in the meantime may put
the older bytes back; cachefs drops them again once the write is done (openmode.wrote_direct)."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.fuse

SIZE = 640 * 1024
READER = """
import os, sys, time
path, until = sys.argv[1], float(sys.argv[2])
while time.time() < until:
    fd = os.open(path, os.O_RDONLY)
    os.pread(fd, %d, 0)
    os.close(fd)
""" % SIZE


class _Iocb(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32),
                ("rw_flags", ctypes.c_uint32), ("opcode", ctypes.c_uint16),
                ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("offset", ctypes.c_int64), ("reserved2", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


_libc = ctypes.CDLL(None, use_errno=True)
_IO_SETUP, _IO_DESTROY, _IO_GETEVENTS, _IO_SUBMIT = 206, 207, 208, 209     # x86_64


def aio_pwrite(fd: int, buf: mmap.mmap, off: int) -> int:
    """One asynchronous write (Linux AIO, as libaio's io_submit), waited for: the kernel's
    path for it differs from a synchronous O_DIRECT write's."""
    ctx = ctypes.c_ulong(0)
    if _libc.syscall(_IO_SETUP, 1, ctypes.byref(ctx)) < 0:
        raise OSError(ctypes.get_errno(), "io_setup")
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        cb = _Iocb(opcode=1, fildes=fd, buf=addr, nbytes=len(buf), offset=off)
        cbs = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(cb))
        if _libc.syscall(_IO_SUBMIT, ctx, 1, cbs) != 1:
            raise OSError(ctypes.get_errno(), "io_submit")
        ev = _Event()
        if _libc.syscall(_IO_GETEVENTS, ctx, 1, 1, ctypes.byref(ev), None) != 1:
            raise OSError(ctypes.get_errno(), "io_getevents")
        return ev.res
    finally:
        _libc.syscall(_IO_DESTROY, ctx)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="AIO syscall numbers of x86_64")
def test_a_buffered_read_after_an_o_direct_write_sees_it(make_mount, mode):
    m = make_mount("--mode", mode)
    path = m.path("f")
    path.write_bytes(bytes(SIZE))
    buf = mmap.mmap(-1, SIZE)                       # aligned for O_DIRECT
    kept = os.open(path, os.O_RDONLY)               # a reader that keeps its open
    until = time.time() + 6
    readers = [subprocess.Popen([sys.executable, "-c", READER, str(path), str(until)])
               for _ in range(2)]
    stale = []
    try:
        n = 0
        while time.time() < until - 1 and len(stale) < 3:
            n += 1
            fill = bytes([0x55 if n % 2 else 0xAA]) * SIZE
            buf[:] = fill
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            try:
                assert aio_pwrite(fd, buf, 0) == SIZE
            finally:
                os.close(fd)
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.pread(fd, SIZE, 0) != fill:
                    stale.append((n, "a new open"))
            finally:
                os.close(fd)
            if os.pread(kept, SIZE, 0) != fill:
                stale.append((n, "an open kept"))
    finally:
        os.close(kept)
        for p in readers:
            p.wait(timeout=30)
    assert not stale, f"older bytes read after {n} writes: {stale}"
