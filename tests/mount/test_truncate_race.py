"""Readers of a file that another process empties and rewrites in a loop (O_TRUNC open, one
write, truncate to 0): every read returns bytes that were written, never zeros.

cachefs fails this today (open defect, found by a verification sweep at the end of the
session of 2026-11-26): in write-back about half the reads return zeros for the 16 bytes
just written, in write-through about 2 %; the same loop on ext4 gave 0 in 1.9 million
reads. The zeros do not come from cachefs's replies (none of its READ answers held them):
they are the kernel's FUSE page cache racing the truncate, and a bare pyfuse3 passthrough
(bench/passthrough.py) shows them too (23 % of reads). BACKING and the mount are right once
the loop stops. The test is marked xfail(strict), so that a fix (in cachefs, such as
answering these opens differently, or in the kernel) shows up as an unexpected pass."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

pytestmark = pytest.mark.fuse


def _writer(p: str, seconds: float) -> None:
    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        i += 1
        fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
        os.write(fd, b"%015d\n" % i)
        os.close(fd)
        os.truncate(p, 0)


def _reader(p: str, seconds: float, out) -> None:
    end, n, zeros = time.monotonic() + seconds, 0, 0
    while time.monotonic() < end:
        fd = os.open(p, os.O_RDONLY)
        data = os.read(fd, 1 << 16)
        os.close(fd)
        n += 1
        zeros += b"\0" in data
    out.put((n, zeros))


@pytest.mark.xfail(strict=True, reason="open defect: readers see zeros during truncates "
                   "(write-through ~2 % of reads, write-back ~60 %, a bare pyfuse3 "
                   "passthrough 23 %; ext4 0 of 1.9 M): the kernel's FUSE page cache")
@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_readers_never_see_zeros_while_a_file_is_emptied_and_rewritten(make_mount, mode):
    m = make_mount("--mode", mode)
    p = str(m.path("zr"))
    with open(p, "wb") as f:
        f.write(b"A" * 16)
    out = mp.Queue()
    procs = [mp.Process(target=_writer, args=(p, 2.0))]
    procs += [mp.Process(target=_reader, args=(p, 2.0, out)) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=60) for _ in range(2)]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert all(n > 100 for n, _ in results), results
    assert sum(z for _, z in results) == 0, results
