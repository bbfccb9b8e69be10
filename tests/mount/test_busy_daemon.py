"""The daemon's own work goes on while the kernel keeps FUSE requests queued.

pyfuse3 (with deps/passthrough/pyfuse3-queued-requests.patch) takes a queued request without a
pass through trio's scheduler; a worker takes at most 16 in a row, then lets the other tasks
run. Cache hits and write-back writes to cached blocks never await, so under a deep queue of
them only that limit gives the control socket, the periodic commit and the destager a turn:
without it they would wait until the load stops.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from cachefs_cli import client

from ..conftest import wait_until

pytestmark = [pytest.mark.fuse,
              pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")]

MiB = 1 << 20
SIZE = 16 * MiB
LOAD_S = 8


@pytest.mark.no_passthrough         # every read must reach the daemon, as a hit
@pytest.mark.parametrize("rw,mode", [("randread", "write-through"),
                                     ("randwrite", "write-back")])
def test_the_daemon_answers_its_control_socket_under_a_queue_of_hits(make_mount, rw, mode):
    # Flow control stays out of it (a dirty high mark above the file): a held write sleeps,
    # and all 32 asleep at once between the two requests below left write_ops unchanged
    # (a CI run); the subject here is writes that never await.
    m = make_mount("--mode", mode, "--cache-size", "64M", "--dirty-high", "40M",
                   "--dirty-low", "32M")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    with open(m.path("f"), "rb") as f:          # one read caches it (the pool is filling)
        assert f.read() == data
    wait_until(lambda: client.request(str(m.mnt), "stats")["stats"]["extents_cached"]
               >= SIZE // (64 * 1024), 20, m.proc, "the file to be cached")
    fio = subprocess.Popen(
        ["fio", "--name=busy", f"--filename={m.path('f')}", f"--rw={rw}", "--bs=4k",
         f"--size={SIZE}", "--direct=1", "--ioengine=libaio", "--iodepth=32",
         f"--runtime={LOAD_S}", "--time_based", "--invalidate=0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.5)                         # the queue is full by now
        first = client.request(str(m.mnt), "stats")["stats"]
        t0 = time.monotonic()
        second = client.request(str(m.mnt), "stats")["stats"]
        waited = time.monotonic() - t0
        assert fio.poll() is None, "fio ended before the daemon was asked"
        # The control socket answered while the load went on, and the load did go on.
        assert waited < 2, f"a stats request took {waited:.1f} s under load"
        # Not second > first: the two requests come back to back, and fio, short of CPU
        # beside another test, may have nothing queued in that instant (5511 and 5511 in
        # one CI run). The load went on across them: on before the first, on after the second.
        key = "hit_ops" if rw == "randread" else "write_ops"
        assert first[key] > 0
        wait_until(lambda: client.request(str(m.mnt), "stats")["stats"][key] > second[key],
                   5, m.proc, "the load to go on after the requests")
    finally:
        out, _ = fio.communicate(timeout=LOAD_S + 60)
    assert fio.returncode == 0, out
    with open(m.path("f"), "rb") as f:
        after = f.read()
    if rw == "randread":
        assert after == data
    else:
        assert len(after) == SIZE


# A pyfuse3 file system whose reads keep the CPU 0.5 ms without awaiting (a slow synchronous
# handler), and a trio task that notes how late its 10 ms sleeps wake up.
_BUSY_FS = r'''
import errno, os, stat, sys, time
import pyfuse3, trio

class FS(pyfuse3.Operations):
    async def getattr(self, inode, ctx=None):
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        root = inode == pyfuse3.ROOT_INODE
        a.st_mode = (stat.S_IFDIR | 0o755) if root else (stat.S_IFREG | 0o644)
        a.st_size = 0 if root else 1 << 30
        a.st_nlink = 1
        return a

    async def lookup(self, parent_inode, name, ctx=None):
        if name != b"f":
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(2)

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=2, direct_io=True, keep_cache=False)

    async def read(self, fh, off, size):
        until = time.perf_counter() + 0.0005
        while time.perf_counter() < until:
            pass
        return bytes(size)

async def ticker(path):
    worst, last = 0.0, time.monotonic()
    while True:
        await trio.sleep(0.01)
        now = time.monotonic()
        worst, last = max(worst, now - last - 0.01), now
        with open(path + ".new", "w") as f:
            f.write(f"{worst}\n")
        os.replace(path + ".new", path)

async def run(path):
    async with trio.open_nursery() as n:
        n.start_soon(ticker, path)
        await pyfuse3.main()
        n.cancel_scope.cancel()

pyfuse3.init(FS(), sys.argv[1], ["fsname=busyfs"])
try:
    trio.run(run, sys.argv[2])
finally:
    pyfuse3.close()
'''


def test_a_worker_lets_other_tasks_run_while_requests_stay_queued(tmp_path):
    """Eight readers keep requests queued at a handler that never awaits: the daemon's other
    tasks still run every few milliseconds (16 requests of 0.5 ms), not once the load ends
    (an unbounded run of queued requests starved them for the whole load)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "busyfs.py"
    script.write_text(_BUSY_FS)
    late = tmp_path / "late"
    daemon = subprocess.Popen([sys.executable, str(script), str(mnt), str(late)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (mnt / "f").exists(), 15, daemon, "the mount")
        wait_until(late.exists, 15, daemon, "the ticker")
        stop = time.monotonic() + 3
        reads = []

        def reader(i: int) -> None:
            fd = os.open(mnt / "f", os.O_RDONLY)
            n = 0
            try:
                while time.monotonic() < stop:
                    os.pread(fd, 4096, (i * 1000 + n) * 4096)
                    n += 1
            finally:
                os.close(fd)
                reads.append(n)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.2)             # the ticker's first wake after the load notes its delay
        worst = float(late.read_text())
        assert sum(reads) > 1000, reads         # the load was there (0.5 ms a read)
        assert worst < 0.5, f"a 10 ms sleep woke {worst:.2f} s late under the load"
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
