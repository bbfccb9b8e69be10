"""An O_DIRECT write and buffered readers of the same file (xfstests generic/451, found by a
helper): after the write returns, a buffered read must see it, through a new open and
through one the reader kept open. The kernel drops its cached pages of the range before it
sends a direct_io write, but a buffered read by another process in the meantime may put
the older bytes back; cachefs drops them again once the write is done (openmode.wrote_direct)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import pytest

from cachefs import aio

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


@pytest.mark.skipif(not aio.AVAILABLE, reason="no Linux AIO here (cachefs/aio.py)")
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
                aio.pwrite_all(fd, fd, [(buf, 0)])      # io_submit: the kernel's AIO path
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
