"""kill -9 after cachefs changed BACKING's bytes under clean cached blocks, before the commit
that invalidates them (write-back).

A punch or zero range of clean cached data goes to BACKING at once, and the blocks' new
state (not valid) is queued for the next commit. A kill -9 in between left the database
calling them valid and clean. After the remount the file's dirty data was destaged first,
and the destage took BACKING's identity (moved by the punch) as its own change: the old
bytes were served for good, `flush` did not fix them, a clean remount kept them, and they
turned to zeros when evicted, with no write by anyone (a helper's hunt: 3 of 3, with and
without passthrough; a file without dirty data was revalidated at its open, and was right).
Now the first destage of a file loaded after an unclean stop compares BACKING's file with
the identity last committed, and a difference drops its clean blocks (reason: recovery)."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from tests.conftest import ctl_flush, wait_until

pytestmark = [pytest.mark.fuse]

MiB = 1 << 20
PUNCH, ZERO = 0x01 | 0x02, 0x10          # FALLOC_FL_PUNCH_HOLE|KEEP_SIZE, FALLOC_FL_ZERO_RANGE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


@pytest.mark.parametrize("how", ["punch", "zero"])
def test_clean_blocks_under_an_uncommitted_punch_are_not_served_after_kill9(make_mount, how):
    m = make_mount("--mode", "write-back", "--cache-size", "64M", "--dirty-high", "48M",
                   "--dirty-low", "40M", "--max-dirty-age", "1h")
    old = os.urandom(MiB)
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, old, 0)
        os.fsync(fd)
        ctl_flush(m)                        # all clean, all cached
        os.pwrite(fd, b"D" * 4096, 0)       # and some dirty data, durable
        os.fsync(fd)
        wait_until(lambda: m.stats()["metadata_pending"] == 0, 10, m.proc, "the commit")
        if _libc.fallocate(fd, PUNCH if how == "punch" else ZERO, 512 << 10, 256 << 10):
            raise OSError(ctypes.get_errno(), "fallocate")
        m.kill()                            # before the commit that invalidates the blocks
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    want = b"D" * 4096 + old[4096:512 << 10] + bytes(256 << 10) + old[768 << 10:]
    assert (m.backing / "f").read_bytes()[512 << 10:768 << 10] == bytes(256 << 10)
    m.start()
    ctl_flush(m)
    assert m.path("f").read_bytes() == want
    assert (m.backing / "f").read_bytes() == want
    m.restart()
    assert m.path("f").read_bytes() == want


def test_a_block_written_after_an_uncommitted_extension_is_old_or_new_after_kill9(make_mount):
    """A write-back file extended by a truncate (BACKING extended at once) and then written
    over the block that held its old end, killed before the commit: the database still had
    the old size, the destage after the remount cut its run of that block at it, marked the
    block clean and took BACKING's size as its own: the block read later was the new bytes
    up to the old end and zeros after it, neither version (a helper's crash rounds, once
    in ~36). The file's size is BACKING's now before that destage, and the block is whole."""
    m = make_mount("--mode", "write-back", "--cache-size", "64M", "--dirty-high", "48M",
                   "--dirty-low", "40M", "--max-dirty-age", "1h")
    first, last = os.urandom(6827), os.urandom(14588)
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, first, 27155)                 # ends inside block 8, at 33982
        os.fsync(fd)
        wait_until(lambda: m.stats()["metadata_pending"] == 0, 10, m.proc, "the commit")
        os.ftruncate(fd, 65536)
        os.pwrite(fd, last, 24610)                  # covers block 8 [32768, 36864) whole
        m.kill()
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    m.start()
    ctl_flush(m)
    m.restart()
    client_drop(m)                                  # what BACKING holds, read again
    got = m.path("f").read_bytes()
    block = got[32768:36864]
    old = (first[32768 - 27155:] + bytes(36864 - 33982))
    new = last[32768 - 24610:36864 - 24610]
    assert block in (old, new), "block 8 is neither the old nor the new version"
    assert (m.backing / "f").read_bytes() == got


def client_drop(m) -> None:
    from cachefs_cli import client
    client.request(str(m.mnt), "drop", timeout_s=60)


def test_own_writes_before_a_crash_are_not_called_outside_changes(make_mount):
    """Write-through: cachefs's own writes moved BACKING's identity after the last commit,
    then kill -9. The next open found the file changed and dropped its clean data as
    "changed behind the cache (reason: coherence)", counted as a stale file: an operator
    looks for another writer of BACKING (a helper's hunt). It is recovery, as it is for
    files with dirty data; the data is read from BACKING again all the same."""
    m = make_mount("--mode", "write-through", "--promote-after", "1")
    data = bytearray(os.urandom(MiB))
    (m.backing / "f").write_bytes(data)
    assert m.path("f").read_bytes() == data                  # promoted
    wait_until(lambda: m.stats()["extents_cached"] >= 16, 15, m.proc, "the promotion")
    time.sleep(2.5)                         # committed with this identity
    fd = os.open(m.path("f"), os.O_WRONLY)
    try:
        os.pwrite(fd, b"n" * 4096, 8192)    # ours: moves BACKING's size/mtime/ctime
    finally:
        os.close(fd)
    data[8192:8192 + 4096] = b"n" * 4096
    m.kill()
    m.start()
    assert m.path("f").read_bytes() == data
    s = m.stats()
    log = m.logs[-1].read_text()
    assert s["drops"]["coherence"] == 0 and "changed behind the cache" not in log, log
    assert s["drops"]["recovery"] >= 1 and "before an unclean stop" in log, log
