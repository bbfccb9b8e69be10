"""fresh_fstat(): BACKING's attributes as BACKING has them now, not as the kernel cached them.

A network or FUSE BACKING lets the kernel cache a file's attributes for a while (FUSE's
attr_timeout, NFS's actimeo), and a write through an O_DIRECT/AIO descriptor does not always
invalidate them: `os.fstat` right after cachefs's own write may then return an mtime from
before that write. Recorded as the identity of cachefs's own change, such a stat makes the
next revalidation take cachefs's own write for a change behind its back and drop the file's
cache (issue 9). `statx(AT_STATX_FORCE_SYNC)` makes the filesystem ask its server.
"""

from __future__ import annotations

import ctypes
import errno
import os

from .libc import libc

AT_EMPTY_PATH = 0x1000
AT_STATX_FORCE_SYNC = 0x2000
STATX_BASIC_STATS = 0x7FF
STATX_DIOALIGN = 0x2000
STATX_BTIME = 0x800


class _Ts(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_uint32),
                ("_reserved", ctypes.c_int32)]


class _Statx(ctypes.Structure):
    _fields_ = [("mask", ctypes.c_uint32), ("blksize", ctypes.c_uint32),
                ("attributes", ctypes.c_uint64), ("nlink", ctypes.c_uint32),
                ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32), ("mode", ctypes.c_uint16),
                ("_spare0", ctypes.c_uint16), ("ino", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("blocks", ctypes.c_uint64), ("attributes_mask", ctypes.c_uint64),
                ("atime", _Ts), ("btime", _Ts), ("ctime", _Ts), ("mtime", _Ts),
                ("rdev_major", ctypes.c_uint32), ("rdev_minor", ctypes.c_uint32),
                ("dev_major", ctypes.c_uint32), ("dev_minor", ctypes.c_uint32),
                ("mnt_id", ctypes.c_uint64), ("dio_mem_align", ctypes.c_uint32),
                ("dio_offset_align", ctypes.c_uint32), ("_spare2", ctypes.c_uint64 * 12)]


try:
    _statx = libc.statx
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                       ctypes.POINTER(_Statx)]
    _statx.restype = ctypes.c_int
except AttributeError:                     # no statx in this libc: plain fstat
    _statx = None


def _float(ts: _Ts) -> float:
    return ts.tv_sec + ts.tv_nsec * 1e-9            # as os.stat computes st_mtime


def fresh_fstat(fd: int) -> os.stat_result:
    """os.fstat(fd), but fetched from the filesystem rather than the kernel's attribute
    cache (falls back to os.fstat where statx is missing)."""
    if _statx is None:
        return os.fstat(fd)
    buf = _Statx()
    if _statx(fd, b"", AT_EMPTY_PATH | AT_STATX_FORCE_SYNC, STATX_BASIC_STATS,
              ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        if err == errno.ENOSYS:             # a kernel without statx
            return os.fstat(fd)
        raise OSError(err, os.strerror(err))
    ns = lambda ts: ts.tv_sec * 1_000_000_000 + ts.tv_nsec      # noqa: E731
    dev = os.makedev(buf.dev_major, buf.dev_minor)
    at, mt, ct = ns(buf.atime), ns(buf.mtime), ns(buf.ctime)
    return os.stat_result(
        (buf.mode, buf.ino, dev, buf.nlink, buf.uid, buf.gid, buf.size,
         buf.atime.tv_sec, buf.mtime.tv_sec, buf.ctime.tv_sec),
        {"st_atime": _float(buf.atime), "st_mtime": _float(buf.mtime),
         "st_ctime": _float(buf.ctime),
         "st_atime_ns": at, "st_mtime_ns": mt, "st_ctime_ns": ct,
         "st_blksize": buf.blksize, "st_blocks": buf.blocks,
         "st_rdev": os.makedev(buf.rdev_major, buf.rdev_minor)})


def birth_ns(fd: int) -> int:
    """The birth time of the file open as `fd` in ns (statx STATX_BTIME: ext4, xfs, btrfs,
    tmpfs...), or 0 where its filesystem does not say (NFSv3, most FUSE filesystems). A file
    that took the inode number of a deleted one has another (state.CacheState.bind_dirty)."""
    if _statx is None:
        return 0
    buf = _Statx()
    if _statx(fd, b"", AT_EMPTY_PATH, STATX_BTIME, ctypes.byref(buf)) != 0 or \
            not buf.mask & STATX_BTIME:
        return 0
    return buf.btime.tv_sec * 1_000_000_000 + buf.btime.tv_nsec or 0


def dio_align(fd: int) -> tuple[int, int]:
    """(memory, offset) alignment the file's filesystem requires of O_DIRECT I/O (statx
    STATX_DIOALIGN, Linux >= 6.1); (0, 0) when it does not say (NFS, FUSE, tmpfs: direct I/O
    there takes any alignment, or is not supported at all)."""
    if _statx is None:
        return 0, 0
    buf = _Statx()
    if _statx(fd, b"", AT_EMPTY_PATH, STATX_DIOALIGN, ctypes.byref(buf)) != 0 or \
            not buf.mask & STATX_DIOALIGN:
        return 0, 0
    return buf.dio_mem_align, buf.dio_offset_align


STATX_MNT_ID_UNIQUE = 0x4000    # Linux 6.8: a mount's 64-bit id, never given to another mount


def mount_id(fd: int) -> int | None:
    """The unique id of the mount holding `fd` (no two mounts ever get the same one, unlike
    device numbers of FUSE and NFS mounts, which are given out again), None where the
    kernel does not tell (before 6.8)."""
    if _statx is None:
        return None
    buf = _Statx()
    if _statx(fd, b"", AT_EMPTY_PATH, STATX_MNT_ID_UNIQUE, ctypes.byref(buf)) != 0:
        return None
    return buf.mnt_id if buf.mask & STATX_MNT_ID_UNIQUE else None


def file_id(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what `path` names now, None if it names nothing reachable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def fs_type(fd: int) -> int:
    """statfs f_type of the filesystem holding `fd`."""
    class StatFs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]

    buf = StatFs()
    if libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.f_type
