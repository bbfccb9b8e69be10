"""Checksums of cached blocks: one 32-bit xxh3 per 4 KiB block of a cache file.

A block's checksum is taken when cachefs puts bytes in it (a fill, a write, the zeros of a
truncation): `resum` reads the block back from the cache file in the same synchronous step
as the write, so the checksum is of what the file holds. It is checked wherever the daemon
reads the block back (`read_checked`: hits, mixed reads, dirty overlays; `damaged_blocks`:
the destager, `cachefs-ctl verify`, passthrough eligibility). The kernel's own reads of a
passthrough open cannot be checked; those files are verified before the kernel gets them.

A block whose checksum is unknown (`Extent.summed` bit clear: a cache directory of an older
cachefs, dirty blocks after an unclean stop, a cache file not open when it was written) is
served unchecked until a write or `verify` gives it one. A mismatch is damage: clean blocks
are dropped and read from BACKING; dirty blocks are never replaced silently: reads of them
fail with EIO and the destager leaves them (`Extent.bad`) until they are rewritten whole.

Owns: the checksum function, the per-extent sums, `Damaged` and the damage reports.
"""

from __future__ import annotations

import logging
import os
from array import array

import xxhash

from .config import BLK_SIZE, EXT_SIZE
from .extents import BLK_SHIFT, BLKS_PER_EXT, EXT_SHIFT, CachedFile, Extent, runs
from .oplog import RateLimitedLog

log = logging.getLogger("cachefs.integrity")
_limited = RateLimitedLog(log)

_hash = xxhash.xxh3_64_intdigest
_SUM_MASK = 0xFFFFFFFF
_ZERO_SUMS = bytes(4 * BLKS_PER_EXT)
_BLK_MASK = BLK_SIZE - 1


def block_sum(buf) -> int:
    return _hash(buf) & _SUM_MASK


class Damaged(Exception):
    """A read found cached blocks that do not match their checksums: [(extent, mask)]."""

    def __init__(self, cf: CachedFile, bad: list[tuple[Extent, int]]):
        super().__init__(f"inode {cf.ino}: damaged cached blocks")
        self.cf = cf
        self.bad = bad


def sums_bytes(x: Extent) -> bytes | None:
    return x.sums.tobytes() if x.sums is not None and x.summed else None


def restore_sums(x: Extent, raw: bytes | None, summed: int) -> None:
    """Checksums loaded from the store (only for blocks still valid)."""
    if raw is None or len(raw) != len(_ZERO_SUMS):
        return
    x.sums = array("I")
    x.sums.frombytes(raw)
    x.summed = summed & x.valid


def resum(fd: int, x: Extent, mask: int, data=None, data_off: int = 0) -> None:
    """Blocks `mask` of `x` just got new bytes in the cache file `fd`: take their checksums
    from the file. Blocks known damaged keep theirs (a partial rewrite must not bless the
    rest of a damaged block); without a descriptor or on a read error they become unknown.
    `data`, the bytes just written at `data_off` in the same synchronous step: the blocks it
    holds whole are summed from it (they are what the file holds), the others read back."""
    mask &= ~x.bad
    if not mask:
        return
    x.xsum = None
    if fd < 0:
        x.summed &= ~mask
        return
    sums = x.sums
    if sums is None:
        sums = x.sums = array("I", _ZERO_SUMS)
    base = x.ext << EXT_SHIFT
    if data is not None:
        # Blocks of the extent lying wholly inside [data_off, data_off + len(data)).
        b0 = max(0, (data_off - base + _BLK_MASK) >> BLK_SHIFT)
        b1 = min(BLKS_PER_EXT, (data_off + len(data) - base) >> BLK_SHIFT)
        view = memoryview(data)
        for b in range(b0, b1):
            if mask >> b & 1:
                lo = base + (b << BLK_SHIFT) - data_off
                sums[b] = _hash(view[lo:lo + BLK_SIZE]) & _SUM_MASK
                x.summed |= 1 << b
                mask &= ~(1 << b)
        if not mask:
            return
    for b0, b1 in runs(mask):
        n = (b1 - b0) << BLK_SHIFT
        run = ((1 << b1) - 1) ^ ((1 << b0) - 1)
        try:
            data = os.pread(fd, n, base + (b0 << BLK_SHIFT))
        except OSError:
            x.summed &= ~run
            continue
        if len(data) < n:                   # past the cache file's end: zeros
            data += bytes(n - len(data))
        view = memoryview(data)
        for i in range(b1 - b0):
            sums[b0 + i] = _hash(view[i << BLK_SHIFT:(i + 1) << BLK_SHIFT]) & _SUM_MASK
        x.summed |= run


