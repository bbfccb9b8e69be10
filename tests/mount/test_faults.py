"""BACKING failures seen through cachefs: a hung BACKING never wedges the mount, errors
reach the application as errors, and cached data stays correct."""

import errno
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

from tests.conftest import read_blocks, warm  # noqa: E402

pytestmark = pytest.mark.fuse


@pytest.fixture
def slow_backing(tmp_path):
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    (src / "hot").write_bytes(os.urandom(512 << 10))
    (src / "cold").write_bytes(os.urandom(512 << 10))
    with mounted_slowfs(src, slow, latency_ms=0.2, jitter_ms=0) as sf:
        yield src, slow, sf


def test_hung_backing_fails_misses_with_eio_and_keeps_serving_hits(make_mount, slow_backing):
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


def test_backing_read_errors_reach_the_reader(make_mount, slow_backing):
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
