"""Log lines an operator acts on: the mount and unmount summaries, and a rate limiter for
events that may repeat (at most one line per key per interval, with a count of the lines it
held back).

Owns wording and pacing only: callers pass what happened; nothing here does I/O besides
`logging`. Not for the per-request path (a cache hit never logs).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Hashable

from .config import format_size


class RateLimitedLog:
    """At most one line per key per `interval_s`; the next line that gets through says how
    many were suppressed since the last one. `flush()` reports what is still held back (at
    unmount, say), so no count is lost.

        limited = RateLimitedLog(log)
        limited.warning(("backing-error", path), "reading %s failed: %s", path, exc)
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 4096):
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[Hashable, float] = {}      # key -> time of its last line
        self._held: dict[Hashable, tuple[int, int, str, tuple]] = {}   # key -> n, level, msg

    def log(self, level: int, key: Hashable, msg: str, *args, force: bool = False) -> bool:
        """Log `msg % args` unless `key` logged within the interval (`force`: log it all the
        same, say because it reports a change of state). Returns whether it did."""
        now = self._clock()
        last = self._last.get(key)
        if not force and last is not None and now - last < self._interval_s:
            n = self._held.get(key, (0,))[0]
            self._held[key] = (n + 1, level, msg, args)
            return False
        if len(self._last) >= self._max_keys and key not in self._last:
            self._forget_old(now)
        self._last[key] = now
        held = self._held.pop(key, None)
        if held:
            msg += " (%d similar line%s suppressed in the last %s)"
            args = (*args, held[0], "" if held[0] == 1 else "s", _span(self._interval_s))
        self._log.log(level, msg, *args)
        return True

    def info(self, key: Hashable, msg: str, *args, force: bool = False) -> bool:
        return self.log(logging.INFO, key, msg, *args, force=force)

    def warning(self, key: Hashable, msg: str, *args, force: bool = False) -> bool:
        return self.log(logging.WARNING, key, msg, *args, force=force)

    def error(self, key: Hashable, msg: str, *args) -> bool:
        return self.log(logging.ERROR, key, msg, *args)

    def flush(self) -> None:
        """One line per key with suppressed lines: the last of them and the count."""
        for key, (n, level, msg, args) in list(self._held.items()):
            self._log.log(level, msg + " (and %d similar line%s suppressed)", *args, n,
                          "" if n == 1 else "s")
        self._held.clear()

    def _forget_old(self, now: float) -> None:
        """Bound memory: keys quiet for an interval have nothing held worth keeping apart."""
        for key, t in list(self._last.items()):
            if now - t >= self._interval_s and key not in self._held:
                del self._last[key]
        if len(self._last) >= self._max_keys:          # all busy: report and start over
            self.flush()
            self._last.clear()


def _span(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g} s"


def mount_line(s: dict) -> str:
    """`mounted BACKING on MNT (MODE): cache ..., dirty marks ...` from a stats snapshot."""
    line = (f"mounted {s['backing']} on {s['mountpoint']} ({s['mode']}): cache "
            f"{format_size(s['cache_size'])} in {s['cache_dir']}, "
            f"{format_size(s['cache_used'])} in {s['extents_cached']} extents warm")
    if s["mode"] == "write-back" or s["dirty_bytes"]:
        line += (f"; dirty high {format_size(s['dirty_high'])}, low "
                 f"{format_size(s['dirty_low'])}, {format_size(s['dirty_bytes'])} dirty now")
    if s.get("pinned_files"):
        line += f"; {s['pinned_files']} files pinned"
    return line


def unmount_line(s: dict) -> str:
    """`unmounted MNT after ...: reads, hit ratio, writes, dirty data kept` from a stats
    snapshot taken after the last commit."""
    line = (f"unmounted {s['mountpoint']} ({s['mode']}) after {_duration(s['uptime_s'])}: "
            f"{s['read_ops']} reads ({format_size(s['read_bytes'])}, hit ratio "
            f"{100 * s['hit_ratio']:.1f} %), {s['write_ops']} writes "
            f"({format_size(s['write_bytes'])}); cache {format_size(s['cache_used'])} of "
            f"{format_size(s['cache_size'])}")
    if s["dirty_bytes"]:
        line += (f"; {format_size(s['dirty_bytes'])} dirty kept on the SSD, destaged after "
                 "the next mount")
    errors = s["backing_errors"] + s["cache_errors"] + s["destage_errors"]
    if errors:
        line += (f"; errors: BACKING {s['backing_errors']}, cache {s['cache_errors']}, "
                 f"destage {s['destage_errors']}")
    return line + "; metadata persisted"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class LateReplyFilter(logging.Filter):
    """pyfuse3 logs an ERROR when the kernel no longer waits for a reply ("fuse_reply_*
    failed with No such file or directory": the request was interrupted, or a RELEASE sent
    in the background raced the unmount). Nothing is lost then; it becomes an INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "fuse_reply_" in str(record.msg) and \
                "No such file or directory" in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_late_replies() -> None:
    logging.getLogger("pyfuse3").addFilter(LateReplyFilter())
