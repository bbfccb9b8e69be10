"""The SQLite record: batches, drop-then-re-add, ownership and corruption errors."""

import os

import pytest

from cachefs.errors import UserError
from cachefs.store import MetadataStore


def _open(tmp_path, backing="/srv/a"):
    s = MetadataStore(str(tmp_path))
    s.open(backing, os.stat(tmp_path))
    return s


def test_batches_round_trip_and_drop_then_readd(tmp_path):
    s = _open(tmp_path)
    s.queue_file(10, 4096, 1, 2, b"a/f", 4096)
    s.queue_extent(10, 0, 0xFFFF, 0)
    s.queue_extent(10, 3, 0x1, 0)
    s.commit(s.take_batch(), durable=False)
    s.queue_drop_file(10)                 # identity changed ...
    s.queue_file(10, 8192, 5, 6, None, 9000)          # ... and new data cached in the same batch
    s.queue_extent(10, 1, 0x3, 0)
    s.commit(s.take_batch(), durable=True)
    s.close(clean=True)
    s = _open(tmp_path)
    files, extents = s.load()
    assert files == {10: (8192, 5, 6, None, 9000)}
    assert extents == [(10, 1, 0x3, 0)]


def test_clean_flag(tmp_path):
    s = MetadataStore(str(tmp_path))
    assert s.open("/srv/a", os.stat(tmp_path))            # new: nothing to recover
    s.close(clean=False)
    s = MetadataStore(str(tmp_path))
    assert not s.open("/srv/a", os.stat(tmp_path))
    s.close(clean=True)


def test_cache_dir_of_another_backing_is_refused(tmp_path):
    _open(tmp_path, "/srv/a").close(clean=True)
    with pytest.raises(UserError, match="belongs to BACKING /srv/a"):
        _open(tmp_path, "/srv/b")


def test_corrupt_database_is_a_sentence(tmp_path):
    (tmp_path / "cachefs.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(UserError, match="corrupt"):
        _open(tmp_path)
