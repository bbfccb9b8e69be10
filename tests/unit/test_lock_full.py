"""The lock file of a cache directory is rewritten at every mount; on a full btrfs even
that needs new space (a helper's hunt: the mount failed with a traceback there, where ext4
mounted). The reserve file gives it, as it does for the database."""

import errno
import os

from cachefs import preflight


def test_the_lock_is_taken_on_a_full_cache_filesystem_by_giving_up_the_reserve(
        tmp_path, monkeypatch):
    (tmp_path / "reserve").write_bytes(bytes(4096))
    real = os.pwrite
    calls = []

    def pwrite_full_until_the_reserve_goes(fd, data, off):
        calls.append(off)
        if (tmp_path / "reserve").exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, off)

    monkeypatch.setattr(preflight.os, "pwrite", pwrite_full_until_the_reserve_goes)
    fd = preflight.lock_cache_dir(str(tmp_path), str(tmp_path))
    try:
        assert not (tmp_path / "reserve").exists() and len(calls) == 2
        assert (tmp_path / "lock").read_text().split("\n")[0] == str(os.getpid())
    finally:
        os.close(fd)
