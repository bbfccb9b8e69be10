"""A cache that gets warm fast and stays warm (issue 9): the default pool keeps what it holds
across a remount, one sequential read warms a file, no promotion is lost to a full queue, and
cachefs's own writes and metadata changes are never taken for someone else's."""

import mmap
import os
import random
import subprocess
import threading
import time

import pytest

from tests.conftest import CTL, wait_until, pread_aligned

pytestmark = pytest.mark.fuse

MiB = 1 << 20


def random_reads(path, size, count, rng):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for _ in range(count):
            off = rng.randrange(size // 4096) * 4096
            pread_aligned(fd, 4096, off)
    finally:
        os.close(fd)


def test_default_pool_keeps_every_extent_across_remount(make_mount, make_tmpfs):
    m = make_mount()                      # default --cache-size: keep the filesystem 10 % free
    m.stop()
    m.cache = make_tmpfs("48m") / "cache"     # the cache directory on a small filesystem
    data = os.urandom(30 * MiB)
    (m.backing / "f").write_bytes(data)
    m.start()
    assert m.path("f").read_bytes() == data              # one `cat` warms the file
    wait_until(lambda: m.stats()["extents_cached"] == 480, 30, what="480 extents cached")
    before = m.stats()
    m.restart()
    after = m.stats()
    assert after["extents_cached"] == before["extents_cached"] == 480
    assert after["cache_size"] >= before["cache_size"]
    assert after["drops"]["capacity"] == 0
    random_reads(m.path("f"), len(data), 200, random.Random(1))
    assert m.stats()["backing_read_ops"] == 0


@pytest.mark.no_passthrough     # counts the hits the daemon answers
def test_one_sequential_read_warms_random_reads(make_mount):
    m = make_mount()
    data = os.urandom(64 * MiB)
    (m.backing / "f").write_bytes(data)
    with open(m.path("f"), "rb") as f:
        while f.read(1 << 20):
            pass
    wait_until(lambda: m.stats()["extents_cached"] == 1024, 30, what="1024 extents cached")
    before = m.stats()
    assert before["promotions_dropped"] == 0          # a fast stream loses no promotion
    random_reads(m.path("f"), len(data), 500, random.Random(2))
    after = m.stats()
    assert after["backing_read_ops"] == before["backing_read_ops"]
    assert after["hit_ops"] - before["hit_ops"] == 500


def test_threshold_zero_keeps_admission(make_mount):
    """--promote-all-below 0: one read of an extent does not cache it (the old rule)."""
    m = make_mount("--promote-all-below", "0")
    (m.backing / "f").write_bytes(os.urandom(MiB))
    random_reads(m.path("f"), MiB, 1, random.Random(3))
    assert m.stats()["promotions"] == 0


def cached_file(m, data) -> None:
    """BACKING file `f` with `data`, read through the mount until every extent is cached
    (twice: cached with or without --promote-all-below)."""
    (m.backing / "f").write_bytes(data)
    for _ in range(2):
        assert m.path("f").read_bytes() == data
    wait_until(lambda: m.stats()["extents_cached"] == len(data) // 65536, 30, what="cached")


def _hammer(path, size, seconds, model, lock, seed):
    rng = random.Random(seed)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    mem = mmap.mmap(-1, 4096)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            off = rng.randrange(size // 4096) * 4096
            if rng.random() < 0.3:
                blk = os.urandom(4096)
                mem.seek(0)
                mem.write(blk)
                with lock:
                    os.pwrite(fd, mem, off)
                    model[off:off + 4096] = blk
            else:
                os.preadv(fd, [mem], off)
    finally:
        os.close(fd)
        mem.close()


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_own_writes_and_metadata_changes_are_not_outside_changes(make_mount, mode):
    m = make_mount("--mode", mode, "--attr-timeout", "0", "--sequential-cutoff", "0")
    size = 8 * MiB
    data = bytearray(os.urandom(size))
    cached_file(m, data)
    lock = threading.Lock()
    threads = [threading.Thread(target=_hammer, args=(m.path("f"), size, 3, data, lock, i))
               for i in range(4)]
    for t in threads:
        t.start()
    stat_until = time.monotonic() + 3
    while time.monotonic() < stat_until:           # revalidations while writes are in flight
        os.stat(m.path("f"))
    for t in threads:
        t.join()
    p = str(m.path("f"))
    os.setxattr(p, "user.k", b"v")
    os.removexattr(p, "user.k")
    os.chmod(p, 0o640)
    os.utime(p, ns=(10**18, 10**18))
    os.link(p, m.path("g"))
    os.unlink(m.path("g"))
    os.rename(p, m.path("h"))
    os.rename(m.path("h"), p)
    for _ in range(3):
        os.close(os.open(p, os.O_RDONLY))
        os.stat(p)
    before = m.stats()
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        mem = mmap.mmap(-1, 1 << 20)
        got = bytearray()
        for off in range(0, size, 1 << 20):
            n = os.preadv(fd, [mem], off)
            got += mem[:n]
    finally:
        os.close(fd)
    assert got == data
    after = m.stats()
    assert after["drops"]["coherence"] == 0 and after["stale_files"] == 0
    assert after["conflicts"] == 0
    assert after["backing_read_ops"] == before["backing_read_ops"]      # all SSD hits
    m.stop()
    log = m.logs[-1].read_text()
    assert "changed behind the cache" not in log and "conflict" not in log


def test_outside_change_after_own_writes_is_seen(make_mount, mode):
    m = make_mount("--mode", mode, "--attr-timeout", "0", "--sequential-cutoff", "0")
    size = 2 * MiB
    data = bytearray(os.urandom(size))
    cached_file(m, data)
    with open(m.path("f"), "r+b") as f:
        for off in range(0, size, 256 * 1024):
            f.seek(off)
            f.write(b"own" * 100)
            data[off:off + 300] = b"own" * 100
    if mode == "write-back":
        out = subprocess.run([*CTL, "flush", str(m.mnt)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    time.sleep(0.05)                            # a later mtime than our last write
    with open(m.backing / "f", "r+b") as f:     # someone else, same size
        f.seek(1000 * 1000)
        f.write(b"outside" * 10)
    data[1000 * 1000:1000 * 1000 + 70] = b"outside" * 10
    assert m.path("f").read_bytes() == data
    assert m.stats()["drops"]["coherence"] > 0


def test_write_only_append_in_write_back(make_mount):
    """O_WRONLY|O_APPEND on a file whose data is not cached: the partial last block needs
    BACKING's bytes (it failed with EBADF)."""
    m = make_mount("--mode", "write-back")
    old = os.urandom(10_000)
    (m.backing / "log").write_bytes(old)
    for flags in (os.O_WRONLY | os.O_APPEND, os.O_WRONLY):
        fd = os.open(m.path("log"), flags)
        try:
            if flags & os.O_APPEND:
                os.write(fd, b"appended line\n")
            else:
                os.pwrite(fd, b"XY", 5)
        finally:
            os.close(fd)
    want = bytearray(old + b"appended line\n")
    want[5:7] = b"XY"
    assert m.path("log").read_bytes() == want
    out = subprocess.run([*CTL, "flush", str(m.mnt)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    m.stop()
    assert (m.backing / "log").read_bytes() == want
