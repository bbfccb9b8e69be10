"""Issue 17, item 7: bench/soak.py for two minutes (the long tier): fio --verify, the
random-operation tester, flush, drop, verify, remounts that change the mode and kill -9 in
write-back, checked after each step."""

import subprocess
import sys

import pytest

from tests.conftest import REPO, env_long, force_unmount

pytestmark = [pytest.mark.fuse, pytest.mark.slow]


@pytest.mark.skipif(not env_long(), reason="long tier: CACHEFS_LONG=1")
def test_soak_for_two_minutes(tmp_path):
    work = tmp_path / "soak"
    try:
        out = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--minutes", "2",
                              "--seed", "1", "--work", str(work)], cwd=REPO,
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "nothing lost, nothing garbage" in out.stdout
    finally:
        force_unmount(work / "mnt")
