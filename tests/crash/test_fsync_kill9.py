"""Write-back: fsync, fdatasync, O_SYNC and O_DSYNC make written data durable at once.

Each test writes blocks BACKING does not have yet (the database has no record of them),
syncs, and kills the daemon with SIGKILL right after, within the same commit interval as
the write: nothing but the sync itself can have recorded the data. After the remount the
synced bytes must be there, while BACKING (read directly) still has the old ones. With a
sync that does not persist, the remount serves BACKING's old bytes and the test fails
(checked: with `Cache.fsync` returning without persisting, the fsync and fdatasync cases
fail; O_SYNC and O_DSYNC writes fail too once the engine's O_SYNC persist is also removed:
the kernel sends an FSYNC after each such write as well).
"""

import os

import pytest

from tests.conftest import wait_until

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

BLK = 4096
OLD = bytes([0x11]) * (64 * BLK)            # 256 KiB in BACKING before the mount


def _sync_after_commit(m) -> None:
    """Return right after the persister's commit (the next is a commit interval away), so
    that a write made now is recorded by nothing but its own sync before the kill."""
    base = m.stats()["metadata_commits"]
    with open(m.path("tick"), "ab") as f:
        f.write(os.urandom(BLK))
    wait_until(lambda: m.stats()["metadata_commits"] > base, 10, m.proc, "a commit")


@pytest.mark.parametrize("how", ["fsync", "fdatasync", "O_SYNC", "O_DSYNC"])
def test_synced_write_back_data_survives_kill9(make_mount, tmp_path, how):
    backing = tmp_path / "b"
    backing.mkdir()
    (backing / "f").write_bytes(OLD)
    m = make_mount("--mode", "write-back", "--max-dirty-age", "3600", "--dirty-high", "64M",
                   "--dirty-low", "32M", "--cache-size", "256M", backing=backing)
    new = {off: os.urandom(BLK * n) for off, n in ((8 * BLK, 1), (40 * BLK, 3),
                                                   (64 * BLK, 5))}   # the last one extends
    extra = os.O_SYNC if how == "O_SYNC" else os.O_DSYNC if how == "O_DSYNC" else 0
    _sync_after_commit(m)
    fd = os.open(m.path("f"), os.O_WRONLY | extra)
    try:
        for off, data in new.items():
            assert os.pwrite(fd, data, off) == len(data)
        if how == "fsync":
            os.fsync(fd)
        elif how == "fdatasync":
            os.fdatasync(fd)
        m.kill()                # before close(): a release must not be what persists
    finally:
        try:
            os.close(fd)
        except OSError:         # the daemon is gone
            pass
    want = bytearray(OLD)
    want.extend(bytes(69 * BLK - len(want)))
    for off, data in new.items():
        want[off:off + len(data)] = data
    assert (backing / "f").read_bytes() == OLD, "the data reached BACKING: nothing is proven"
    m.start()
    got = m.path("f").read_bytes()
    assert len(got) == len(want), f"size {len(got)} after {how} and kill -9, want {len(want)}"
    for off, data in new.items():
        assert got[off:off + len(data)] == data, f"{how}ed bytes at {off} lost by kill -9"
    assert got == bytes(want)
