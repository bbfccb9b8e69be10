"""BACKING failures seen through cachefs: a hung BACKING never wedges the mount, errors
reach the application as errors, and cached data stays correct."""

import errno
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

from cachefs_cli.main import _is_zombie  # noqa: E402  (what `cachefs umount` waits for)
from tests.conftest import (pread_aligned, read_blocks, unmount_when_released,  # noqa: E402
                            wait_until, warm)

pytestmark = pytest.mark.fuse


@pytest.fixture
def slow_backing(tmp_path):
    """slowfs over src. Tests name it before make_mount: set up first, it is torn down
    after the cachefs mounts on it (the other way round, its unmount found them there and
    waited 20 s for its daemon)."""
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    (src / "hot").write_bytes(os.urandom(512 << 10))
    (src / "cold").write_bytes(os.urandom(512 << 10))
    with mounted_slowfs(src, slow, latency_ms=0.2, jitter_ms=0) as sf:
        yield src, slow, sf


def test_hung_backing_fails_misses_with_eio_and_keeps_serving_hits(slow_backing, make_mount):
    src, slow, sf = slow_backing
    m = make_mount("--backing-timeout", "1.5", "--promote-after", "1", backing=slow)
    hot = (src / "hot").read_bytes()
    warm(m, "hot", len(hot), passes=1)
    fd = os.open(m.path("hot"), os.O_RDONLY | os.O_DIRECT)
    cold_fd = os.open(m.path("cold"), os.O_RDONLY | os.O_DIRECT)
    try:
        sf.set(hang=1)
        t0 = time.monotonic()
        assert os.pread(fd, 65536, 131072) == hot[131072:196608]     # a hit: no BACKING
        assert time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        with pytest.raises(OSError) as err:
            os.pread(cold_fd, 4096, 0)                               # a miss: BACKING hangs
        assert err.value.errno == errno.EIO
        assert 1.0 < time.monotonic() - t0 < 10
        sf.set(hang=0)
        assert os.pread(cold_fd, 4096, 8192) == (src / "cold").read_bytes()[8192:12288]
    finally:
        sf.set(hang=0)
        os.close(fd)
        os.close(cold_fd)
    m.stop()


def test_backing_read_errors_reach_the_reader(slow_backing, make_mount):
    src, slow, sf = slow_backing
    m = make_mount("--promote-after", "1", backing=slow)
    data = (src / "cold").read_bytes()
    fd = os.open(m.path("cold"), os.O_RDONLY | os.O_DIRECT)
    try:
        sf.set(eio=1)
        with pytest.raises(OSError) as err:
            os.pread(fd, 4096, 0)
        assert err.value.errno == errno.EIO
        sf.set(eio=0)
        got = read_blocks(m.path("cold"), range(0, len(data), 4096))
        assert b"".join(got[o] for o in sorted(got)) == data
    finally:
        sf.set(eio=0)
        os.close(fd)
    assert m.stats()["backing_errors"] >= 1
    m.stop()


def test_a_backing_error_in_a_partly_cached_read_is_not_counted_as_the_ssds(slow_backing,
                                                                            make_mount):
    """A read over cached and uncached extents whose BACKING part fails: EIO to the reader,
    counted as a BACKING error. It was counted as a cache (SSD) error and read from BACKING
    a second time."""
    from tests.conftest import wait_until
    src, slow, sf = slow_backing
    m = make_mount("--promote-after", "1", backing=slow)
    fd = os.open(m.path("hot"), os.O_RDONLY | os.O_DIRECT)
    try:
        pread_aligned(fd, 64 << 10, 0)
        wait_until(lambda: m.stats()["extents_cached"] >= 1, 10, what="a promotion")
        sf.set(eio=1)
        with pytest.raises(OSError) as err:
            pread_aligned(fd, 256 << 10, 0)
        assert err.value.errno == errno.EIO
    finally:
        sf.set(eio=0)
        os.close(fd)
    s = m.stats()
    assert s["backing_errors"] >= 1 and s["cache_errors"] == 0, (s["backing_errors"],
                                                                  s["cache_errors"])
    m.stop()


def _every_other_extent(fd: int, size: int) -> bytes:
    """Random bytes into every other 64 KiB extent of a `size`-byte file (zeros between):
    each a run of its own for the destager. Returns the file's bytes."""
    data = bytearray(size)
    for off in range(0, size, 128 << 10):
        data[off:off + (64 << 10)] = os.urandom(64 << 10)
        os.pwrite(fd, data[off:off + (64 << 10)], off)
    os.ftruncate(fd, size)
    return bytes(data)


