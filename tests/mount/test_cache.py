"""The extent cache through a real mount: hits, warm restart, eviction, sequential bypass,
coherence with BACKING, drop. Proof comes from bytes and `cachefs-ctl stats --json`."""

import os
import random
import time

import pytest

from tests.conftest import ctl_flush, read_blocks, wait_until, warm, pread_aligned

pytestmark = pytest.mark.fuse

EXT = 64 * 1024


@pytest.mark.no_passthrough     # counts the hits the daemon answers
def test_second_read_comes_from_ssd_also_after_remount(make_mount):
    m = make_mount("--promote-after", "2")
    data = os.urandom(1 << 20)
    (m.backing / "hot").write_bytes(data)
    warm(m, "hot", len(data))
    for round_ in ("mounted", "remounted"):
        before = m.stats()
        offsets = list(range(0, len(data), 4096))
        random.shuffle(offsets)
        got = read_blocks(m.path("hot"), offsets)
        assert all(got[o] == data[o:o + 4096] for o in offsets), round_
        after = m.stats()
        assert after["backing_read_ops"] == before["backing_read_ops"], round_
        assert after["hit_ops"] - before["hit_ops"] == len(offsets), round_
        assert after["hit_ratio"] > 0
        m.restart()


def test_one_read_does_not_promote(make_mount):
    m = make_mount("--promote-after", "2", "--promote-all-below", "0")   # as when nearly full
    (m.backing / "once").write_bytes(os.urandom(1 << 20))
    read_blocks(m.path("once"), range(0, 1 << 20, 8192))
    time.sleep(0.3)
    s = m.stats()
    assert s["extents_cached"] == 0 and s["promotions"] == 0


