"""The cache directory is private to the daemon's user: it holds BACKING's paths, sizes and
data. The directory (and every directory in it) is 0700, every file in it has no group or
other bits: the database and its -wal/-shm, data files, the log, doubt.log, lock and
control.sock, while mounted and after unmount, also when the directory existed with wider
modes before (docs/operations.md, "Permissions of the cache directory")."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import CACHEFS, force_unmount, is_mounted, wait_until

pytestmark = pytest.mark.fuse


def _modes(cache: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(os.lstat(cache).st_mode)}
    for root, dirs, files in os.walk(cache):
        for name in dirs + files:
            p = Path(root, name)
            out[str(p.relative_to(cache))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def assert_private(cache: Path) -> dict[str, int]:
    modes = _modes(cache)
    assert modes["."] == 0o700, oct(modes["."])
    public = {k: oct(v) for k, v in modes.items() if v & 0o077}
    assert not public, f"group/other bits on {public}"
    return modes


def _do_io(m) -> None:
    data = os.urandom(300_000)
    (m.backing / "old").write_bytes(data)
    assert m.path("old").read_bytes() == data              # --promote-after 1: cached
    with open(m.path("new"), "wb") as f:
        f.write(data[:100_000])
        f.flush()
        os.fsync(f.fileno())
    wait_until(lambda: any(Path(r, n).parent.parent.name == "data"
                           for r, _, fs in os.walk(m.cache) for n in fs), 15,
               m.proc, "a data file in the cache")
    with open(m.path("old"), "r+b") as f:               # write-back: journals the extent
        f.seek(4096)
        f.write(b"x" * 5000)
        os.fsync(f.fileno())
    assert m.path("old").read_bytes()[4096:9096] == b"x" * 5000


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_cache_dir_is_private(make_mount, mode, umask):
    old = os.umask(umask)                   # the daemon inherits it
    try:
        m = make_mount("--mode", mode, "--promote-after", "1", "--max-dirty-age", "60")
    finally:
        os.umask(old)
    _do_io(m)
    modes = assert_private(m.cache)
    names = set(modes)
    assert {"cachefs.db", "cachefs.db-wal", "lock", "control.sock", "data"} <= names, \
        sorted(names)
    if mode == "write-back":
        assert "doubt.log" in names or "doubt.log.prev" in names, sorted(names)
    assert any(k.startswith("data/") and modes[k] == 0o600 and stat.S_ISREG(
        os.lstat(m.cache / k).st_mode) for k in modes), modes
    m.stop()
    assert_private(m.cache)
    m.start()                               # a remount keeps it so
    assert m.path("new").read_bytes()[:10]
    assert_private(m.cache)


def test_existing_wide_cache_dir_becomes_private(make_mount, mode):
    m = make_mount("--mode", mode, "--promote-after", "1")
    _do_io(m)
    m.stop()
    for root, dirs, files in os.walk(m.cache):        # as an older cachefs left it
        for name in dirs:
            os.chmod(Path(root, name), 0o777)
        for name in files:
            os.chmod(Path(root, name), 0o644)
    os.chmod(m.cache, 0o755)
    (m.cache / "cachefs.db-wal").write_bytes(b"")      # a -wal of the old mode, too
    os.chmod(m.cache / "cachefs.db-wal", 0o644)
    m.start()
    assert_private(m.cache)
    assert m.path("new").read_bytes()[:10]
    m.stop()
    assert_private(m.cache)


def test_background_mount_log_is_private(tmp_path):
    backing, mnt, cache = tmp_path / "b", tmp_path / "m", tmp_path / "c"
    backing.mkdir()
    mnt.mkdir()
    cache.mkdir(mode=0o755)
    os.chmod(cache, 0o755)
    (cache / "cachefs.log").write_text("an old log\n")
    os.chmod(cache / "cachefs.log", 0o644)
    (backing / "f").write_bytes(b"hello")
    try:
        res = subprocess.run([*CACHEFS, "mount", "--cache-dir", str(cache), str(backing),
                              str(mnt)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert (mnt / "f").read_bytes() == b"hello"
        assert_private(cache)
        res = subprocess.run([*CACHEFS, "umount", str(mnt)], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        modes = assert_private(cache)
        assert modes["cachefs.log"] == 0o600
        assert "an old log" in (cache / "cachefs.log").read_text()
    finally:
        force_unmount(mnt)
        wait_until(lambda: not is_mounted(mnt), 10)
