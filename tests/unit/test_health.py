"""BACKING health (cachefs/health.py) through `Backing`: which failures count, the failing
period and its log lines, timeouts. No FUSE: the calls are plain functions in threads."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest
import trio

from cachefs.backing import Backing
from cachefs.errors import BackingTimeout
from cachefs.health import BackingHealth, summary
from cachefs.stats import Stats


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fail(err: int):
    def call(*args):
        raise OSError(err, os.strerror(err))
    return call


def make(caplog, clock=None):
    caplog.set_level(logging.INFO, logger="cachefs.backing")
    stats = Stats()
    clock = clock or Clock()
    health = BackingHealth(stats, clock=clock, wall=lambda: 1.7e9 + clock.t)
    return Backing(2, 5.0, -1, health), stats, clock


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cachefs.backing"]


async def test_normal_answers_are_not_health_errors(caplog):
    backing, stats, _ = make(caplog)
    for err in (errno.ENOENT, errno.EEXIST, errno.EACCES, errno.ENOTEMPTY, errno.ENODATA,
                errno.EROFS, errno.EINVAL):
        with pytest.raises(OSError):
            await backing.read_call("stat", fail(err), b"x")
        with pytest.raises(OSError):
            await backing.write_call(fail(err), b"x")
    snap = backing.health.snapshot()
    assert snap["state"] == "ok" and snap["errors"] == {} and stats.backing_errors == 0
    assert lines(caplog) == []


async def test_a_burst_logs_once_then_recovery_once(caplog):
    backing, stats, clock = make(caplog)
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        for _ in range(20):
            with pytest.raises(OSError) as err:
                await backing.read_call("read", fail(errno.EIO), fd, 4096, 0)
            assert err.value.errno == errno.EIO             # the caller gets BACKING's errno
            clock.t += 0.5
        snap = backing.health.snapshot()
        assert snap["state"] == "failing" and snap["period_errors"] == 20
        assert snap["failing_for_s"] == 10.0 and snap["errors"] == {"EIO": 20}
        assert snap["by_op"] == {"read": {"EIO": 20}} and snap["last_error"] == "EIO on read"
        assert snap["last_error_on"] == "/dev/null"
        assert stats.backing_errors == 20
        assert lines(caplog) == ["BACKING error: read of /dev/null failed: EIO (Input/output "
                                 "error)"]
        assert summary(snap) == ("failing for 10 s: 20 errors, last: EIO on read of "
                                 "/dev/null")
        assert await backing.read_call("read", os.pread, fd, 10, 0) == b""
        await backing.read_call("read", os.pread, fd, 10, 0)
    finally:
        os.close(fd)
    assert lines(caplog)[1:] == ["BACKING recovered after 20 errors over 10.0 s (last: EIO "
                                 "on read)"]
    snap = backing.health.snapshot()
    assert snap["state"] == "ok" and snap["errors"] == {"EIO": 20}
    assert summary(snap).startswith("ok; 20 errors since mount (EIO 20), last 0 s ago")
    backing.health.flush()                      # 19 warnings were held back
    assert lines(caplog)[2:] == ["BACKING error: read of /dev/null failed: EIO (Input/output "
                                 "error) (and 19 similar lines suppressed)"]


async def test_a_failure_after_recovery_is_logged_at_once(caplog):
    backing, _, clock = make(caplog)

    full = [True]

    def pwrite_all(*args):                  # named as the real one: the op is "write"
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for _ in range(2):
        full[0] = True
        with pytest.raises(OSError):
            await backing.write_call(pwrite_all, -1, b"data", 0)
        clock.t += 1
        full[0] = False
        await backing.write_call(pwrite_all, -1, b"data", 0)
    assert lines(caplog) == [
        "BACKING full: write of BACKING failed: ENOSPC (No space left on device)",
        "BACKING recovered after 1 error over 1.0 s (last: ENOSPC on write)",
        "BACKING full: write of BACKING failed: ENOSPC (No space left on device)"]
    # the second recovery within the minute is held back, not lost
    backing.health.flush()
    assert lines(caplog)[3].startswith("BACKING recovered after 1 error over 1.0 s")


async def test_a_success_started_before_the_failure_does_not_end_it(caplog):
    backing, _, _ = make(caplog)
    release = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(backing.read_call, "stat", release.wait, 10)
        await trio.sleep(0.05)                              # in its thread now
        with pytest.raises(OSError):
            await backing.read_call("stat", fail(errno.ESTALE), b"x")
        release.set()
    assert backing.health.snapshot()["state"] == "failing"
    await backing.read_call("stat", lambda: None)
    assert backing.health.snapshot()["state"] == "ok"


async def test_a_timeout_counts_and_the_caller_gets_eio(caplog):
    backing, stats, _ = make(caplog)
    backing.timeout_s = 0.1
    release = threading.Event()
    try:
        with pytest.raises(BackingTimeout) as err:
            await backing.read_call("read", release.wait)
    finally:
        release.set()
    assert err.value.errno == errno.EIO
    snap = backing.health.snapshot()
    assert snap["state"] == "failing" and snap["timeouts"] == 1 and stats.backing_errors == 1
    assert snap["last_error"] == "timeout on read"
    assert lines(caplog) == ["BACKING timeout: read of BACKING did not finish within 0.1 s "
                             "(the caller gets EIO)"]


async def test_other_operations_working_do_not_end_a_failure_until_it_is_quiet(caplog):
    backing, _, clock = make(caplog)
    with pytest.raises(OSError):
        await backing.read_call("read", fail(errno.EIO), b"x")
    await backing.read_call("stat", lambda: None)       # stats work, reads fail
    snap = backing.health.snapshot()
    assert snap["state"] == "failing" and snap["failing_ops"] == ["read"]
    clock.t += 31                                       # no read error for QUIET_S
    await backing.read_call("stat", lambda: None)
    assert backing.health.snapshot()["state"] == "ok"
    assert lines(caplog)[-1] == "BACKING recovered after 1 error over 31.0 s (last: EIO on read)"


async def test_an_xattr_that_does_not_fit_is_not_a_full_backing(caplog, tmp_path, monkeypatch):
    """setxattr's ENOSPC is one attribute too large for the inode (ext4), not a full file
    system: the caller gets it, BACKING is not marked failing (which also paused the
    security.capability checks before writes), nothing is logged. A write's ENOSPC counts."""
    from cachefs import backingpaths as bp
    backing, stats, _ = make(caplog)
    (tmp_path / "f").write_bytes(b"x")
    root = bp.open_root(str(tmp_path))

    def no_room(*args, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "setxattr", no_room)
    try:
        with pytest.raises(OSError) as exc:
            await backing.write_call(bp.setxattr, root, b"f", None, b"user.big", b"v" * 65536)
        assert exc.value.errno == errno.ENOSPC
        assert backing.health.failing_since_s is None and stats.backing_errors == 0
        assert lines(caplog) == []
        with pytest.raises(OSError):
            await backing.write_call(fail(errno.ENOSPC), b"x")
        assert backing.health.failing_since_s is not None
    finally:
        os.close(root)
