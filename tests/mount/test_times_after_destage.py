"""Issue 17, item 8: in write-back, times set explicitly before the destage (tar x, rsync -t,
cp -p, touch -d) are what BACKING holds after it, not the destage time."""

import os
import shutil
import subprocess
import time

import pytest

from tests.conftest import ctl_flush

pytestmark = pytest.mark.fuse


def make_source(root) -> dict[str, int]:
    """A small tree with old mtimes; name -> mtime_ns."""
    times = {}
    for i in range(12):
        p = root / "d" / f"f{i}"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(os.urandom(1000 + 7000 * i))
        t = 1_500_000_000_000_000_000 + i * 86_400 * 10**9     # 2017, a day apart
        os.utime(p, ns=(t, t))
        times[f"d/f{i}"] = t
    return times


def mtimes(root, names) -> dict[str, int]:
    return {n: os.stat(root / n).st_mtime_ns for n in names}


@pytest.mark.parametrize("tool", ["tar", "rsync", "cp"])
def test_explicit_mtimes_survive_the_destage(make_mount, tmp_path, tool):
    if tool == "rsync" and shutil.which("rsync") is None:
        pytest.skip("rsync is not installed (make install installs it)")
    src = tmp_path / "src"
    src.mkdir()
    want = make_source(src)
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M")
    if tool == "tar":
        subprocess.run(["tar", "cf", str(tmp_path / "t.tar"), "-C", str(src), "d"], check=True)
        subprocess.run(["tar", "xf", str(tmp_path / "t.tar"), "-C", str(m.mnt)], check=True)
    elif tool == "rsync":
        subprocess.run(["rsync", "-a", f"{src}/d", str(m.mnt)], check=True)
    else:
        subprocess.run(["cp", "-pr", str(src / "d"), str(m.mnt)], check=True)
    assert m.stats()["dirty_bytes"] > 0                 # the data is not in BACKING yet
    assert mtimes(m.mnt, want) == want                  # the mount shows the source's times
    time.sleep(0.05)
    ctl_flush(m)
    assert mtimes(m.backing, want) == want              # and so does BACKING after the destage
    for n in want:
        assert (m.backing / n).read_bytes() == (src / n).read_bytes()
    m.restart()
    assert mtimes(m.mnt, want) == want


def test_a_write_after_the_times_wins_and_times_survive_a_remount(make_mount):
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M")
    old = 1_400_000_000_000_000_000
    for name in ("a", "b"):
        with open(m.path(name), "wb") as f:
            f.write(os.urandom(50_000))
        os.utime(m.path(name), ns=(old, old))
    with open(m.path("b"), "r+b") as f:                 # written again after its times
        f.write(b"new")
    m.restart()                                         # dirty data and times kept
    assert m.stats()["dirty_bytes"] > 0
    before = time.time_ns()
    ctl_flush(m)
    assert os.stat(m.backing / "a").st_mtime_ns == old
    assert os.stat(m.backing / "b").st_mtime_ns >= before - 5 * 10**9
