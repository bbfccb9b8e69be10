"""A FUSE BACKING that numbers its files anew at every mount (sshfs without -o use_ino,
libfuse's high-level filesystems): after BACKING and cachefs were mounted again and the files
looked up in another order, cachefs served one file's cached bytes as another's, and
destaged one file's dirty data into another (a helper's hunt, 5 of 5). Its mount is told by
its unique mount id: clean data is dropped, and dirty data whose path no longer leads to its
number refuses the mount (or goes, with --discard-dirty)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest

from tests.conftest import CACHEFS, force_unmount, is_mounted, wait_until

pytestmark = pytest.mark.fuse

FS = os.path.join(os.path.dirname(__file__), "renumbering_fs.py")
SIZE = 100_000


@contextmanager
def renumbering(src, mnt, *first):
    """The filesystem mounted on `mnt`, with `first` looked up first (their numbers)."""
    proc = subprocess.Popen([sys.executable, FS, str(src), str(mnt)])
    try:
        wait_until(lambda: is_mounted(mnt), 20, proc, "the renumbering filesystem")
        for name in first:
            os.stat(mnt / name)
        yield
    finally:
        force_unmount(mnt)
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("dirty", [False, True], ids=["clean", "dirty"])
def test_a_backing_that_renumbers_its_files_serves_no_file_as_another(make_mount, tmp_path,
                                                                      dirty):
    src, bk = tmp_path / "src", tmp_path / "bk"
    src.mkdir()
    bk.mkdir()
    (src / "a").write_bytes(b"A" * SIZE)
    (src / "b").write_bytes(b"B" * SIZE)
    for name in ("a", "b"):                 # same size, same whole-second times
        os.utime(src / name, (1_767_268_800, 1_767_268_800))
    with renumbering(src, bk, "a", "b"):
        m = make_mount("--mode", "write-back", "--max-dirty-age", "600", backing=bk)
        assert m.path("a").read_bytes() == b"A" * SIZE
        assert m.path("b").read_bytes() == b"B" * SIZE
        if dirty:
            fd = os.open(m.path("a"), os.O_WRONLY)
            try:
                os.pwrite(fd, b"NEW-A-DATA", 0)
                os.fsync(fd)
            finally:
                os.close(fd)
        m.stop()
    with renumbering(src, bk, "b", "a"):     # b gets a's old number, a b's
        if not dirty:
            m.start()
            assert m.path("a").read_bytes() == b"A" * SIZE
            assert m.path("b").read_bytes() == b"B" * SIZE
            assert m.stats()["drops"]["recovery"] >= 2
            m.stop()
            return
        res = subprocess.run([*CACHEFS, "mount", "--cache-dir", str(m.cache), str(bk),
                              str(m.mnt)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2, res.stderr
        assert "number its files anew" in res.stderr and "a was inode 1001" in res.stderr, \
            res.stderr
        assert not is_mounted(m.mnt)
        m.args = ["--mode", "write-back", "--discard-dirty"]
        m.start()
        assert m.path("a").read_bytes() == b"A" * SIZE       # a's data is gone, not b's
        assert m.path("b").read_bytes() == b"B" * SIZE
        assert m.stats()["drops"]["orphan"] >= 1
        m.stop(check=False)
    assert (src / "b").read_bytes() == b"B" * SIZE           # never written into b
