"""`cachefs-ctl flush` as an operator sees it: its progress bar and its last line."""

import os
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

from tests.conftest import CTL, ctl_flush, wait_until  # noqa: E402

pytestmark = [pytest.mark.fuse]


def test_flush_progress_ends_at_100_percent(make_mount):
    # A long write-back delay: everything written is still dirty when the flush starts.
    m = make_mount("--mode", "write-back", "--cache-size", "64M", "--max-dirty-age", "600")
    with open(m.path("f"), "wb") as f:
        f.write(os.urandom(3 << 20))
    assert m.stats()["dirty_bytes"] > 0
    out = subprocess.run([*CTL, "flush", str(m.mnt), "--timeout", "60"], capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert "nothing is dirty" in out.stdout
    last = out.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert "100%" in last, out.stderr          # done: the bar says so, not 0 %
    assert m.stats()["dirty_bytes"] == 0


def test_a_flush_cut_short_by_an_unmount_says_so(make_mount, tmp_path):
    # BACKING at 1 MB/s: the flush of 4 MiB is still going when the mount goes away.
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    with mounted_slowfs(src, slow, latency_ms=1, jitter_ms=0, bandwidth_mbs=1):
        m = make_mount("--mode", "write-back", "--cache-size", "64M", "--dirty-high", "32M",
                       "--dirty-low", "16M", "--max-dirty-age", "600", backing=slow)
        data = os.urandom(4 << 20)
        with open(m.path("f"), "wb") as f:
            f.write(data)
        flush = subprocess.Popen([*CTL, "flush", str(m.mnt)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(flush.stderr), daemon=True)
        reader.start()
        try:
            # Its bar is up (it asked for stats, the flush request follows at once).
            wait_until(lambda: said, 30, m.proc, "the flush to start")
            time.sleep(0.5)
            assert m.stats()["dirty_bytes"] > 0
            m.stop()
            flush.wait(timeout=60)
            reader.join(10)
        finally:
            flush.kill()
            flush.wait()
        err = "".join(said)
        assert flush.returncode != 0
        assert "was unmounted during the flush" in err, err
        assert "Traceback" not in err
        m.start()                       # what was dirty is still there
        assert m.path("f").read_bytes() == data
        m.stop()                        # before slowfs goes (it waits while it is busy)


def test_the_passes_of_several_files_go_to_backing_at_once(make_mount, tmp_path):
    """Every destage pass ends with an fdatasync of its file on BACKING; with one pass at a
    time, many small files were destaged one BACKING round trip after another (51 files/s
    on the emulator, whose 8 service slots stood idle but one). Passes of different files
    now run side by side: BACKING sees several of their requests at once, and every file
    arrives whole."""
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    with mounted_slowfs(src, slow, latency_ms=40, jitter_ms=0, concurrency=8) as sfs:
        m = make_mount("--mode", "write-back", "--max-dirty-age", "600", backing=slow)
        files = {f"f{i}": os.urandom(4096 + i) for i in range(12)}
        for name, data in files.items():
            m.path(name).write_bytes(data)
        sfs.reset()
        ctl_flush(m)
        assert sfs.stats()["max_inflight"] >= 2, sfs.stats()
        for name, data in files.items():
            assert (src / name).read_bytes() == data
        m.stop()
