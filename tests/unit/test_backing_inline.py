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
        last = time.monotonic()
        while time.monotonic() < until:
            await trio.lowlevel.checkpoint()
            now = time.monotonic()
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
