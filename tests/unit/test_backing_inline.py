"""Inline BACKING calls (a BACKING on a local filesystem) and trio's scheduler: a schedule
point at most every INLINE_YIELD_S, not after each call (a pass through the scheduler cost more
than the call), yet a loop of such calls never keeps the other tasks out for long."""

from __future__ import annotations

import os
import time

import trio

from cachefs import backing as bk


def test_a_loop_of_inline_calls_lets_other_tasks_run_every_few_milliseconds(tmp_path):
    b = bk.Backing(threads=2, timeout_s=5, inline=True)
    path = str(tmp_path)
    gaps: list[float] = []
    calls = [0]

    async def loop_of_calls(until: float) -> None:
        while time.monotonic() < until:
            await b.read_call("stat", os.stat, path)
            calls[0] += 1

    async def other(until: float) -> None:
        # The gaps in this thread's CPU time: a machine busy with other work may take the
        # CPU away for longer than the bound (seen under a load of 6 on 2 cores), which no
        # schedule point of ours can prevent.
        last = time.thread_time()
        while time.monotonic() < until:
            await trio.lowlevel.checkpoint()
            now = time.thread_time()
            gaps.append(now - last)
            last = now

    async def main() -> None:
        until = time.monotonic() + 0.3
        async with trio.open_nursery() as n:
            n.start_soon(loop_of_calls, until)
            n.start_soon(other, until)

    trio.run(main)
    assert calls[0] > 1000
    assert len(gaps) > 20, "the other task hardly ran while inline calls looped"
    assert max(gaps[1:]) < 0.05, f"the other task waited {max(gaps[1:]) * 1e3:.0f} ms"
    # Not a schedule point per call: the calls far outnumber the other task's turns.
    assert calls[0] > 5 * len(gaps), (calls[0], len(gaps))


def test_a_cancelled_loop_of_inline_calls_ends(tmp_path):
    """A deadline still ends a loop whose every await is an inline call."""
    b = bk.Backing(threads=2, timeout_s=5, inline=True)

    async def main() -> bool:
        with trio.move_on_after(0.05) as scope:
            while True:
                await b.read_call("stat", os.stat, str(tmp_path))
        return scope.cancelled_caught

    t0 = time.monotonic()
    assert trio.run(main)
    assert time.monotonic() - t0 < 2


def test_reads_of_cached_backing_bytes_run_inline_others_in_a_thread(tmp_path):
    """A small read of bytes in BACKING's page cache is served on the loop (preadv2
    RWF_NOWAIT: never a wait for the disk); bytes not cached, and reads on a BACKING that is
    not inline, go to a worker thread. Either way the bytes are BACKING's."""
    path = tmp_path / "f"
    data = os.urandom(4 << 20)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    threads = []

    async def read(b: bk.Backing, size: int, off: int) -> bytes:
        real = trio.to_thread.run_sync

        async def counting(fn, *args, **kw):
            threads.append(fn)
            return await real(fn, *args, **kw)
        trio.to_thread.run_sync = counting
        try:
            return await b.pread(fd, size, off)
        finally:
            trio.to_thread.run_sync = real

    try:
        assert bk.pread_cached(fd, 131072, 0) == data[:131072]
        assert bk.pread_cached(fd, 131072, len(data) - 1000) == data[-1000:]   # to the end
        assert bk.pread_cached(fd, 100, len(data) + 10) == b""                # past the end
        inline = bk.Backing(threads=2, timeout_s=5, inline=True)
        assert trio.run(read, inline, 4096, 8192) == data[8192:12288]
        assert trio.run(read, inline, 65536, len(data) - 65536) == data[-65536:]
        assert threads == []                                  # cached: on the loop
        assert trio.run(read, bk.Backing(threads=2, timeout_s=5), 4096, 0) == data[:4096]
        assert len(threads) == 1                              # not inline: always a thread
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if bk.pread_cached(fd, 4096, 0) is None:    # the pages went: a thread reads them
            threads.clear()
            assert trio.run(read, inline, 4096, 3 << 20) == data[3 << 20:(3 << 20) + 4096]
            assert len(threads) == 1
    finally:
        os.close(fd)
