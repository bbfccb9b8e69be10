"""The daemon's descriptor budget: opens are refused with ENFILE before the handles take the
descriptors the daemon needs for its own work (destaging, commits, cache files), so that no
acknowledged write, fsync or unlink fails because the daemon ran out of them."""

from __future__ import annotations

import errno
import os

import pytest

from tests.conftest import ctl_flush

pytestmark = pytest.mark.fuse

LIMIT = 700             # the daemon's RLIMIT_NOFILE: a budget of 444 descriptors for handles


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_opens_fail_with_enfile_before_the_daemon_runs_out_of_descriptors(make_mount, mode):
    """A write-back handle of a file of its own takes three descriptors (BACKING's, the cache
    file's, the destager's); the guard counted two, so 1,800 such opens under a limit of
    4,096 ran the daemon out: fsync failed with EIO on every file, unlinks and writes too,
    destages and commits with EMFILE (a helper's differential hunt, 4 of 4 runs)."""
    m = make_mount("--mode", mode, "--cache-size", "64M",
                   wrap=["prlimit", f"--nofile={LIMIT}:{LIMIT}", "--"])
    fds, refused = [], 0
    try:
        for i in range(LIMIT):
            try:
                fd = os.open(m.path(f"f{i:04d}"), os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                assert exc.errno == errno.ENFILE, exc
                refused += 1
                if refused >= 5:
                    break
                continue
            fds.append((i, fd))
            assert os.write(fd, bytes([i % 251]) * 5000) == 5000
        assert refused and len(fds) > 50, (len(fds), refused)
        for i, fd in fds:
            assert os.pwrite(fd, b"z" * 100, 1000) == 100
            os.fsync(fd)
            if i % 3 == 0:
                os.unlink(m.path(f"f{i:04d}"))
    finally:
        for _, fd in fds:
            os.close(fd)
    if mode == "write-back":
        ctl_flush(m)
    for i, _ in fds:
        if i % 3:
            want = bytes([i % 251]) * 1000 + b"z" * 100 + bytes([i % 251]) * 3900
            assert (m.backing / f"f{i:04d}").read_bytes() == want, i
        else:
            assert not (m.backing / f"f{i:04d}").exists(), i
    log = m.logs[-1].read_text()
    assert "Too many open files" not in log, log[-3000:]


def test_unlinking_many_open_files_takes_no_descriptor_each(make_mount):
    """A removed name's node is held open until the kernel forgets it (so BACKING cannot
    give its number to a new file); while handles of it are open they hold it, and the
    holder is made from the last one at its release. A holder per unlinked open file, on
    top of the handles, ran the daemon out of descriptors: unlinks and fsyncs failed with
    EIO (a re-verifying helper: 2,152 of 2,500 unlinks)."""
    limit = 1400
    m = make_mount("--mode", "write-back", "--cache-size", "64M",
                   wrap=["prlimit", f"--nofile={limit}:{limit}", "--"])
    fds = []
    try:
        for i in range(limit):
            try:
                fd = os.open(m.path(f"f{i:04d}"), os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                assert exc.errno == errno.ENFILE, exc
                break
            fds.append(fd)
            os.write(fd, b"x" * 5000)
        assert len(fds) > 256                   # more than the daemon's reserve
        for i in range(len(fds)):
            os.unlink(m.path(f"f{i:04d}"))
        for fd in fds:
            assert os.pwrite(fd, b"y" * 100, 100) == 100
            os.fsync(fd)
            assert os.pread(fd, 200, 0) == b"x" * 100 + b"y" * 100
    finally:
        for fd in fds:
            os.close(fd)
    assert "Too many open files" not in m.logs[-1].read_text()
    assert os.listdir(m.backing) == []


def test_a_tiny_descriptor_limit_is_said_at_mount_and_never_fails_an_fsync(make_mount):
    """`ulimit -n 64` (a unit's small LimitNOFILE=): the handles' budget had a floor of 64,
    above the limit itself, so opens took every descriptor and a write-back write failed
    with EIO, the SSD and the commit out of descriptors; nothing at mount said the limit was
    tiny (a helper's hunt, 3 of 3). The budget is a share of the limit now, and the mount
    warns."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600",
                   wrap=["prlimit", "--nofile=64:64", "--"])
    for i in range(200):
        (m.backing / f"f{i:03d}").write_bytes(b"old")
    fds, refused = [], 0
    try:
        for i in range(200):
            try:
                fds.append(os.open(m.path(f"f{i:03d}"), os.O_RDWR))
            except OSError as exc:
                assert exc.errno == errno.ENFILE, exc
                refused += 1
        assert fds and refused, (len(fds), refused)
        for fd in fds:
            os.pwrite(fd, b"X", 0)                  # never EIO for want of descriptors
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    ctl_flush(m)
    m.stop()
    assert "may open only 64 descriptors" in m.logs[-1].read_text()