def damaged_blocks(x: Extent, data, off: int) -> int:
    """The blocks of `x` in `data` (read from the cache file at `off`, block-aligned, inside
    the extent) whose checksum is known and differs."""
    summed = x.summed
    if not summed:
        return 0
    sums = x.sums
    b = (off >> BLK_SHIFT) & (BLKS_PER_EXT - 1)
    view = memoryview(data)
    bad = 0
    for i in range(0, len(data), BLK_SIZE):
        if summed >> b & 1 and _hash(view[i:i + BLK_SIZE]) & _SUM_MASK != sums[b]:
            bad |= 1 << b
        b += 1
    return bad


def recheck(fd: int, path: str, x: Extent, mask: int) -> int:
    """Blocks `mask` of `x` that fail their checksums in the cache file now (read through
    `fd`, or `path` when no descriptor is open; a missing file fails nothing)."""
    if fd < 0:
        try:
            fd = opened = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
    else:
        opened = -1
    try:
        base = x.ext << EXT_SHIFT
        data = os.pread(fd, EXT_SIZE, base)
    finally:
        if opened >= 0:
            os.close(opened)
    return damaged_blocks(x, data + bytes(EXT_SIZE - len(data)), base) & mask


CHECK_READS = [True]             # --no-read-checksums sets it off (mount.py): measuring only


def read_block(cf: CachedFile, fd: int, x: Extent | None, off: int) -> bytes:
    """The block at byte `off` (block-aligned) of the cache file `fd`, checked against its
    checksum when `x`, its extent, knows it. Raises Damaged."""
    data = os.pread(fd, BLK_SIZE, off)
    if len(data) < BLK_SIZE:                # past the cache file's end: zeros, as in a hole
        data += bytes(BLK_SIZE - len(data))
    if x is not None and CHECK_READS[0]:
        b = (off >> BLK_SHIFT) & (BLKS_PER_EXT - 1)
        if x.summed >> b & 1 and _hash(data) & _SUM_MASK != x.sums[b]:
            raise Damaged(cf, [(x, 1 << b)])
    return data


def read_checked(cf: CachedFile, fd: int, off: int, end: int) -> bytes:
    """Bytes [off, end) of the cache file, every whole block under them checked against its
    checksum (the range is widened to block bounds for the check). Raises Damaged."""
    if not CHECK_READS[0]:
        data = os.pread(fd, end - off, off)
        return data + bytes(end - off - len(data)) if len(data) < end - off else data
    a = off & ~_BLK_MASK
    z = (end + _BLK_MASK) & ~_BLK_MASK
    if z - a == BLK_SIZE:                   # within one block
        data = read_block(cf, fd, cf.extents.get(a >> EXT_SHIFT), a)
    else:
        data = os.pread(fd, z - a, a)
        if len(data) < z - a:               # past the cache file's end: zeros, as in a hole
            data += bytes(z - a - len(data))
        _check(cf, data, a, z)
    if a == off and z == end:
        return data
    return data[off - a:end - a]


