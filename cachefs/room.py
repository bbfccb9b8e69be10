"""Room on the cache filesystem: what "full" means, and the reserve file that lets the
metadata database be written when it is.

The reserve is a file of RESERVE_BYTES kept in the cache directory: when the cache
filesystem fills up it is deleted, so that the commits that keep the cache's promises still
fit (the commit that forgets evicted extents, whose holes then release their space; the
in-use mark at mount; a clean close); it is made again once space was released.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3

log = logging.getLogger("cachefs")

RESERVE_BYTES = 8 << 20
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
MIN_FREE_TO_OPEN = 1 << 20      # less free than this: a failed open is taken for no room
MIN_FREE_FRACTION = 0.10        # what the default pool size leaves free, and held files too


def is_full(exc: Exception) -> bool:
    """An error that means the cache filesystem is out of space."""
    if isinstance(exc, OSError):
        return exc.errno in NO_SPACE
    return isinstance(exc, sqlite3.OperationalError) and "full" in str(exc)


def ensure_reserve(cache_dir: str) -> bool:
    """Make the reserve file if the filesystem has room to spare; True if it exists."""
    path = os.path.join(cache_dir, "reserve")
    try:
        if os.path.getsize(path) >= RESERVE_BYTES:
            return True
    except FileNotFoundError:
        pass
    try:
        sv = os.statvfs(cache_dir)
        if sv.f_bavail * sv.f_frsize < 2 * RESERVE_BYTES:
            return False
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
        return True
    except OSError:                 # no room for it now: try again after the next punch
        os.unlink(path)
        return False
    finally:
        os.close(fd)


def release_reserve(cache_dir: str) -> bool:
    """Delete the reserve file; True if there was one (its space is free now)."""
    try:
        os.unlink(os.path.join(cache_dir, "reserve"))
        return True
    except FileNotFoundError:
        return False


def with_room(cache_dir: str, write):
    """write(); if the cache filesystem is full, release the reserve and try once more."""
    try:
        return write()
    except (OSError, sqlite3.OperationalError) as exc:
        if not is_full(exc) or not release_reserve(cache_dir):
            raise
        log.warning("the cache filesystem is full: the reserve file was released so that "
                    "the metadata database can be written (%s)", exc)
        return write()


def free_bytes(cache_dir: str) -> int:
    try:
        sv = os.statvfs(cache_dir)
    except OSError:
        return 1 << 62          # cannot tell: not taken for full
    return sv.f_bavail * sv.f_frsize


def full_sentence(cache_dir: str) -> str:
    return (f"the cache filesystem holding {cache_dir} is full: the metadata database "
            "cannot be written. Free some space there and mount again (the cached data, "
            "and any write-back data not yet on BACKING, is kept).")
