"""The look for mappings of held files (/proc/*/maps) is bounded: opening a process's maps
waits for that process's exec lock, which a process stuck in a hung mount holds; an unmount
waited 19 minutes for such a look (a helper's hunt)."""

from __future__ import annotations

import threading
import time

import trio

from cachefs import openmode
from cachefs.openmode import MapsScanner


def test_a_stuck_look_counts_every_file_as_mapped_until_it_returns(monkeypatch):
    release = threading.Event()
    calls = []

    def fake(fuse_dev, inos):
        calls.append(set(inos))
        if len(calls) == 1:
            release.wait(30)                    # the first look is stuck
        return {7} & inos

    monkeypatch.setattr(openmode, "mapped_inodes", fake)

    async def main():
        scanner = MapsScanner(limit_s=0.2)
        t = time.monotonic()
        assert await scanner.scan((0, 50), {7, 8}) == {7, 8}       # unknown: mapped
        assert time.monotonic() - t < 5
        assert await scanner.scan((0, 50), {8, 9}) == {8, 9}       # none starts meanwhile
        assert len(calls) == 1
        release.set()
        await trio.sleep(0.2)
        assert await scanner.scan((0, 50), {7, 8}) == {7}          # looks again
        assert await scanner.scan((0, 50), {8}) == set()
        assert len(calls) == 3

    try:
        trio.run(main)
    finally:
        release.set()
