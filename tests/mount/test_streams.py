"""Streams over cached data are served from the cache (issue 16, item 6): in write-through,
concurrent writes to different blocks of one extent keep those blocks valid, and a
sequential read that meets a few invalid blocks reads only their extents from BACKING
(and completes them), not the whole request and megabytes read ahead."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from tests.conftest import read_file_view

pytestmark = [pytest.mark.fuse,
              pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")]

MiB = 1 << 20
EXT = 64 * 1024


def fio_randwrite(path, size: int, ios: int, seed: int) -> None:
    """Concurrent 4 KiB random writes (libaio, direct, 16 in flight): the kernel sends them
    to the daemon at once, so many overlap in time within one extent."""
    out = subprocess.run(
        ["fio", "--name=w", f"--filename={path}", f"--size={size}", "--rw=randwrite",
         "--bs=4k", "--ioengine=libaio", "--direct=1", "--iodepth=16", f"--number_ios={ios}",
         f"--randseed={seed}", "--norandommap", "--randrepeat=0", "--output-format=terse"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def sequential_read(path) -> bytes:
    """1 MiB sequential reads with O_DIRECT (the kernel's page cache cannot answer)."""
    return read_file_view(path, direct=True)[1]


@pytest.mark.no_passthrough      # the daemon must see the stream: it is what is measured
def test_stream_after_concurrent_writes_reads_little_from_backing(make_mount):
    m = make_mount("--mode", "write-through", "--cache-size", "256M")
    size = 16 * MiB
    (m.backing / "f").write_bytes(os.urandom(size))
    assert sequential_read(m.path("f")) == (m.backing / "f").read_bytes()
    want = size // EXT
    for _ in range(100):
        if m.stats()["extents_cached"] >= want:
            break
        sequential_read(m.path("f"))
    assert m.stats()["extents_cached"] >= want
    fio_randwrite(m.path("f"), size, 3000, 7)
    s0 = m.stats()
    data = sequential_read(m.path("f"))
    s1 = m.stats()
    assert hashlib.sha256(data).digest() == hashlib.sha256(
        (m.backing / "f").read_bytes()).digest(), "the stream read other bytes than BACKING"
    from_backing = s1["backing_read_bytes"] - s0["backing_read_bytes"]
    assert from_backing < 0.05 * size, (
        f"{from_backing} bytes of a {size}-byte stream read from BACKING")
    # and what the stream met partly valid is complete again: a second stream is all hits
    s0 = m.stats()
    assert sequential_read(m.path("f")) == data
    assert m.stats()["backing_read_bytes"] == s0["backing_read_bytes"]


def test_concurrent_writes_to_one_block_stay_invalid_and_right(make_mount):
    """Writes to the same blocks in flight at once leave those blocks invalid (the order in
    BACKING is unknown), and what is read afterwards is BACKING's bytes."""
    m = make_mount("--mode", "write-through", "--cache-size", "64M")
    size = MiB
    (m.backing / "g").write_bytes(os.urandom(size))
    sequential_read(m.path("g"))
    sequential_read(m.path("g"))
    # 4 KiB writes over only 8 blocks, 16 in flight: nearly all overlap one another
    fio_randwrite(m.path("g"), 8 * 4096, 2000, 3)
    assert sequential_read(m.path("g")) == (m.backing / "g").read_bytes()