@pytest.mark.parametrize("eviction", ["s3-fifo", "clock"])
def test_usage_never_exceeds_small_cache_size(make_mount, eviction):
    m = make_mount("--cache-size", "1M", "--promote-after", "1", "--eviction", eviction)
    files = {f"f{i}": os.urandom(1 << 20) for i in range(4)}
    for name, data in files.items():
        (m.backing / name).write_bytes(data)
    rng = random.Random(7)
    for _ in range(6):
        for name, data in files.items():
            offs = [rng.randrange(0, len(data) // 4096) * 4096 for _ in range(64)]
            got = read_blocks(m.path(name), offs)
            assert all(got[o] == data[o:o + 4096] for o in offs)
            s = m.stats()
            assert s["cache_used"] <= s["cache_size"] == 1 << 20
    s = m.stats()
    assert s["evictions"] > 0 and s["hit_ops"] > 0

    def ssd_bytes():
        return sum(os.stat(os.path.join(d, f)).st_blocks * 512
                   for d, _, fs in os.walk(m.cache / "data") for f in fs)
    # evicted extents give their space back (holes punched after the metadata commit)
    wait_until(lambda: ssd_bytes() <= (1 << 20) + 4 * EXT, 10, what="holes punched")


def test_sequential_stream_bypasses_cache(make_mount):
    m = make_mount("--sequential-cutoff", "1M", "--promote-after", "1",
                   "--promote-all-below", "0")          # as when the pool is nearly full
    data = os.urandom(8 << 20)
    (m.backing / "stream").write_bytes(data)
    for _ in range(2):
        fd = os.open(m.path("stream"), os.O_RDONLY | os.O_DIRECT)
        try:
            out = b"".join(pread_aligned(fd, 128 << 10, off)
                           for off in range(0, len(data), 128 << 10))
        finally:
            os.close(fd)
        assert out == data
    s = m.stats()
    assert s["bypass_bytes"] >= 2 * (len(data) - (2 << 20))
    assert s["extents_cached"] <= 24          # at most the head of the stream


def _rewrite_behind(m, name, data, keep_times=False):
    st = os.stat(m.backing / name)
    with open(m.backing / name, "r+b") as f:
        f.write(data)
    if keep_times:       # same size and mtime: only ctime tells
        os.utime(m.backing / name, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("keep_times", [False, True])
def test_change_behind_mount_is_seen(make_mount, keep_times):
    m = make_mount("--promote-after", "1", "--attr-timeout", "0.2")
    old, new = os.urandom(256 << 10), os.urandom(256 << 10)
    (m.backing / "f").write_bytes(old)
    warm(m, "f", len(old), passes=1)
    assert m.path("f").read_bytes() == old          # fills the kernel page cache too
    _rewrite_behind(m, "f", new, keep_times)
    time.sleep(0.4)                                 # past the attribute timeout
    os.stat(m.path("f"))                            # revalidation through getattr
    assert read_blocks(m.path("f"), [0, 4096, 200 << 10])[4096] == new[4096:8192]
    assert m.path("f").read_bytes() == new          # page cache was invalidated as well
    assert m.stats()["stale_files"] >= 1


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_change_behind_the_mount_is_read_at_the_next_open(make_mount, mode):
    """A file rewritten on BACKING with its size and mtime put back (only the ctime tells):
    the lookup before the next open saw the change and queued the kernel's invalidation,
    but the open then let the kernel keep its pages, and the first read returned the old
    bytes (9 files of 10 here). The open now drops them itself."""
    m = make_mount("--mode", mode, "--no-passthrough", "--attr-timeout", "0.3",
                   "--max-dirty-age", "0.2")
    names = [f"f{i}" for i in range(10)]
    for n in names:
        m.path(n).write_bytes(b"a" * 100_000)
    if mode == "write-back":
        ctl_flush(m)
    for n in names:
        for _ in range(2):
            m.path(n).read_bytes()                  # cached, and in the kernel's page cache
    for n in names:
        _rewrite_behind(m, n, b"NEW!", keep_times=True)
    time.sleep(0.6)                                 # past the attribute timeout
    stale = [n for n in names if m.path(n).read_bytes()[:4] != b"NEW!"]
    assert not stale, f"{len(stale)} of {len(names)} files read stale after a fresh open"


def test_change_while_unmounted_is_seen(make_mount):
    m = make_mount("--promote-after", "1")
    old, new = os.urandom(256 << 10), os.urandom(256 << 10)
    (m.backing / "f").write_bytes(old)
    warm(m, "f", len(old), passes=1)
    m.stop()
    _rewrite_behind(m, "f", new, keep_times=True)
    m.start()
    got = read_blocks(m.path("f"), range(0, len(new), 4096))
    assert b"".join(got[o] for o in sorted(got)) == new
    assert m.stats()["stale_files"] == 1


def test_write_through_updates_cached_extents(make_mount):
    m = make_mount("--promote-after", "1")
    data = bytearray(os.urandom(512 << 10))
    (m.backing / "f").write_bytes(data)
    warm(m, "f", len(data), passes=1)
    fd = os.open(m.path("f"), os.O_RDWR | os.O_DIRECT)
    try:
        for off, size in ((0, 4096), (5000, 3000), (EXT - 100, 200), (300 << 10, 70 << 10)):
            chunk = os.urandom(size)
            assert os.pwrite(fd, chunk, off) == size
            data[off:off + size] = chunk
        before = m.stats()
        got = b"".join(os.pread(fd, 4096, off) for off in range(0, len(data), 4096))
    finally:
        os.close(fd)
    assert got == bytes(data) and (m.backing / "f").read_bytes() == bytes(data)
    after = m.stats()
    assert after["hit_ops"] - before["hit_ops"] >= 120      # cached extents stayed valid


def test_drop_makes_cache_cold(make_mount):
    import subprocess
    from tests.conftest import CTL
    m = make_mount("--promote-after", "1")
    data = os.urandom(512 << 10)
    (m.backing / "f").write_bytes(data)
    warm(m, "f", len(data), passes=1)
    out = subprocess.run([*CTL, "drop", str(m.mnt)], capture_output=True, text=True)
    assert out.returncode == 0 and "dropped 8 clean extents" in out.stdout, out
    s = m.stats()
    assert s["extents_cached"] == 0 and s["cache_used"] == 0
    got = read_blocks(m.path("f"), range(0, len(data), 4096))
    assert b"".join(got[o] for o in sorted(got)) == data
    assert m.stats()["backing_read_ops"] > s["backing_read_ops"]


def test_shrink_then_grow_reads_zeros_to_the_end(mounted, mode):
    """Regression: in write-back the cache file stayed at the shrunk size, and a hit on the
    block holding the old end returned a short read instead of zeros."""
    m = mounted
    data = os.urandom(64 << 10)
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, 60000)
        os.ftruncate(fd, 64 << 10)
        got = os.pread(fd, 8192, 57344)
    finally:
        os.close(fd)
    assert got == data[57344:60000] + bytes((64 << 10) - 60000)


def test_sequential_stream_sees_dirty_write_back_blocks(make_mount):
    """A stream past --sequential-cutoff reads BACKING directly; in write-back mode the dirty
    blocks (newer than BACKING) must still be laid over what it reads, also past BACKING's
    end."""
    m = make_mount("--mode", "write-back", "--sequential-cutoff", "1M",
                   "--max-dirty-age", "3600", "--dirty-low", "64M", "--dirty-high", "128M")
    data = bytearray(os.urandom(8 << 20))
    (m.backing / "f").write_bytes(data)
    fd = os.open(m.path("f"), os.O_RDWR)
    try:
        for off in (3 << 20, (5 << 20) + 4096, (7 << 20) + 100, 8 << 20):   # dirty, uncached
            patch = os.urandom(4096)
            os.pwrite(fd, patch, off)
            data[off:off + len(patch)] = patch
    finally:
        os.close(fd)
    assert m.stats()["dirty_bytes"] > 0
    fd = os.open(m.path("f"), os.O_RDONLY | os.O_DIRECT)
    try:
        out = b"".join(pread_aligned(fd, 128 << 10, off) for off in range(0, len(data), 128 << 10))
    finally:
        os.close(fd)
    assert m.stats()["bypass_bytes"] > 0                   # the stream did bypass the cache
    assert len(out) == len(data) and out == bytes(data)


def test_stream_read_ahead_never_serves_overwritten_bytes(make_mount, mode):
    """A stream reads ahead of the application; a write through the mount into the range
    already read ahead must be seen by the stream's next reads."""
    m = make_mount("--mode", mode, "--sequential-cutoff", "1M", "--promote-after", "100")
    chunk = 128 << 10
    data = bytearray(os.urandom(8 << 20))
    (m.backing / "f").write_bytes(data)
    rfd = os.open(m.path("f"), os.O_RDONLY | os.O_DIRECT)
    wfd = os.open(m.path("f"), os.O_WRONLY)
    try:
        out = bytearray()
        for off in range(0, len(data), chunk):
            out += os.pread(rfd, chunk, off)
            if off in (2 << 20, 5 << 20):      # the next two chunks are being read ahead
                for hit in (off + chunk, off + 2 * chunk + 4096):
                    patch = os.urandom(8192)
                    os.pwrite(wfd, patch, hit)
                    data[hit:hit + len(patch)] = patch
    finally:
        os.close(rfd)
        os.close(wfd)
    s = m.stats()
    assert s["bypass_bytes"] >= 4 << 20                    # the stream did bypass the cache
    assert out == data
