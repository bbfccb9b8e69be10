"""The attributes cachefs reports for a BACKING stat: `Attributes.of` builds the pyfuse3
`EntryAttributes` the kernel caches (timeouts from the config, the logical size of the
engine, and in write-back the view of a file whose data is still dirty).

Never does I/O.
"""

from __future__ import annotations

import os

import pyfuse3

from .cache import Cache
from .config import EXT_SIZE, Config

BLKSIZE = 128 * 1024


class Attributes:
    def __init__(self, cfg: Config, cache: Cache):
        self._cfg = cfg
        self._cache = cache

    def of(self, st: os.stat_result, ino: int, token: tuple | None = None
           ) -> pyfuse3.EntryAttributes:
        """The attributes the kernel gets for BACKING's `st` (`token`: the stat token
        taken before that stat, see Coherence.logical_size)."""
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = self._cfg.entry_timeout_s
        a.attr_timeout = self._cfg.attr_timeout_s
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_rdev = st.st_rdev
        a.st_size = self._cache.logical_size(ino, st.st_size, token)
        a.st_blksize = BLKSIZE
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        if self._cache.write_back:
            cf = self._cache.files.get(ino)             # a destage's ctime is not shown
            ctime, busy = st.st_ctime_ns, False
            if cf is not None and (cf.meta_inflight or cf.writes_inflight
                                   or self._cache.overtaken(cf, token)):
                # A change of ours is under way or ended during the stat (a destage pass:
                # its thread moved BACKING's ctime before the loop took its end): programs
                # see the ctime from before it (a first destage showed its own ctime once,
                # then the one before again: git's index saw a change).
                busy = True
                if cf.identity is not None:
                    ctime = cf.identity[3]
            a.st_ctime_ns = self._cache.shown_ctime(ino, ctime, busy)
            self._dirty_view(a, st, ino)
        return a

    def _dirty_view(self, a: pyfuse3.EntryAttributes, st: os.stat_result, ino: int) -> None:
        """Write-back: attributes of a file with dirty data as they will be once it reaches
        BACKING. BACKING may hold none of the bytes yet, and a file that claims 0 blocks
        is taken for all holes (GNU tar --sparse archived zeros); its mtime must move with
        the writes, or make and rsync miss the change until the destage."""
        cf = self._cache.files.get(ino)
        if cf is None or not cf.dirty_exts:
            return
        a.st_blocks = max(st.st_blocks, -(-min(a.st_size, cf.dirty_exts * EXT_SIZE) // 512))
        if cf.times is not None:        # what BACKING gets after the destage (set_times)
            a.st_mtime_ns = cf.times[1]
            a.st_ctime_ns = max(a.st_ctime_ns, cf.times[1])
            if cf.times[0] > a.st_atime_ns:     # a read's (cache.open), not KEEP_ATIME (-1)
                a.st_atime_ns = cf.times[0]
