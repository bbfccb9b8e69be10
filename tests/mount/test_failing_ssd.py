"""Issue 17, item 5: the SSD failing, not only full. The cache directory lives on slowfs (a
FUSE layer that injects EIO into chosen requests); while every read and write of the cache
files fails, clean data is served from BACKING, writes are acknowledged only once BACKING has
them (or fail), the mount stays up, and it recovers when the SSD does."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

from tests.conftest import read_blocks, wait_until, warm  # noqa: E402

# a cache on FUSE: no passthrough; the invariant checker reads the cache files (and would
# stop the daemon on the injected errors)
pytestmark = [pytest.mark.fuse, pytest.mark.no_passthrough, pytest.mark.damages_cache]

SIZE = 512 * 1024


def drop_page_cache() -> None:
    """The kernel would answer reads of the cache files itself: make them reach slowfs."""
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def whole(path) -> bytes:
    got = read_blocks(path, range(0, SIZE, 65536), 65536)
    return b"".join(got[o] for o in range(0, SIZE, 65536))


@pytest.fixture
def failing_ssd(tmp_path):
    src, ssd = tmp_path / "ssd-src", tmp_path / "ssd"
    src.mkdir()
    ssd.mkdir()
    with mounted_slowfs(src, ssd, latency_ms=0, jitter_ms=0, seq_latency_ms=0,
                        meta_latency_ms=0, bandwidth_mbs=0) as sf:
        yield ssd, sf


def test_an_ssd_failing_every_read_and_write(make_mount, mode, failing_ssd, tmp_path):
    ssd, sf = failing_ssd
    m = make_mount("--mode", mode, "--promote-after", "1", "--max-dirty-age", "600")
    m.stop()
    # The cache files on slowfs; the database stays local (SQLite's WAL needs shared
    # mappings, which slowfs does not offer).
    (ssd / "data").mkdir()
    (m.cache / "data").rmdir()
    (m.cache / "data").symlink_to(ssd / "data")
    data = bytearray(os.urandom(SIZE))
    (m.backing / "f").write_bytes(data)
    m.start()
    warm(m, "f", SIZE)
    assert m.stats()["extents_cached"] == SIZE // 65536
    sf.set(eio=1)
    drop_page_cache()
    before = m.stats()["cache_errors"]
    assert whole(m.path("f")) == bytes(data)                # clean data: from BACKING
    assert m.stats()["cache_errors"] > before
    new = os.urandom(8192)
    fd = os.open(m.path("f"), os.O_WRONLY)
    try:
        # Acknowledged only once stored safely: write-back cannot keep it on the SSD, so
        # BACKING takes it at once (the written bytes touch no dirty block).
        os.pwrite(fd, new, 65536 + 1000)
        data[65536 + 1000:65536 + 1000 + 8192] = new
        assert (m.backing / "f").read_bytes() == bytes(data)
    finally:
        os.close(fd)
    assert whole(m.path("f")) == bytes(data)
    assert m.stats()["dirty_bytes"] == 0                    # nothing rests on a failing SSD
    sf.set(eio=0)                                           # the SSD is back
    assert whole(m.path("f")) == bytes(data)
    warm(m, "f", SIZE)
    assert whole(m.path("f")) == bytes(data)
    m.stop(check=False)                                     # warnings logged, as they must be
    log = m.logs[-1].read_text()
    assert "Traceback" not in log
    assert "the cache directory failed" in log
    m.start()
    assert whole(m.path("f")) == bytes(data)


def test_the_database_on_a_failing_ssd_too(make_mount, mode, tmp_path):
    """The whole cache directory on the failing layer (slowfs with the page cache, which
    SQLite's WAL index needs): metadata commits fail and are retried, reads stay right,
    writes are acknowledged from BACKING, and once the SSD is back the state is saved and a
    remount serves the right bytes."""
    src, ssd = tmp_path / "ssd-src2", tmp_path / "ssd2"
    src.mkdir()
    ssd.mkdir()
    with mounted_slowfs(src, ssd, latency_ms=0, jitter_ms=0, seq_latency_ms=0,
                        meta_latency_ms=0, bandwidth_mbs=0, page_cache=1) as sf:
        m = make_mount("--mode", mode, "--promote-after", "1", "--max-dirty-age", "600")
        m.stop()
        m.cache = ssd / "cache"
        m.cache.mkdir()
        data = bytearray(os.urandom(SIZE))
        (m.backing / "f").write_bytes(data)
        m.start()
        try:
            warm(m, "f", SIZE)
            sf.set(eio=1)
            drop_page_cache()
            assert whole(m.path("f")) == bytes(data)
            fd = os.open(m.path("f"), os.O_WRONLY)
            try:
                os.pwrite(fd, b"x" * 8192, 4096)
            finally:
                os.close(fd)
            data[4096:4096 + 8192] = b"x" * 8192
            assert (m.backing / "f").read_bytes() == bytes(data)
            wait_until(lambda: m.stats()["metadata_errors"] > 0, 10, what="a failed commit")
            assert whole(m.path("f")) == bytes(data)
            sf.set(eio=0)
            m.stop(check=False)
            log = m.logs[-1].read_text()
            assert "Traceback" not in log and "committing cache metadata failed" in log
            m.start()
            assert whole(m.path("f")) == bytes(data)
        finally:
            m.stop(check=False)
