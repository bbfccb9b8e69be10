"""Power cuts of BACKING in write-back: what an fsync acknowledged survives, also what
cachefs did to BACKING's file itself rather than through the cache.

Write-back puts writes on the SSD, and its fsync makes them durable there. But some changes
go to BACKING at once: a file's creation, a truncate, attributes, and writes that go around
the cache (no room: the pool is full of files read in passthrough or pinned; the SSD full
or failing). On an iSCSI volume or a local disk array (a filesystem of this host) they sit in
BACKING's page cache until BACKING's journal commits; a power cut of the host loses them.
An fsync that did not sync BACKING let a truncated file come back long, a file created and
fsynced vanish, and a write that went around the cache be lost.

Here BACKING is an ext4 of its own on a loop device, mounted with a long journal commit
interval so that nothing reaches its disk by itself during a test, and a cut is
EXT4_IOC_SHUTDOWN with NOLOGFLUSH (test_power_cut.py). The cache directory is not cut (its
own cuts are test_power_cut.py's)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.conftest import ctl_flush
from tests.crash.test_power_cut import Ssd
from tests.mount.test_passthrough import _available, held_file

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

KiB = 1024


class Disk(Ssd):
    """BACKING's disk: nothing reaches it unless something syncs (commit every 300 s)."""

    def mount(self) -> None:
        subprocess.run(["mount", "-t", "ext4", "-o", "commit=300", self.dev, str(self.path)],
                       check=True)


@pytest.fixture
def disk(tmp_path):
    d = Disk(tmp_path / "backing.img", tmp_path / "backing")
    try:
        yield d
    finally:
        d.remove()


def cut_and_remount(m, disk: Disk) -> None:
    """The host loses power: BACKING's unsynced changes are gone, the daemon dies; then
    both come back (the cache directory as kill -9 leaves it)."""
    m.proc.send_signal(signal.SIGSTOP)
    try:
        disk.cut()
    finally:
        m.kill()
    disk.power_on()
    m.start()


def wb_mount(make_mount, disk: Disk, *args: str):
    return make_mount("--mode", "write-back", "--max-dirty-age", "300", *args,
                      backing=disk.path)


def test_a_truncate_and_chmod_fsynced_survive(make_mount, disk):
    data = os.urandom(256 * KiB)
    (disk.path / "f").write_bytes(data)
    os.sync()
    m = wb_mount(make_mount, disk)
    fd = os.open(m.path("f"), os.O_RDWR)
    try:
        os.ftruncate(fd, 4 * KiB)
        os.fchmod(fd, 0o600)
        os.fsync(fd)
    finally:
        os.close(fd)
    cut_and_remount(m, disk)
    assert m.path("f").read_bytes() == data[:4 * KiB], "the fsynced truncate was lost"
    assert m.path("f").stat().st_mode & 0o777 == 0o600, "the fsynced chmod was lost"


def test_a_file_created_and_fsynced_survives(make_mount, disk):
    m = wb_mount(make_mount, disk)
    data = os.urandom(64 * KiB)
    fd = os.open(m.path("new"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    cut_and_remount(m, disk)
    assert m.path("new").exists(), "a file created and fsynced is gone"
    assert m.path("new").read_bytes() == data
    ctl_flush(m)
    assert (disk.path / "new").read_bytes() == data


def test_a_write_around_the_cache_fsynced_survives(make_mount, disk):
    reason = _available()
    if reason:
        pytest.skip(reason)
    old = os.urandom(256 * KiB)
    (disk.path / "f").write_bytes(old)
    os.sync()
    # a 1 MiB pool, all of it held by a file read in passthrough: no room for f's writes
    m = wb_mount(make_mount, disk, "--cache-size", "1M")
    _, holder = held_file(m, "h")
    try:
        os.sync()                                   # h is on BACKING's disk: only f is new
        new = os.urandom(4 * KiB)
        fd = os.open(m.path("f"), os.O_RDWR)
        try:
            os.pwrite(fd, new, 64 * KiB)
            os.fsync(fd)
        finally:
            os.close(fd)
        assert m.stats()["writes_around"] >= 1, "the write did not go around the cache"
        cut_and_remount(m, disk)
    finally:
        os.close(holder)
    want = old[:64 * KiB] + new + old[68 * KiB:]
    assert m.path("f").read_bytes() == want, "the fsynced write that went around was lost"