def test_failed_destage_passes_are_not_taken_for_changes_behind_the_cache(slow_backing,
                                                                           make_mount):
    """A destage pass that fails part way leaves some of its writes in BACKING (its size and
    mtime move). The next open took that for another writer: a conflict warning and the
    file's clean cached extents dropped, with nobody else touching BACKING."""
    from tests.conftest import ctl_flush, wait_until
    src, slow, sf = slow_backing
    m = make_mount("--mode", "write-back", "--max-dirty-age", "0.2", "--dirty-high", "8M",
                   "--dirty-low", "4M", backing=slow)
    fd = os.open(m.path("w"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        sf.set(eio=0.3)
        data = _every_other_extent(fd, 4 << 20)       # 32 runs a pass
        wait_until(lambda: m.stats()["destage_errors"] >= 2, 30, what="failed destage passes")
        sf.set(eio=0)
        for _ in range(3):                  # opens revalidate against BACKING
            with open(m.path("w"), "rb") as f:
                assert f.read() == data
            time.sleep(0.3)
    finally:
        sf.set(eio=0)
        os.close(fd)
    ctl_flush(m)
    assert (src / "w").read_bytes() == data
    s = m.stats()
    assert s["conflicts"] == 0 and s["stale_files"] == 0, (s["conflicts"], s["stale_files"])
    m.stop()                                # before slowfs goes


def test_destaging_gets_through_a_backing_failing_a_few_per_cent_of_writes(slow_backing,
                                                                            make_mount):
    """A destage pass (up to 16 MiB, hundreds of BACKING writes) is all or nothing: with 5 %
    of BACKING's writes failing none got through (0 bytes in 5 minutes, writers held at the
    high mark). After a failure a file's passes shrink (down to one extent) and grow back as
    they succeed; a flush retries within a second."""
    from tests.conftest import ctl_flush
    src, slow, sf = slow_backing
    m = make_mount("--mode", "write-back", "--max-dirty-age", "0.2", "--dirty-high", "16M",
                   "--dirty-low", "8M", backing=slow)
    fd = os.open(m.path("w"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        sf.set(eio=0.05)
        data = _every_other_extent(fd, 16 << 20)      # 128 runs to write
        t0 = time.monotonic()
        ctl_flush(m, timeout_s=90)
        took = time.monotonic() - t0
    finally:
        sf.set(eio=0)
        os.close(fd)
    assert (src / "w").read_bytes() == data
    assert m.stats()["destage_errors"] >= 1, "no BACKING write failed: the test tests nothing"
    print(f"flush through 5 % failing writes took {took:.1f} s")
    m.stop()                                # before slowfs goes


def fsynced_file(m, name: str, size: int) -> bytes:
    """A new file of random bytes written and fsynced through mount `m` (write-back: dirty
    on the SSD, durable); returns its bytes."""
    data = os.urandom(size)
    fd = os.open(m.path(name), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return data


def test_an_unmount_does_not_wait_for_a_destage_stuck_in_a_hung_backing(slow_backing,
                                                                        make_mount):
    """Write-back: the destager is in a BACKING call when BACKING hangs, and the mount is
    unmounted. The daemon waited for that call (a dead server: for ever; `cachefs umount`
    with it). It now leaves it: the data stays dirty on the SSD and is destaged by the next
    mount. The thread left behind writes BACKING's file after the last commit (here once
    BACKING answers again): the next mount takes that change for its own. It reported a
    conflict, and dropped the file's clean data, after every unmount that cut a pass off
    (xfstests generic/464)."""
    src, slow, sf = slow_backing
    m = make_mount("--mode", "write-back", "--backing-timeout", "1.5", "--max-dirty-age", "1",
                   backing=slow)
    data = fsynced_file(m, "new", 256 << 10)
    sf.set(hang=1)
    try:
        time.sleep(2.5)                          # the destager's pass is in BACKING now
        assert m.stats()["dirty_bytes"] > 0
        unmount_when_released(m.mnt)        # (a `df` elsewhere waits for BACKING too)
        # Done as `cachefs umount` sees it: the daemon's main thread has exited. (A thread
        # in a call BACKING, itself a FUSE filesystem here, has taken cannot be killed:
        # the process goes when BACKING answers it.)
        wait_until(lambda: _is_zombie(m.proc.pid), 20, what="the daemon's exit")
        assert "metadata persisted" in m.logs[-1].read_text()
    finally:
        sf.set(hang=0)
    assert m.proc.wait(timeout=60) == 0
    m.proc = None
    # What the pass left behind writes once BACKING answers (here the process went first):
    (src / "new").write_bytes(data)
    m.start()
    assert m.path("new").read_bytes() == data
    s = m.stats()
    assert s["conflicts"] == 0 and s["drop_coherence"] == 0, s
    assert "conflict" not in m.logs[-1].read_text()
    m.stop()                                     # (the next mount destaged it meanwhile)
    m.start()
    from tests.conftest import ctl_flush
    ctl_flush(m)
    assert (src / "new").read_bytes() == data



def test_umount_flush_gives_up_on_a_hung_backing(slow_backing, make_mount):
    """`cachefs umount --flush` (the systemd unit's stop) with BACKING hung: a destage that
    neither fails nor ends was no error, so the flush waited for ever (a helper: still at
    0 % after 100 s). It gives up after 5 x --backing-timeout with a sentence; the data
    stays dirty on the SSD and the mount stays up."""
    src, slow, sf = slow_backing
    m = make_mount("--mode", "write-back", "--backing-timeout", "1.5", "--max-dirty-age", "600",
                   backing=slow)
    data = fsynced_file(m, "new", 256 << 10)
    sf.set(hang=1)
    try:
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "cachefs_cli.main", "umount", "--flush",
                              str(m.mnt)], capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert res.returncode != 0, res
        assert "took no destage write" in res.stderr and "Traceback" not in res.stderr, res
        assert took < 30, took
        assert m.stats()["dirty_bytes"] >= len(data)
    finally:
        sf.set(hang=0)
    from tests.conftest import ctl_flush
    ctl_flush(m)
    assert (src / "new").read_bytes() == data
