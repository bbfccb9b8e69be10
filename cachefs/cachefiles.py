"""The SSD cache files: one sparse file per BACKING inode under the cache directory's data/,
holding its cached extents at their natural offsets.

Owns the cache files' paths, the opening and closing of their descriptors (`CachedFile.
cache_fd`, open while the file is open or being written), writing (`pwrite_all`), releasing
space (`punch_hole`, `punch_holes`) and making data durable (`fdatasync_paths`). Knows
nothing of extents or the store.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Callable

from .config import EXT_SIZE
from .extents import EXT_SHIFT, CachedFile
from .libc import libc

_FALLOC_PUNCH = 0x01 | 0x02          # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


class CacheFiles:
    """The cache files of one cache directory."""

    def __init__(self, cache_dir: str, made: Callable[[CachedFile], None] | None = None,
                 restored: Callable[[CachedFile, int, OSError | None], None] | None = None):
        self.data_dir = os.path.join(cache_dir, "data")
        self._made = made           # told of every cache file made (CacheState.cache_file_made)
        self._restored = restored   # told of every one written again
        #                             (CacheState.cache_file_restored)

    def path(self, ino: int) -> str:
        return os.path.join(self.data_dir, "%02x" % (ino & 0xFF), str(ino))

    def fd(self, cf: CachedFile) -> int:
        """The file's cache-file descriptor, opened (and the file made) if needed. A file
        made is told to `made` before this returns: if the map says blocks of it are cached,
        they went with a cache file removed behind the daemon."""
        if cf.cache_fd < 0:
            path = self.path(cf.ino)
            try:
                cf.cache_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                cf.cache_fd = self._make(path)
                if self._made is not None:
                    self._made(cf)
        return cf.cache_fd

    def _make(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            for d in (self.data_dir, os.path.dirname(path)):     # umask is 0: 0700 each
                try:
                    os.mkdir(d, 0o700)
                except FileExistsError:
                    pass
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def close_idle(self, cf: CachedFile) -> None:
        """Close the descriptor of a file no handle has open. A cache file removed behind the
        daemon while open (an operator, a cleaner of old files) lives on in this descriptor
        only: before it is closed, its data is written again under its name (`restore`);
        closed with it, the file's dirty blocks were lost at the next open."""
        if cf.open_count == 0 and cf.cache_fd >= 0:
            fd, cf.cache_fd = cf.cache_fd, -1
            try:
                if cf.extents and self._restored is not None and os.fstat(fd).st_nlink == 0:
                    try:
                        self._restored(cf, self.restore(cf.ino, fd), None)
                    except OSError as e:
                        self._restored(cf, 0, e)
            finally:
                os.close(fd)

    def restore(self, ino: int, fd: int) -> int:
        """Copy the data of the unlinked cache file open as `fd` into a new cache file under
        its name, made durable before `fd` goes (the old one's blocks were; a crash right
        after must find them). Holes stay holes. Runs on the caller's thread: a rare repair,
        as long as the file's cached data takes to copy. Returns the bytes copied."""
        path = self.path(ino)
        tmp = path + ".restore"
        out = self._make(tmp)
        copied = 0
        try:
            end = os.fstat(fd).st_size
            os.ftruncate(out, end)
            pos = 0
            while pos < end:
                try:
                    pos = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError as e:
                    if e.errno != errno.ENXIO:      # ENXIO: only a hole is left
                        raise
                    break
                stop = os.lseek(fd, pos, os.SEEK_HOLE)
                while pos < stop:
                    n = os.copy_file_range(fd, out, stop - pos, pos, pos)
                    if n <= 0:
                        raise OSError(errno.EIO, f"copy of {path} stopped at byte {pos}")
                    pos += n
                    copied += n
            os.fdatasync(out)
            os.rename(tmp, path)
            fsync_dir(os.path.dirname(path))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        finally:
            os.close(out)
        return copied

    def truncate(self, cf: CachedFile, size: int) -> None:
        """Cut (or extend with a hole) the cache file; a missing one is left missing."""
        if cf.cache_fd >= 0:
            os.ftruncate(cf.cache_fd, size)
        else:
            os.truncate(self.path(cf.ino), size)

    def detach(self, cf: CachedFile) -> None:
        """Unlink the cache file instead of emptying it: whoever holds it open (the kernel,
        for passthrough opens and their mappings) keeps its bytes; the file's next cached
        data goes into a new cache file."""
        if cf.cache_fd >= 0:
            os.close(cf.cache_fd)
            cf.cache_fd = -1
        self.remove(cf.ino)

    def remove(self, ino: int) -> None:
        try:
            os.unlink(self.path(ino))
        except FileNotFoundError:
            pass

    def punch_holes(self, keys: list[tuple[int, int]]) -> None:
        """Release the SSD space of evicted extents (runs in a thread: SSD syscalls only)."""
        by_ino: dict[int, list[int]] = {}
        for ino, ext in keys:
            by_ino.setdefault(ino, []).append(ext)
        for ino, exts in by_ino.items():
            try:
                fd = os.open(self.path(ino), os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                for ext in exts:
                    punch_hole(fd, ext << EXT_SHIFT, EXT_SIZE)
            finally:
                os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename or creation in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data, off: int) -> None:
    """Write all of `data` at `off` (a short write, as when a disk fills, is continued or
    raises: never silently shortened)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]
        off += n


def punch_hole(fd: int, off: int, size: int) -> None:
    libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
                                ctypes.c_longlong)
    if libc.fallocate(fd, _FALLOC_PUNCH, off, size) != 0:
        err = ctypes.get_errno()
        if err != errno.EOPNOTSUPP:           # without hole punching the space stays used
            raise OSError(err, os.strerror(err))


def fdatasync_paths(paths: list[str]) -> None:
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
