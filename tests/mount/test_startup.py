"""A long start (here: destaging write-back data before a write-through mount, over a slow
BACKING) reports its progress to `cachefs mount`, survives the SIGHUP of a log rotation, and
stops with a sentence on SIGTERM or when the operator presses Ctrl-C; nothing is lost either
way. Before: a SIGHUP killed the daemon, a SIGTERM ended it without a word, a Ctrl-C left it
to mount with nobody to tell (a traceback, then an unmount), and a start longer than 120 s
was killed whatever its progress (a helper's operator hunt)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

from tests.conftest import (CACHEFS, force_unmount, is_mounted, wait_until,  # noqa: E402
                            write_synced)
from tests.mount.test_errors import _alive as alive  # noqa: E402
from tests.mount.test_errors import _lock_pid as lock_pid  # noqa: E402

pytestmark = pytest.mark.fuse

MiB = 1 << 20


@pytest.mark.parametrize("how", ["SIGHUP", "SIGTERM", "ctrl-c"])
def test_a_long_start_reports_progress_and_takes_signals(make_mount, tmp_path, how):
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    with mounted_slowfs(src, slow, latency_ms=0, jitter_ms=0, seq_latency_ms=0,
                        meta_latency_ms=0, bandwidth_mbs=1):
        m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--dirty-high",
                       "100M", "--cache-size", "256M", backing=slow)
        data = os.urandom(6 * MiB)
        write_synced(m.path("f"), data)
        m.stop()                                    # 6 MiB dirty: 6 s at 1 MB/s
        old = lock_pid(m.cache)
        cli = subprocess.Popen([*CACHEFS, "mount", "--cache-dir", str(m.cache),
                                "--cache-size", "256M", str(slow), str(m.mnt)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: lock_pid(m.cache) not in (None, old), 20,
                       what="the daemon's lock")
            pid = lock_pid(m.cache)
            time.sleep(1)                           # destaging, not mounted yet
            assert not is_mounted(m.mnt)
            if how == "ctrl-c":
                cli.send_signal(signal.SIGINT)
            else:
                os.kill(pid, getattr(signal, how))
            _, err = cli.communicate(timeout=120)
        finally:
            if cli.poll() is None:
                cli.kill()
                force_unmount(m.mnt)        # (the fixture unmounts m.mnt in the end too)
        if how == "SIGHUP":                         # logrotate's: the start goes on
            assert cli.returncode == 0, err
            assert "cachefs: still starting: destaging write-back data before mounting " \
                "in write-through mode: " in err and " left" in err, err
            assert is_mounted(m.mnt)
            subprocess.run([*CACHEFS, "umount", str(m.mnt)], check=True, timeout=60)
        else:
            assert cli.returncode == (130 if how == "ctrl-c" else 1), err
            assert ("interrupted: the daemon was stopped" if how == "ctrl-c" else
                    "stopped by SIGTERM before the mount was ready") in err, err
            assert "Traceback" not in err
            wait_until(lambda: not alive(pid), 30, what="the daemon to exit")
            assert not is_mounted(m.mnt)
        m.args = ["--mode", "write-back", "--cache-size", "256M"]
        m.start()
        assert m.path("f").read_bytes() == data
        if how == "SIGHUP":                         # the write-through start destaged it
            assert (src / "f").read_bytes() == data
        else:
            assert m.stats()["dirty_bytes"] > 0     # still to go: not lost, not flushed
        m.stop(check=False)
        log = (m.cache / "cachefs.log").read_text() + "".join(p.read_text() for p in m.logs)
        assert "Traceback" not in log, log[-3000:]
