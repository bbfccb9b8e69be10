"""Write-back data of a file that is unlinked while open stays readable through its open
descriptors until the last close, also when it was written before a remount (the destager
then has no descriptor of its own and BACKING no name for it)."""

import os
import sys

import pytest

from tests.conftest import wait_until

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

pytestmark = pytest.mark.fuse
MiB = 1 << 20


def test_dirty_data_of_open_unlinked_file_survives_the_destager(make_mount):
    m = make_mount("--mode", "write-back", "--max-dirty-age", "3600", "--dirty-low", "32M",
                   "--dirty-high", "64M", "--cache-size", "256M")
    (m.backing / "f").write_bytes(bytes(256 * 1024))
    data = os.urandom(100_000)
    with open(m.path("f"), "r+b") as f:
        f.seek(5000)
        f.write(data)
    assert m.stats()["dirty_bytes"] > 0
    m.restart()                                  # dirty data now known only from the database
    m.stop()
    m.args += ["--max-dirty-age", "0.5"]         # destage soon after the next mount
    m.start()
    fd = os.open(m.path("f"), os.O_RDONLY)
    try:
        os.unlink(m.path("f"))
        # the destager tries this file (no name left), then again after its back-off
        wait_until(lambda: _tried(m), 20, what="a destage attempt")
        got = os.pread(fd, 100_000, 5000)
    finally:
        os.close(fd)
    assert got == data
    # the kernel sends RELEASE after close() returns: let the daemon close BACKING's file
    # before unmounting
    wait_until(lambda: not _holds_deleted(m.proc.pid), 10, what="the release")


def _holds_deleted(pid: int) -> bool:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").endswith("/f (deleted)"):
                return True
        except OSError:
            pass
    return False


def _tried(m) -> bool:
    """True once the destager has had its chance (the oldest dirty data passed its age)."""
    return m.stats()["oldest_dirty_age_s"] >= 1.0 or m.stats()["dirty_bytes"] == 0


def test_an_open_unlinked_file_is_destaged_over_a_fuse_backing(make_mount, tmp_path):
    """Over a BACKING that reaches files by name (a FUSE one: bench/slowfs), setting the
    times of a file with no name left fails with ESTALE. Each destage of an open, unlinked
    file failed at that step after its data: nothing turned clean, the pool filled with its
    dirty data, and its writer was held to a crawl by flow control (23 MiB in 33 s)."""
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    with mounted_slowfs(src, slow, attr_timeout_s=0.1):
        m = make_mount("--mode", "write-back", "--cache-size", "16M", "--dirty-high", "4M",
                       "--dirty-low", "2M", backing=slow)
        fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            data = os.urandom(12 * MiB)
            os.pwrite(fd, data[:MiB], 0)
            os.unlink(m.path("f"))
            for off in range(MiB, len(data), MiB):
                os.pwrite(fd, data[off:off + MiB], off)
            wait_until(lambda: m.stats()["dirty_bytes"] == 0 or m.stats()["destage_errors"],
                       30, what="the destage of the unlinked file")
            stats = m.stats()
            assert stats["destage_errors"] == 0, stats["last_destage_error"]
            assert stats["destaged_bytes"] >= len(data) - 4 * MiB
            assert b"".join(os.pread(fd, MiB, o) for o in range(0, len(data), MiB)) == data
        finally:
            os.close(fd)
        wait_until(lambda: not _holds_deleted(m.proc.pid), 10, what="the release")
        m.stop()
