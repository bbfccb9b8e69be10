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

import mmap
import multiprocessing as mp
import os
import threading
import time

import pytest

from tests.conftest import ctl_flush

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


MIB = 1 << 20
OLD_END = 3 * MIB + MIB // 2 + 16384    # the file's size before the truncate
NEW_END = 3 * MIB // 2                  # ... and after


@pytest.mark.no_passthrough
def test_a_write_back_shrink_past_what_backing_holds_reads_right_while_it_commits(make_mount):
    """Write-back. Each round: the file is emptied, a block at 2 MiB is written ("n",
    dirty; every other round "o" is written and flushed there first, so that BACKING holds
    "o"), an extending write at 3.5 MiB stays dirty (BACKING holds nothing past 2 MiB + 4
    KiB, or nothing at all), then a truncate to 1.5 MiB drops both dirty writes. While the
    truncate commits (fdatasync and database commit, then BACKING's truncate: ms), the file
    is OLD_END or NEW_END bytes long; the 4 KiB at 1 MiB are zeros either way, and the block
    at 2 MiB is "n" or past the end, never "o".

    Before the fix, readers in that window read EOF at 1 MiB (the miss path read BACKING,
    which is shorter), fstat gave BACKING's size (getattr found no dirty data left) and the
    kernel kept it as the file's size, and the block at 2 MiB read "o" from BACKING; a
    helper's stress run got about 100-700 such reads in 10 s."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M", "--attr-timeout", "0")
    p = m.path("f")
    p.write_bytes(b"")
    state = {"gen": 0, "window": False}
    stop = threading.Event()
    bad: list = []
    checked = [0]

    def mutator():
        fd = os.open(p, os.O_RDWR)
        try:
            for i in range(40):
                os.ftruncate(fd, 0)
                flushed = i % 2                 # odd rounds: "o" on BACKING at 2 MiB
                if flushed:
                    os.pwrite(fd, b"o" * 4096, 2 * MIB)
                    ctl_flush(m)
                os.pwrite(fd, b"n" * 4096, 2 * MIB)
                os.pwrite(fd, b"x" * 16384, 3 * MIB + MIB // 2)
                state["gen"] += 1
                state["window"] = True          # from here to the truncate's return
                os.ftruncate(fd, NEW_END)
                state["window"] = False
                state["gen"] += 1
        finally:
            os.close(fd)
            stop.set()

    def reader():
        buf = mmap.mmap(-1, 4096)
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            while not stop.is_set():
                g0, w0 = state["gen"], state["window"]
                hole = os.preadv(fd, [buf], MIB), bytes(buf)
                size = os.fstat(fd).st_size
                n = os.preadv(fd, [buf], 2 * MIB)
                past = buf[:n]
                if state["gen"] != g0 or not w0:
                    continue                    # not wholly inside one window
                checked[0] += 1
                if (hole != (4096, bytes(4096)) or size not in (OLD_END, NEW_END)
                        or past not in (b"", b"n" * 4096)):
                    bad.append((hole[0], hole[1] == bytes(4096), size, past[:1], n))
        finally:
            os.close(fd)

    threads = [threading.Thread(target=mutator)] + [threading.Thread(target=reader)
                                                    for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert checked[0] > 100, checked[0]
    assert not bad, (len(bad), checked[0], bad[:5])
    assert p.stat().st_size == NEW_END and p.read_bytes() == bytes(NEW_END)


@pytest.mark.parametrize("extra", [(), ("--no-passthrough",)])
def test_a_write_during_an_o_trunc_opens_slow_backing_truncate_is_kept(make_mount, tmp_path,
                                                                     extra):
    """Write-back, BACKING's truncate slow (hung here). Process A opens a 1 MiB file with
    O_TRUNC (the kernel holds no inode lock over it, unlike ftruncate); process B, which had
    the file open with O_DIRECT, writes one block at 8 KiB and reads [0, 16 KiB). B's write
    went on during BACKING's truncate: its read saw 12 KiB with BACKING's old bytes at
    [0, 8 KiB), and once the truncate returned its end trimmed B's block away: the file was
    empty, also after B's fsync (a helper's hunt, 10 of 10). Writes now wait for the whole
    shrink, BACKING's included: truncate, then write."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from slowfs_client import mounted_slowfs
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    blk = 4096
    (src / "f").write_bytes(os.urandom(1 << 20))
    with mounted_slowfs(src, slow, latency_ms=0, jitter_ms=0) as sf:
        m = make_mount("--mode", "write-back", "--attr-timeout", "0.2", "--cache-size", "64M",
                       "--dirty-high", "48M", "--dirty-low", "40M", "--max-dirty-age", "1h",
                       *extra, backing=slow)
        buf = mmap.mmap(-1, 4 * blk)
        b = os.open(m.path("f"), os.O_RDWR | os.O_DIRECT)
        try:
            done = []
            t = threading.Thread(target=lambda: done.append(
                os.close(os.open(m.path("f"), os.O_RDWR | os.O_TRUNC)) or 1))
            sf.set(hang_truncate=1)
            t.start()
            seen = b""
            try:
                time.sleep(1.0)
                assert not done, "the O_TRUNC open did not wait for BACKING"
                w = threading.Thread(target=lambda: (buf.write(b"B" * blk), os.pwritev(
                    b, [memoryview(buf)[:blk]], 2 * blk)))
                w.start()
                time.sleep(1.0)         # (it waits for the truncate now)
            finally:
                sf.set(hang_truncate=0)
            t.join(30)
            w.join(30)
            assert done and not w.is_alive()
            n = os.preadv(b, [buf], 0)
            seen = bytes(buf[:n])
            os.fsync(b)
        finally:
            os.close(b)
        want = bytes(2 * blk) + b"B" * blk
        assert seen == want, (len(seen), seen[:2 * blk] == bytes(2 * blk))
        ctl_flush(m)
        assert (src / "f").read_bytes() == want
        m.stop()
