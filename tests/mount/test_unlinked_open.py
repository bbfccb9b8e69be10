"""Write-back data of a file that is unlinked while open stays readable through its open
descriptors until the last close, also when it was written before a remount (the destager
then has no descriptor of its own and BACKING no name for it)."""

import os

import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.fuse


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
