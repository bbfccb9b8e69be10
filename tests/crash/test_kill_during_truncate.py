"""kill -9 of a write-back daemon while a shrinking truncate waits on BACKING.

The shrink is made durable (the new size, the dirty blocks past it gone) before BACKING is
cut. A daemon that died in between came back with neither state: a file fsynced at 4.4 MiB
and cut to 412 KiB came back 0 bytes (its BACKING had none of the data yet), or, with BACKING
holding older bytes past the cut, at its old length with those older bytes where fsynced ones
had been (a helper's hunt: 12 of 12 and 4 of 4). The next mount now completes the cut it finds
recorded: the file is the truncate's size, through the mount and in BACKING."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ctl_flush, force_unmount, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

SIZE, CUT = 4599188, 421888


@pytest.mark.parametrize("below", ["none", "data", "destaged"])
def test_a_kill_during_a_shrinks_backing_call_keeps_a_whole_state(make_mount, tmp_path, below):
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    with mounted_slowfs(src, slow, latency_ms=0, jitter_ms=0) as sf:
        m = make_mount("--mode", "write-back", "--attr-timeout", "0.2", "--cache-size", "64M",
                       "--dirty-high", "48M", "--dirty-low", "40M", "--max-dirty-age", "1h",
                       backing=slow)
        fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, b"\xb5" * (SIZE - 3066037), 3066037)     # sparse, all dirty
            if below == "destaged":
                os.fsync(fd)
                ctl_flush(m)                        # BACKING has the 0xb5 bytes
                os.pwrite(fd, b"\x2d" * 8192, 4035225)
            elif below == "data":
                os.pwrite(fd, b"\x33" * 300000, 0)
            os.fsync(fd)
            assert os.fstat(fd).st_size == SIZE
            sf.set(hang_truncate=1)             # only size changes wait: no other call
            t = threading.Thread(target=_truncate, args=(fd,), daemon=True)
            t.start()
            # Killed once BACKING's cut is under way (the shrink is recorded before it): a
            # fixed second was not always enough on a loaded machine, nor was any hung call
            # of BACKING's (with all of them held, another one, such as a revalidation, could
            # hang first): the old, whole state came back, the kill before the record.
            wait_until(lambda: sf.stats()["hung"] >= 1, 30, m.proc, "BACKING's cut")
            time.sleep(0.2)
            assert t.is_alive(), "the truncate did not wait for BACKING"
            m.proc.kill()
            time.sleep(0.2)
        finally:
            sf.set(hang_truncate=0)
        m.proc.wait(30)             # (its thread in BACKING's call ends once BACKING answers)
        m.proc = None
        t.join(10)
        try:
            os.close(fd)
        except OSError:
            pass
        force_unmount(m.mnt)
        m.start()
        ctl_flush(m)
        got = m.path("f").read_bytes()
        m.stop()
    want = bytearray(CUT)
    if below == "data":
        want[:300000] = b"\x33" * 300000
    assert len(got) == CUT, f"{len(got)} bytes through the mount, {CUT} expected"
    assert got == want
    assert (src / "f").read_bytes() == want, "BACKING"


def _truncate(fd: int) -> None:
    try:
        os.ftruncate(fd, CUT)
    except OSError:
        pass                        # the daemon died under it: not acknowledged
