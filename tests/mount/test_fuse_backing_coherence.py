"""Own writes over a BACKING that caches attributes (issue 9): with BACKING on a FUSE mount
(the bench/ emulator, attr_timeout 0.1 s), the kernel may answer cachefs's post-write
`fstat` from its attribute cache, i.e. with an mtime from before that write. Recorded as the
identity of cachefs's own change, the next open then took cachefs's own writes for a change
behind its back and dropped the whole file (flashsoft-70-30 write-through, bench/run.py)."""

import os
import shutil
import subprocess
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, BENCH)
from slowfs_client import mounted_slowfs  # noqa: E402

from tests.conftest import wait_until  # noqa: E402

pytestmark = [pytest.mark.fuse,
              pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")]
MiB = 1 << 20


def test_own_writes_over_fuse_backing_drop_nothing(make_mount, tmp_path):
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    size = 16 * MiB
    data = os.urandom(size)
    (src / "f").write_bytes(data)
    with mounted_slowfs(src, slow, attr_timeout_s=0.1):     # the emulator's defaults
        m = make_mount("--cache-size", "64M", backing=slow)
        assert m.path("f").read_bytes() == data               # one read warms it
        wait_until(lambda: m.stats()["extents_cached"] == size // 65536, 30, what="cached")
        # fio as in bench/run.py's flashsoft-70-30: 4 jobs x QD 4, 70 % reads, libaio, O_DIRECT
        env = {**os.environ, "FILENAME": str(m.path("f")), "SIZE": str(size), "RUNTIME": "3",
               "RAMP": "0"}
        out = subprocess.run(["fio", os.path.join(BENCH, "jobs", "flashsoft-70-30.fio"),
                              "--output-format=terse"], env=env, cwd=os.path.join(BENCH, "jobs"),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        before = m.stats()
        assert before["drops"]["coherence"] == 0
        # Not a wait for a condition: until the emulator's attr_timeout passes, the next
        # revalidation would read the same cached attributes and hide a lagging identity.
        time.sleep(0.3)
        assert m.path("f").read_bytes() == (src / "f").read_bytes()   # reopen: revalidates
        after = m.stats()
        assert after["drops"]["coherence"] == 0 and after["stale_files"] == 0
        m.stop()
