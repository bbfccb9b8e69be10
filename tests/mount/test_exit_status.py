"""A user mistake that only the daemon can see (its database, its cache directory) exits
`cachefs mount` with status 2 in the background mode too, as in the foreground (README)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import CACHEFS, force_unmount, is_mounted

pytestmark = pytest.mark.fuse


@pytest.mark.parametrize("fg", [False, True], ids=["background", "foreground"])
def test_corrupt_database_exits_2(tmp_path, fg):
    backing, cache, mnt = tmp_path / "b", tmp_path / "c", tmp_path / "m"
    for d in (backing, cache, mnt):
        d.mkdir()
    (cache / "cachefs.db").write_bytes(b"this is not an SQLite database" * 100)
    try:
        res = subprocess.run([*CACHEFS, "mount", *(["-f"] if fg else []), "--cache-dir",
                              str(cache), str(backing), str(mnt)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2, (res.returncode, res.stderr)
        assert "Traceback" not in res.stderr
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("cachefs: the metadata database") and "corrupt" in last, last
        assert not is_mounted(mnt)
    finally:
        force_unmount(mnt)



def test_umount_waits_for_a_daemon_that_cannot_answer(make_mount):
    """A daemon that cannot answer `stats` (its control socket is gone here; through a mount
    whose BACKING hangs, the request times out the same way): `cachefs umount` still finds
    the daemon by its command line and waits for it to finish. It returned 0 at once, the
    daemon still persisting and holding the cache directory."""
    import os
    from cachefs.controlpath import CONTROL_XATTR
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600")
    for i in range(200):
        m.path(f"f{i}").write_bytes(os.urandom(20_000))
    os.unlink(os.getxattr(m.mnt, CONTROL_XATTR))
    out = subprocess.run([*CACHEFS, "umount", str(m.mnt)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert m.proc.poll() is not None, "umount returned before the daemon finished"
    assert m.proc.wait() == 0
    m.proc = None