def _check(cf: CachedFile, data: bytes, a: int, z: int) -> None:
    """read_checked for several blocks: per extent, its blocks compared in one go."""
    view = memoryview(data)
    bad = None
    pos = a
    while pos < z:
        x = cf.extents.get(pos >> EXT_SHIFT)
        stop = min(z, ((pos >> EXT_SHIFT) + 1) << EXT_SHIFT)
        if x is not None and x.summed:
            b0 = (pos >> BLK_SHIFT) & (BLKS_PER_EXT - 1)
            n = (stop - pos) >> BLK_SHIFT
            span = ((1 << (b0 + n)) - 1) ^ ((1 << b0) - 1)
            part = view[pos - a:stop - a]
            if n == BLKS_PER_EXT and x.xsum is not None and _hash(part) == x.xsum:
                pass                            # the whole extent, as when last checked
            elif x.summed & span != span or array("I", [
                    _hash(part[i:i + BLK_SIZE]) & _SUM_MASK
                    for i in range(0, stop - pos, BLK_SIZE)]) != x.sums[b0:b0 + n]:
                m = damaged_blocks(x, part, pos)
                if m:
                    bad = (bad or []) + [(x, m)]
            elif n == BLKS_PER_EXT:
                x.xsum = _hash(part)            # every block checked: one hash next time
        pos = stop
    if bad:
        raise Damaged(cf, bad)


class Reports:
    """Damage found: the map told (clean blocks forgotten, dirty ones marked bad), counters,
    and one log line per block."""

    def __init__(self, stats, extent_map):
        self._stats = stats
        self._map = extent_map

    def found(self, cf: CachedFile, bad: list[tuple[Extent, int]], where: str) -> int:
        """Blocks that failed their checksums; returns how many of them are dirty."""
        lost = 0
        for x, mask in bad:
            if cf.extents.get(x.ext) is not x:
                continue                        # gone meanwhile (the check ran in a thread)
            mask &= x.valid
            clean, dirty = mask & ~x.dirty, mask & x.dirty
            if clean:
                self.clean(cf, x, clean, where)
            if dirty:
                self.dirty(cf, x, dirty, where)
                lost += bin(dirty).count("1")
            if mask:
                self._map.damaged(cf, x, clean, dirty)
        return lost

    def clean(self, cf: CachedFile, x: Extent, mask: int, where: str) -> None:
        n = bin(mask).count("1")
        self._stats.checksum_errors += n
        self._stats.drop_checksum += 1
        # One line per file and minute (the counters have every block): a wiped cache
        # directory wrote a line per 4 KiB block, 262,000 per GiB (a helper's hunt).
        _limited.warning(("checksum", cf.ino), "checksum mismatch in the cache of %s at "
                         "offset %d (%s): %d clean block%s of its extent, dropped and read "
                         "from BACKING (reason: checksum; stats checksum_errors counts every "
                         "block)", _name(cf), _offsets(x, mask)[0], where, n,
                         "" if n == 1 else "s")

    def dirty(self, cf: CachedFile, x: Extent, mask: int, where: str) -> None:
        for off in _offsets(x, mask & ~x.bad):          # once per block
            self._stats.checksum_dirty_errors += 1
            log.error("checksum mismatch in the cache of %s at offset %d (%s): a DIRTY "
                      "block not yet in BACKING is damaged on the SSD; reads of it fail "
                      "with EIO and it is not destaged until it is rewritten whole",
                      _name(cf), off, where)


def lost_blocks(bad: dict) -> dict:
    """stats: the damaged dirty blocks (ExtentMap.bad: key -> file), the first 20 named."""
    found = []
    for (_, ext), cf in bad.items():
        x = cf.extents.get(ext)
        if x is not None:
            found += [(_name(cf), off) for off in _offsets(x, x.bad)]
    return {"lost_dirty_blocks": len(found),
            "lost": [{"path": p, "offset": off} for p, off in sorted(found)[:20]]}


def _offsets(x: Extent, mask: int) -> list[int]:
    base = x.ext << EXT_SHIFT
    return [base + (b << BLK_SHIFT) for b in range(BLKS_PER_EXT) if mask >> b & 1]


def _name(cf: CachedFile) -> str:
    return os.fsdecode(cf.path) if cf.path else f"inode {cf.ino}"
