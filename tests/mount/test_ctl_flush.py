"""`cachefs-ctl flush` as an operator sees it: its progress bar and its last line."""

import os
import subprocess

import pytest

from tests.conftest import CTL

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
