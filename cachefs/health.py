"""BACKING health: what every BACKING call's failure says about BACKING, counted, logged and
summarised as one state, "ok" or "failing since T (N errors)".

Owns `BackingHealth`: errors by errno name and operation, timeouts, the time of the last
error and of the last success, the failing periods, and their log lines (through
`RateLimitedLog`). `Backing` (backing.py) reports every call's outcome here; nothing else
does. It never does I/O on BACKING; describing a failed call's target is the caller's.

Which errors count. Most errors of a BACKING call are BACKING's normal answers, passed on
to the application as they are, and say nothing about BACKING's health: ENOENT, EEXIST,
ENOTEMPTY, ENOTDIR, EISDIR, ELOOP, ENAMETOOLONG, EXDEV, EACCES, EPERM, EINVAL, ERANGE,
ENODATA (no such xattr), EOPNOTSUPP, EFBIG, EMLINK, ETXTBSY, EBUSY, EROFS (a read-only
BACKING is its configuration, not a fault: the writer gets EROFS as it would from BACKING),
and our own process's limits (EMFILE, ENFILE, ENOMEM, EBADF). Those are not counted.
Counted, as *errors* ("BACKING error", state failing): the errnos by which a disk, a
network file system or a FUSE BACKING says it is unwell, UNWELL below (EIO, ESTALE,
ENOTCONN, ETIMEDOUT, the network ones, ENODEV/ENXIO, EREMOTEIO, EUCLEAN/EBADMSG for a
corrupted file system...). Counted as *full* ("BACKING full", state failing too, since
writes and destaging fail until an operator makes room): ENOSPC and EDQUOT. A call that
exceeds --backing-timeout (`BackingTimeout`, the caller gets EIO) counts as a *timeout*.
Unknown errnos are not counted: a new normal answer must never make the state flap.

State. The first counted failure starts a failing period (a WARNING at once). The period
lasts while some operation (read, write, stat, open, destage write...) is failing. An
operation stops failing when a call of the same operation succeeds that was started after
it began failing (calls started earlier prove nothing about BACKING now), or when it had no
error for QUIET_S while other calls succeeded (it may never be retried). So stats that work
while every data read fails with EIO (a dying disk, or slowfs eio=1) do not call BACKING
well. When no operation is failing, the period ends: an INFO "recovered after N errors over
X s". Log pacing: one line per
(operation, errno) per minute with the count of lines held back; "recovered" at most once a
minute; the first error of a period is always logged if the log's last word was "recovered",
so the log never ends on "recovered" while BACKING fails. `flush()` (unmount) reports what
is still held back.

Cost: a call that succeeds reads one attribute before, and sets one (`ok_s`) and tests one
after; only failures and the end of a failing period do more. A cache hit never gets here.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Callable

from .oplog import RateLimitedLog

log = logging.getLogger("cachefs.backing")


def _errnos(*names: str) -> frozenset[int]:
    return frozenset(getattr(errno, n) for n in names if hasattr(errno, n))


UNWELL = _errnos("EIO", "ETIMEDOUT", "ESTALE", "ENOTCONN", "EHOSTDOWN", "EHOSTUNREACH",
                 "ENETDOWN", "ENETUNREACH", "ENETRESET", "ECONNREFUSED", "ECONNRESET",
                 "ECONNABORTED", "ESHUTDOWN", "ENODEV", "ENXIO", "EREMOTEIO", "ENOLINK",
                 "ECOMM", "EPROTO", "EUCLEAN", "EBADMSG", "ENOMEDIUM", "EKEYEXPIRED")
FULL = _errnos("ENOSPC", "EDQUOT")
COUNTED = UNWELL | FULL                 # Backing tests membership before calling failed()
TIMEOUT = "timeout"                     # the errno name of a timed-out call
QUIET_S = 30.0                          # an operation with no error for this long is well


def errno_name(err: int | None) -> str:
    return errno.errorcode.get(err or 0, str(err))


class BackingHealth:
    """Counts and states of BACKING's failures (see the module docstring).

    Attributes read on every call: `period` (before), `ok_s` (set after a success),
    `failing_since_s` (tested after a success: None while ok).
    """

    def __init__(self, stats=None, logger: logging.Logger = log,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, interval_s: float = 60.0):
        self._stats = stats                 # counts `backing_errors` when given
        self._clock = clock
        self._wall = wall
        self._log = logger
        self._limited = RateLimitedLog(logger, interval_s, clock)
        self.period = 0                     # operations that began failing (a call notes it)
        self._failing: dict[str, list] = {}     # op -> [self.period when it began, last error]
        self.failing_since_s: float | None = None       # monotonic start of this period
        self.since_wall = wall()            # wall time the current state began
        self.period_errors = 0              # counted failures of this period
        self.errors: dict[str, int] = {}    # errno name -> counted failures (this mount)
        self.by_op: dict[str, dict[str, int]] = {}      # op -> errno name -> count
        self.timeouts = 0
        self.ok_s: float | None = None      # monotonic time of the last success
        self.last_error: str | None = None  # "EIO on read"
        self.last_error_on: str | None = None   # its target, "/srv/slow/file"
        self.last_error_s: float | None = None
        # The log's last word on health was "ok" (mount) or "recovered": the next failure is
        # the first of a period, and is logged whatever the pace.
        self._said_ok = True
        # Writes in flight (Backing.write_call): n -> (fn, args, monotonic start). Writes are
        # never abandoned, so one that hangs is neither an error nor a success: a stall.
        self.write_seq = 0
        self.writes: dict[int, tuple] = {}
        self.stall: tuple[str, float] | None = None     # (what, monotonic start)
        # Read calls in threads: n -> monotonic start; each thread takes its own out when
        # its call returns, also one whose caller timed out (reads_hung).
        self.read_seq = 0
        self.reads: dict[int, float] = {}

    # -- outcomes (Backing reports them) ----------------------------------------------------

    def failed(self, op: str, exc: OSError, target: str) -> None:
        """A call failed with a counted errno (exc.errno in COUNTED)."""
        name = errno_name(exc.errno)
        kind = "full" if exc.errno in FULL else "error"
        self._count(op, name, target)
        if self._limited.warning(
                (op, name), "BACKING %s: %s of %s failed: %s (%s)", kind, op, target, name,
                os.strerror(exc.errno), force=self._said_ok):
            self._said_ok = False

    def timed_out(self, op: str, target: str, timeout_s: float) -> None:
        """A call ran past the timeout (the caller gets EIO; a read's thread is abandoned)."""
        self.timeouts += 1
        self._count(op, TIMEOUT, target)
        if self._limited.warning(
                (op, TIMEOUT), "BACKING timeout: %s of %s did not finish within %g s (the "
                "caller gets EIO)", op, target, timeout_s, force=self._said_ok):
            self._said_ok = False

    def succeeded(self, op: str, period: int) -> None:
        """A call of `op` succeeded while failing (`period`: self.period when it started);
        the failing period ends once no operation is failing any more."""
        failing = self._failing
        now = self._clock()
        since = failing.get(op)
        if since is not None and period >= since[0]:
            del failing[op]
        for other, (_, last_s) in list(failing.items()):
            if now - last_s >= QUIET_S:
                del failing[other]
        if failing or self.failing_since_s is None:
            return
        n, span = self.period_errors, now - self.failing_since_s
        self.failing_since_s = None
        self.since_wall = self._wall()
        self.period_errors = 0
        if self._limited.info(("recovered",), "BACKING recovered after %d error%s over "
                              "%.1f s (last: %s)", n, "" if n == 1 else "s", span,
                              self.last_error):
            self._said_ok = True

    def _count(self, op: str, name: str, target: str) -> None:
        now = self._clock()
        if self.failing_since_s is None:
            self.failing_since_s = now
            self.since_wall = self._wall()
        since = self._failing.get(op)
        if since is None:
            self.period += 1                # calls started from now on may clear `op`
            self._failing[op] = [self.period, now]
        else:
            since[1] = now
        self.period_errors += 1
        self.errors[name] = self.errors.get(name, 0) + 1
        ops = self.by_op.setdefault(op, {})
        ops[name] = ops.get(name, 0) + 1
        self.last_error = f"{name} on {op}"
        self.last_error_on = target
        self.last_error_s = now
        if self._stats is not None:
            self._stats.backing_errors += 1

    def check_stalls(self, limit_s: float, what: Callable[..., str]) -> None:
        """Called once a second: the oldest write in flight has run `limit_s` or longer (the
        writer still waits for it). One WARNING when a stall begins, one INFO when no write
        is over the limit any more; `what(fn, args)` names a write for the log."""
        now = self._clock()
        oldest = min(self.writes.values(), key=lambda w: w[2], default=None)
        if oldest is not None and now - oldest[2] >= limit_s:
            if self.stall is None:
                self.stall = (what(oldest[0], oldest[1]), oldest[2])
                self._log.warning("BACKING stalled: %s has not returned after %.0f s (writes "
                                  "are never abandoned: the writer waits; reads fail with "
                                  "EIO after --backing-timeout)", self.stall[0],
                                  now - oldest[2])
        elif self.stall is not None:
            self._log.info("BACKING stall over: no write has been waiting %g s or longer "
                           "(%s took %.0f s or more)", limit_s, self.stall[0],
                           now - self.stall[1])
            self.stall = None

    def reads_hung(self, limit_s: float) -> bool:
        """A read call of BACKING has run `limit_s` or longer and not returned yet (its
        caller got EIO at the timeout): BACKING does not answer now."""
        if not self.reads:
            return False
        now = self._clock()
        return any(now - t >= limit_s for t in list(self.reads.values()))

    # -- reporting --------------------------------------------------------------------------

    def flush(self) -> None:
        """Report the lines still held back (at unmount)."""
        self._limited.flush()

    def snapshot(self) -> dict:
        now = self._clock()

        def age(t: float | None) -> float | None:
            return None if t is None else round(now - t, 1)

        failing = self.failing_since_s is not None
        stall = self.stall
        return {
            "state": "stalled" if stall else "failing" if failing else "ok",
            "stalled_for_s": None if stall is None else age(stall[1]),
            "stalled_on": None if stall is None else stall[0],
            "since": round(self.since_wall, 3),
            "failing_for_s": age(self.failing_since_s),
            "period_errors": self.period_errors,
            "failing_ops": sorted(self._failing),
            "errors": dict(self.errors),
            "by_op": {op: dict(d) for op, d in self.by_op.items()},
            "timeouts": self.timeouts,
            "last_error": self.last_error,
            "last_error_on": self.last_error_on,
            "last_error_age_s": age(self.last_error_s),
            "last_ok_age_s": age(self.ok_s),
        }


def summary(h: dict | None) -> str:
    """One line for `cachefs-ctl stats` and `top`: `ok` or `failing for 12 s: 37 errors,
    last: EIO on read of /srv/slow/f` (from a snapshot's "backing_health")."""
    if not h:
        return "-"
    if h["state"] == "stalled":
        text = f"stalled for {h['stalled_for_s']:.0f} s: {h['stalled_on']} has not returned"
        if h["failing_for_s"] is not None:
            text += f"; failing for {h['failing_for_s']:.0f} s, last: {h['last_error']}"
        return text
    if h["state"] == "failing":
        n = h["period_errors"]
        text = (f"failing for {h['failing_for_s']:.0f} s: {n} error{'' if n == 1 else 's'}"
                f", last: {h['last_error']}")
        if h.get("last_error_on"):
            text += f" of {h['last_error_on']}"
        return text
    total = sum(h["errors"].values())
    if not total:
        return "ok"
    return (f"ok; {total} error{'' if total == 1 else 's'} since mount"
            f" ({', '.join(f'{k} {v}' for k, v in sorted(h['errors'].items()))}), "
            f"last {h['last_error_age_s']:.0f} s ago: {h['last_error']}")
