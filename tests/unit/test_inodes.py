"""InodeTable: paths of inodes from the names the kernel looked them up by."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from cachefs.inodes import ROOT_INODE, InodeTable


def _st(ino: int, is_dir: bool) -> os.stat_result:
    mode = (stat.S_IFDIR | 0o755) if is_dir else (stat.S_IFREG | 0o644)
    return os.stat_result((mode, ino, 1, 1, 0, 0, 0, 0, 0, 0))


def test_a_hard_link_is_reached_through_another_name_when_one_directory_is_forgotten():
    """A file with names d1/f and d2/g: the kernel prunes its caches and forgets d1 (the
    file stays, through d2/g). The file's path must come from d2/g: with the first name
    only, every open and xattr call of d2/g failed with ESTALE (found with tar --xattrs and
    hard links under memory pressure; reproduced with drop_caches)."""
    t = InodeTable(_st(2, True))
    t.remember(ROOT_INODE, b"d1", _st(10, True))
    t.remember(ROOT_INODE, b"d2", _st(11, True))
    t.remember(10, b"f", _st(20, False))
    t.remember(11, b"g", _st(20, False))
    assert t.path(20) == b"d1/f"
    t.forget(10, 1)
    assert t.path(20) == b"d2/g"
    assert t.parent_of(20) == 11
    t.remember(ROOT_INODE, b"d1", _st(10, True))      # looked up again: both names work
    assert t.path(20) in (b"d1/f", b"d2/g")
    t.forget(11, 1)
    assert t.path(20) == b"d1/f"


def test_no_name_left_is_estale():
    t = InodeTable(_st(2, True))
    t.remember(ROOT_INODE, b"d", _st(10, True))
    t.remember(10, b"f", _st(20, False))
    t.forget(10, 1)
    with pytest.raises(OSError) as exc:
        t.path(20)
    assert exc.value.errno == errno.ESTALE
    t.unlinked(10, b"f")
    with pytest.raises(OSError):
        t.path(20)
    assert t.path(ROOT_INODE) == b"."
    t.remember(ROOT_INODE, b"top", _st(30, False))
    assert t.path(30) == b"top"
