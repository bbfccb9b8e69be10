#!/usr/bin/env python3
"""slowfs: a slow-BACKING emulator for cachefs tests and benchmarks.

A pyfuse3 passthrough filesystem over a SOURCE directory that charges every request the
time a disk array behind a 1 Gb link would take, whether or not the host page cache holds
the data. It owns the service model (slots, seek/sequential service time, a shared link),
the fault switches and the counters; it must not block the trio loop on anything but the
page-cached SOURCE syscalls it exists to pass through. See bench/README.md for the model.

    slowfs.py mount [-f] [--latency-ms 5] [--jitter-ms 1] ... SOURCE MOUNTPOINT
    slowfs.py stats MOUNTPOINT          # JSON counters
    slowfs.py set MOUNTPOINT key=value ...
    slowfs.py reset MOUNTPOINT

Control channel: xattrs on the mount root, handled by the daemon and never passed to
SOURCE nor listed: ``user.slowfs.stats`` (get, JSON), ``user.slowfs.set`` (set,
"key=value ..."), ``user.slowfs.reset`` (set, any value).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import heapq
import itertools
import json
import logging
import os
import random
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import trio

CONTROL_PREFIX = b"user.slowfs."
XATTR_STATS = "user.slowfs.stats"
XATTR_SET = "user.slowfs.set"
XATTR_RESET = "user.slowfs.reset"

log = logging.getLogger("slowfs")


# --------------------------------------------------------------------------- parameters

@dataclass(frozen=True)
class Param:
    kind: Callable[[str], float]
    default: float
    lo: float
    hi: float
    doc: str


def _flag(text: str) -> int:
    value = {"0": 0, "1": 1, "false": 0, "true": 1, "off": 0, "on": 1}.get(text.lower())
    if value is None:
        raise ValueError(text)
    return value


INF = float("inf")
#: Every model parameter and fault switch: settable with --name-with-dashes at mount time
#: and with `set name=value` while mounted.
PARAMS: dict[str, Param] = {
    "latency_ms": Param(float, 5.0, 0, INF,
                        "random-access service time per read/write/fsync request"),
    "jitter_ms": Param(float, 1.0, 0, INF,
                       "uniform +/- spread of the random-access time (capped at latency_ms)"),
    "seq_latency_ms": Param(float, 0.1, 0, INF,
                            "service time of a request that continues the previous one "
                            "on the same file"),
    "bandwidth_mbs": Param(float, 110.0, 0, INF,
                           "shared link bandwidth in MB/s (10^6 bytes); 0 = unlimited"),
    "concurrency": Param(int, 8, 1, 100000,
                         "service slots: read/write/fsync requests served at once"),
    "meta_latency_ms": Param(float, 0.5, 0, INF,
                             "time charged to each metadata request (no slot, no link)"),
    "entry_timeout_s": Param(float, 0.1, 0, INF, "kernel dentry cache timeout"),
    "attr_timeout_s": Param(float, 0.1, 0, INF, "kernel attribute cache timeout"),
    "eio": Param(float, 0.0, 0, 1, "fault: fraction of read/write requests failing with EIO"),
    "enospc": Param(float, 0.0, 0, 1, "fault: fraction of writes failing with ENOSPC"),
    "hang": Param(_flag, 0, 0, 1, "fault: 1 = requests block until hang=0"),
    "offline": Param(_flag, 0, 0, 1, "fault: 1 = every request fails with EIO"),
    "hang_truncate": Param(_flag, 0, 0, 1, "fault: 1 = size changes (truncate, O_TRUNC) "
                           "block until hang_truncate=0; other requests go on"),
    "page_cache": Param(_flag, 0, 0, 1, "1 = opens use the kernel's page cache (allows "
                        "shared mappings, e.g. a SQLite database in WAL mode; requests may "
                        "then be absorbed by it)"),
    "seed": Param(int, 0, -2**63, 2**63 - 1,
                  "random seed for jitter and fault draws (0 = from os.urandom)"),
}


def parse_assignments(words: list[str]) -> dict[str, float]:
    """Parse ``key=value`` words into validated parameter values.

    Raises:
        ValueError: with a sentence naming the bad word.
    """
    out: dict[str, float] = {}
    for word in words:
        key, sep, text = word.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in PARAMS:
            raise ValueError(f"{word!r} is not key=value with a key among: "
                             f"{', '.join(PARAMS)}")
        out[key] = check_value(key, text.strip())
    return out


def check_value(key: str, text: str) -> float:
    p = PARAMS[key]
    try:
        value = p.kind(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a valid {p.kind.__name__.strip('_')}") \
            from None
    if value != value or not p.lo <= value <= p.hi:        # NaN or out of range
        raise ValueError(f"{key}={text} is out of range [{p.lo:g}, {p.hi:g}]")
    return value


# --------------------------------------------------------------------------- timer

_CLOCK_MONOTONIC = 1
_TFD_CLOEXEC = 0o2000000
_TFD_NONBLOCK = 0o4000
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc = ctypes.CDLL(None, use_errno=True)


#: Waits this short are not slept, and a timer expiry also wakes waiters due this soon:
#: a wake-up costs more CPU than the wait. The model's clocks (link, deadlines) are exact,
#: so throughput limits hold; one request may finish up to SLACK_S early.
SLACK_S = 50e-6


class PreciseTimer:
    """Sub-millisecond sleeps for the trio loop.

    trio sleeps through epoll_wait, whose timeout CPython rounds *up* to whole
    milliseconds: a 0.1 ms service time would cost ~1 ms. One timerfd armed at the
    earliest deadline (CLOCK_MONOTONIC = time.monotonic()) wakes a heap of waiters.
    """

    def __init__(self) -> None:
        self._fd = _libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_CLOEXEC | _TFD_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self._heap: list = []
        self._seq = itertools.count()
        self._armed = INF
        self._spec = _Itimerspec()

    def _arm(self, deadline: float) -> None:
        ns = max(int(deadline * 1e9), 1)
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
        if _libc.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec),
                                 None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self._armed = deadline

    async def sleep_until(self, deadline: float) -> None:
        if deadline - time.monotonic() <= SLACK_S:
            return
        event = trio.Event()
        heapq.heappush(self._heap, (deadline, next(self._seq), event))
        if deadline < self._armed:
            self._arm(deadline)
        await event.wait()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        heap = self._heap
        while True:
            await trio.lowlevel.wait_readable(self._fd)
            try:
                os.read(self._fd, 8)
            except BlockingIOError:
                pass
            soon = time.monotonic() + SLACK_S
            while heap and heap[0][0] <= soon:
                heapq.heappop(heap)[2].set()
            self._armed = INF
            if heap:
                self._arm(heap[0][0])


# --------------------------------------------------------------------------- filesystem

def _make_operations():  # deferred so `stats`/`set` work without importing pyfuse3
    import pyfuse3
    from pyfuse3 import FUSEError, ROOT_INODE

    class OpenFile:
        __slots__ = ("fd", "ino")

        def __init__(self, fd: int, ino: int) -> None:
            self.fd = fd
            self.ino = ino

    class SlowOperations(pyfuse3.Operations):
        """Passthrough Operations over SOURCE with the service model in front."""

        enable_writeback_cache = False

        def __init__(self, source: str, params: dict[str, float]) -> None:
            super().__init__()
            self._src = os.fsencode(os.path.abspath(source))
            self._src_ino = os.lstat(self._src).st_ino
            self._entries: dict[int, dict[tuple[int, bytes], None]] = {}  # ino -> entries
            self._lookups: dict[int, int] = {}
            self._files: dict[int, OpenFile] = {}
            self._dirs: dict[int, tuple[int, list]] = {}
            self._next_fh = itertools.count(1)
            self._last_end: dict[int, int] = {}       # ino -> end offset of last request
            self._link_free = 0.0                     # monotonic time the link is idle
            self._timer = PreciseTimer()
            self._slot_free: list[float] = []           # heap: when each slot frees up
            self._resume = trio.Event()
            self._resume.set()
            self._rng = random.Random()
            self._p: dict[str, float] = {k: p.default for k, p in PARAMS.items()}
            self._inflight = 0
            self._busy_since = 0.0
            self._hung = 0
            self._started = time.monotonic()
            self.reset()
            self.apply(params)

        # ---------------------------------------------------------------- control
        def reset(self) -> None:
            self.read_ops = self.read_bytes = self.write_ops = self.write_bytes = 0
            self.fsync_ops = self.meta_ops = self.errors_injected = 0
            self.seq_ops = self.random_ops = 0
            self.busy_s = self.service_s = self.queue_s = 0.0
            self.max_inflight = self._inflight
            if self._inflight:
                self._busy_since = time.monotonic()
            self._reset_at = time.monotonic()

        def apply(self, params: dict[str, float]) -> None:
            p = self._p
            p.update(params)
            slots = sorted(self._slot_free)[:int(p["concurrency"])]
            slots += [0.0] * (int(p["concurrency"]) - len(slots))
            self._slot_free = slots                    # sorted, hence a heap
            if "seed" in params:
                self._rng.seed(int(p["seed"]) or None)
            if p["hang"] and self._resume.is_set():
                self._resume = trio.Event()
            elif not p["hang"]:
                self._resume.set()
            self._faulty = bool(p["hang"] or p["offline"])
            self._entry_timeout = p["entry_timeout_s"]
            self._attr_timeout = p["attr_timeout_s"]
            if params:
                log.info("parameters: %s", " ".join(f"{k}={v:g}" for k, v in params.items()))

        def statistics(self) -> dict:
            now = time.monotonic()
            busy = self.busy_s + (now - self._busy_since if self._inflight else 0.0)
            return {
                "read_ops": self.read_ops, "read_bytes": self.read_bytes,
                "write_ops": self.write_ops, "write_bytes": self.write_bytes,
                "fsync_ops": self.fsync_ops, "meta_ops": self.meta_ops,
                "errors_injected": self.errors_injected,
                "seq_ops": self.seq_ops, "random_ops": self.random_ops,
                "busy_s": round(busy, 6), "service_s": round(self.service_s, 6),
                "queue_s": round(self.queue_s, 6),
                "elapsed_s": round(now - self._reset_at, 6),
                "inflight": self._inflight, "max_inflight": self.max_inflight,
                "hung": self._hung, "open_files": len(self._files),
                "known_inodes": len(self._lookups),
                "uptime_s": round(now - self._started, 3), "pid": os.getpid(),
                "params": dict(self._p),
            }

        # ---------------------------------------------------------------- model
        async def _gate(self) -> None:
            """Apply hang and offline (only called when one of them is on)."""
            if self._p["hang"]:
                self._hung += 1
                try:
                    while self._p["hang"]:
                        await self._resume.wait()
                finally:
                    self._hung -= 1
            if self._p["offline"]:
                self.errors_injected += 1
                raise FUSEError(errno.EIO)

        async def _meta(self) -> None:
            if self._faulty:
                await self._gate()
            self.meta_ops += 1
            delay = self._p["meta_latency_ms"]
            if delay > 0:
                await self._timer.sleep_until(time.monotonic() + delay / 1000)

        async def _serve(self, ino: int, off: int, size: int) -> None:
            """Charge one data request: wait for a slot, service time, then the link.

            Slots and link are virtual clocks (a heap of slot-free times, one link-free
            time), so the charge is one sleep and scheduling delays never accumulate.
            """
            p = self._p
            now = time.monotonic()
            if self._last_end.get(ino) == off:
                svc = p["seq_latency_ms"]
                self.seq_ops += 1
            else:
                svc = p["latency_ms"]
                jit = min(p["jitter_ms"], svc)
                if jit > 0:
                    svc += self._rng.uniform(-jit, jit)
                self.random_ops += 1
            if size:
                self._last_end[ino] = off + size
            start = self._slot_free[0]                # earliest free slot, FIFO
            if start < now:
                start = now
            done = start + svc / 1000
            bw = p["bandwidth_mbs"]
            if bw > 0 and size:
                if self._link_free > done:
                    done = self._link_free              # queue on the shared link
                done += size / (bw * 1e6)
                self._link_free = done
            heapq.heapreplace(self._slot_free, done)  # the slot is held until done
            self.queue_s += start - now
            self.service_s += done - start
            if self._inflight == 0:
                self._busy_since = now
            self._inflight += 1
            if self._inflight > self.max_inflight:
                self.max_inflight = self._inflight
            try:
                await self._timer.sleep_until(done)
            finally:
                self._inflight -= 1
                if self._inflight == 0:
                    self.busy_s += time.monotonic() - self._busy_since

        def _fault(self, fraction: float, err: int) -> None:
            if fraction > 0 and self._rng.random() < fraction:
                self.errors_injected += 1
                raise FUSEError(err)

        # ---------------------------------------------------------------- inodes
        def _ino(self, st_ino: int) -> int:
            """SOURCE st_ino -> FUSE inode (the root and inode 1 swap places)."""
            if st_ino == self._src_ino:
                return ROOT_INODE
            if st_ino == ROOT_INODE:
                return self._src_ino
            return st_ino

        def _path(self, ino: int) -> bytes:
            if ino == ROOT_INODE:
                return self._src
            entries = self._entries.get(ino)
            if not entries:
                raise FUSEError(errno.ESTALE)
            parent, name = next(iter(entries))
            return self._path(parent) + b"/" + name

        def _target(self, ino: int) -> bytes | int:
            """The path of `ino`, or a descriptor of an open file of it when it has no name
            left (unlinked while open: its xattrs and attributes stay reachable, as on a
            local file system; the kernel asks for security.capability before writes)."""
            try:
                return self._path(ino)
            except FUSEError:
                for f in self._files.values():
                    if f.ino == ino:
                        return f.fd
                raise

        def _child(self, parent: int, name: bytes) -> bytes:
            return self._path(parent) + b"/" + name

        def _attrs(self, st: os.stat_result) -> pyfuse3.EntryAttributes:
            a = pyfuse3.EntryAttributes()
            a.st_ino = self._ino(st.st_ino)
            a.generation = 0
            a.entry_timeout = self._entry_timeout
            a.attr_timeout = self._attr_timeout
            a.st_mode = st.st_mode
            a.st_nlink = st.st_nlink
            a.st_uid = st.st_uid
            a.st_gid = st.st_gid
            a.st_rdev = st.st_rdev
            a.st_size = st.st_size
            a.st_blksize = st.st_blksize
            a.st_blocks = st.st_blocks
            a.st_atime_ns = st.st_atime_ns
            a.st_mtime_ns = st.st_mtime_ns
            a.st_ctime_ns = st.st_ctime_ns
            return a

        def _remember(self, parent: int, name: bytes, st: os.stat_result):
            """Count one lookup of (parent, name) and return its attributes."""
            attrs = self._attrs(st)
            ino = attrs.st_ino
            if ino != ROOT_INODE:
                self._entries.setdefault(ino, {})[(parent, name)] = None
            self._lookups[ino] = self._lookups.get(ino, 0) + 1
            return attrs

        def _drop_entry(self, ino: int, parent: int, name: bytes) -> None:
            entries = self._entries.get(ino)
            if entries is not None:
                entries.pop((parent, name), None)

        def _own(self, path: bytes, parent_path: bytes, ctx, is_symlink: bool = False):
            """Give a new node to the caller, as the kernel would (we run as root)."""
            if os.geteuid() != 0:
                return
            gid = ctx.gid
            if os.stat(parent_path).st_mode & stat.S_ISGID:
                gid = -1                                # inherited from the parent
            os.chown(path, ctx.uid, gid, follow_symlinks=False)

        # ---------------------------------------------------------------- metadata
        async def lookup(self, parent_inode, name, ctx=None):
            await self._meta()
            try:
                st = os.lstat(self._child(parent_inode, name))
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            return self._remember(parent_inode, name, st)

        async def forget(self, inode_list) -> None:
            for ino, nlookup in inode_list:
                left = self._lookups.get(ino, 0) - nlookup
                if left > 0:
                    self._lookups[ino] = left
                else:
                    self._lookups.pop(ino, None)
                    self._entries.pop(ino, None)
                    self._last_end.pop(ino, None)

        async def getattr(self, inode, ctx=None):
            if inode == ROOT_INODE:           # kept alive for the control channel
                self.meta_ops += 1
                st = os.lstat(self._src)
                return self._attrs(st)
            await self._meta()
            try:
                t = self._target(inode)
                st = os.fstat(t) if isinstance(t, int) else os.lstat(t)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            return self._attrs(st)

        async def setattr(self, inode, attr, fields, fh, ctx):
            await self._meta()
            if fields.update_size and self._p["hang_truncate"]:
                self._hung += 1
                try:
                    while self._p["hang_truncate"]:
                        await trio.sleep(0.02)
                finally:
                    self._hung -= 1
            try:
                target = self._files[fh].fd if fh is not None else self._path(inode)
                nofollow = {} if fh is not None else {"follow_symlinks": False}
                if fields.update_size:
                    os.truncate(target, attr.st_size)
                if fields.update_mode:
                    os.chmod(target, stat.S_IMODE(attr.st_mode))
                if fields.update_uid or fields.update_gid:
                    os.chown(target, attr.st_uid if fields.update_uid else -1,
                             attr.st_gid if fields.update_gid else -1, **nofollow)
                if fields.update_atime or fields.update_mtime:
                    st = os.stat(target, **nofollow)
                    atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
                    mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
                    os.utime(target, ns=(atime, mtime), **nofollow)
                st = os.stat(target, **nofollow)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            return self._attrs(st)

        async def readlink(self, inode, ctx):
            await self._meta()
            try:
                return os.readlink(self._path(inode))
            except OSError as exc:
                raise FUSEError(exc.errno) from None

        async def _make(self, parent_inode, name, ctx, make) -> pyfuse3.EntryAttributes:
            await self._meta()
            parent_path = self._path(parent_inode)
            path = parent_path + b"/" + name
            try:
                make(path)
                try:
                    self._own(path, parent_path, ctx)
                    st = os.lstat(path)
                except OSError:
                    _remove(path)
                    raise
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            return self._remember(parent_inode, name, st)

        async def mknod(self, parent_inode, name, mode, rdev, ctx):
            return await self._make(parent_inode, name, ctx,
                                    lambda path: os.mknod(path, mode, rdev))

        async def mkdir(self, parent_inode, name, mode, ctx):
            return await self._make(parent_inode, name, ctx,
                                    lambda path: os.mkdir(path, stat.S_IMODE(mode)))

        async def symlink(self, parent_inode, name, target, ctx):
            return await self._make(parent_inode, name, ctx,
                                    lambda path: os.symlink(target, path))

        async def unlink(self, parent_inode, name, ctx):
            await self._meta()
            path = self._child(parent_inode, name)
            try:
                st = os.lstat(path)
                os.unlink(path)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            self._drop_entry(self._ino(st.st_ino), parent_inode, name)

        async def rmdir(self, parent_inode, name, ctx):
            await self._meta()
            path = self._child(parent_inode, name)
            try:
                st = os.lstat(path)
                os.rmdir(path)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            self._drop_entry(self._ino(st.st_ino), parent_inode, name)

        async def rename(self, parent_old, name_old, parent_new, name_new, flags, ctx):
            await self._meta()
            old = self._child(parent_old, name_old)
            new = self._child(parent_new, name_new)
            try:
                moved = self._ino(os.lstat(old).st_ino)
                try:
                    replaced = self._ino(os.lstat(new).st_ino)
                except FileNotFoundError:
                    replaced = None
                if flags:
                    _renameat2(old, new, flags)
                else:
                    os.rename(old, new)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            self._drop_entry(moved, parent_old, name_old)
            if replaced is not None:
                self._drop_entry(replaced, parent_new, name_new)
                if flags & pyfuse3.RENAME_EXCHANGE and replaced in self._entries:
                    self._entries[replaced][(parent_old, name_old)] = None
            if moved in self._entries:
                self._entries[moved][(parent_new, name_new)] = None

        async def link(self, inode, new_parent_inode, new_name, ctx):
            await self._meta()
            path = self._child(new_parent_inode, new_name)
            try:
                os.link(self._path(inode), path, follow_symlinks=False)
                st = os.lstat(path)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            return self._remember(new_parent_inode, new_name, st)

        async def statfs(self, ctx):
            await self._meta()
            try:
                sv = os.statvfs(self._src)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            out = pyfuse3.StatvfsData()
            for key in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                        "f_files", "f_ffree", "f_favail", "f_namemax"):
                setattr(out, key, getattr(sv, key))
            return out

        # ---------------------------------------------------------------- files
        def _fileinfo(self, fd: int, ino: int) -> pyfuse3.FileInfo:
            fh = next(self._next_fh)
            self._files[fh] = OpenFile(fd, ino)
            # direct_io: the emulator mount's page cache must never absorb a request (unless
            # asked: shared mappings, such as SQLite's WAL index, need the page cache).
            return pyfuse3.FileInfo(fh=fh, direct_io=not self._p["page_cache"],
                                    keep_cache=False)

        async def open(self, inode, flags, ctx):
            await self._meta()
            try:
                fd = os.open(self._path(inode), flags & _OPEN_MASK)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            return self._fileinfo(fd, inode)

        async def create(self, parent_inode, name, mode, flags, ctx):
            await self._meta()
            parent_path = self._path(parent_inode)
            path = parent_path + b"/" + name
            try:
                fd = os.open(path, (flags & _OPEN_MASK) | os.O_CREAT, stat.S_IMODE(mode))
                try:
                    self._own(path, parent_path, ctx)
                    st = os.fstat(fd)
                except OSError:
                    os.close(fd)
                    _remove(path)
                    raise
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            attrs = self._remember(parent_inode, name, st)
            return self._fileinfo(fd, attrs.st_ino), attrs

        async def read(self, fh, off, size):
            f = self._files[fh]
            if self._faulty:
                await self._gate()
            await self._serve(f.ino, off, size)
            self._fault(self._p["eio"], errno.EIO)
            try:
                data = os.pread(f.fd, size, off)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            self.read_ops += 1
            self.read_bytes += len(data)
            return data

        async def write(self, fh, off, buf):
            f = self._files[fh]
            if self._faulty:
                await self._gate()
            await self._serve(f.ino, off, len(buf))
            self._fault(self._p["eio"], errno.EIO)
            self._fault(self._p["enospc"], errno.ENOSPC)
            try:
                n = os.pwrite(f.fd, buf, off)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            self.write_ops += 1
            self.write_bytes += n
            return n

        async def flush(self, fh):
            pass

        async def release(self, fh):
            f = self._files.pop(fh, None)
            if f is not None:
                try:
                    os.close(f.fd)
                except OSError as exc:
                    raise FUSEError(exc.errno) from None

        async def fsync(self, fh, datasync):
            f = self._files[fh]
            if self._faulty:
                await self._gate()
            await self._serve(f.ino, -1, 0)     # one random-access service time
            self._fault(self._p["eio"], errno.EIO)
            try:
                await trio.to_thread.run_sync(os.fdatasync if datasync else os.fsync, f.fd)
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            self.fsync_ops += 1

        # ---------------------------------------------------------------- directories
        async def opendir(self, inode, ctx):
            await self._meta()
            try:
                snapshot = []
                with os.scandir(self._path(inode)) as it:
                    for entry in it:
                        try:
                            snapshot.append((os.fsencode(entry.name),
                                             entry.stat(follow_symlinks=False)))
                        except FileNotFoundError:
                            pass
            except OSError as exc:
                raise FUSEError(exc.errno) from None
            fh = next(self._next_fh)
            self._dirs[fh] = (inode, snapshot)
            return fh

        async def readdir(self, fh, start_id, token):
            await self._meta()
            inode, snapshot = self._dirs[fh]
            for i in range(start_id, len(snapshot)):
                name, st = snapshot[i]
                if not pyfuse3.readdir_reply(token, name, self._attrs(st), i + 1):
                    break
                self._remember(inode, name, st)

        async def releasedir(self, fh):
            self._dirs.pop(fh, None)

        async def fsyncdir(self, fh, datasync):
            await self._meta()

        # ---------------------------------------------------------------- xattrs
        async def getxattr(self, inode, name, ctx):
            if inode == ROOT_INODE and name.startswith(CONTROL_PREFIX):
                if name == XATTR_STATS.encode():
                    return json.dumps(self.statistics(), sort_keys=True).encode()
                raise FUSEError(pyfuse3.ENOATTR)
            await self._meta()
            try:
                t = self._target(inode)
                return os.getxattr(t, name, **_nofollow(t))
            except OSError as exc:
                raise FUSEError(_xattr_errno(exc)) from None

        async def setxattr(self, inode, name, value, ctx):
            if inode == ROOT_INODE and name.startswith(CONTROL_PREFIX):
                if name == XATTR_RESET.encode():
                    self.reset()
                    return
                if name == XATTR_SET.encode():
                    try:
                        self.apply(parse_assignments(os.fsdecode(value).split()))
                    except ValueError as exc:
                        log.warning("rejected control request: %s", exc)
                        raise FUSEError(errno.EINVAL) from None
                    return
                raise FUSEError(errno.EPERM)
            await self._meta()
            try:
                t = self._target(inode)
                os.setxattr(t, name, value, **_nofollow(t))
            except OSError as exc:
                raise FUSEError(_xattr_errno(exc)) from None

        async def listxattr(self, inode, ctx):
            await self._meta()
            try:
                t = self._target(inode)
                names = os.listxattr(t, **_nofollow(t))
            except OSError as exc:
                raise FUSEError(_xattr_errno(exc)) from None
            out = [os.fsencode(n) for n in names]
            if inode == ROOT_INODE:
                out = [n for n in out if not n.startswith(CONTROL_PREFIX)]
            return out

        async def removexattr(self, inode, name, ctx):
            if inode == ROOT_INODE and name.startswith(CONTROL_PREFIX):
                raise FUSEError(pyfuse3.ENOATTR)
            await self._meta()
            try:
                t = self._target(inode)
                os.removexattr(t, name, **_nofollow(t))
            except OSError as exc:
                raise FUSEError(_xattr_errno(exc)) from None

    return SlowOperations


def _nofollow(target) -> dict:
    """xattr calls on a path do not follow a symlink; on a descriptor there is none."""
    return {} if isinstance(target, int) else {"follow_symlinks": False}


# O_APPEND would make pwrite ignore the kernel's offsets; O_DIRECT is the client's
# business (the mount is direct_io anyway) and SOURCE may not support it.
_OPEN_MASK = ~(os.O_APPEND | os.O_DIRECT | os.O_CREAT | os.O_EXCL | os.O_NOCTTY)


def _xattr_errno(exc: OSError) -> int:
    # ENOSYS would make the kernel stop sending xattr requests, control channel included.
    return errno.EOPNOTSUPP if exc.errno == errno.ENOSYS else (exc.errno or errno.EIO)


def _remove(path: bytes) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError:
        pass


_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]
_AT_FDCWD = -100


def _renameat2(old: bytes, new: bytes, flags: int) -> None:
    if _libc.renameat2(_AT_FDCWD, old, _AT_FDCWD, new, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# --------------------------------------------------------------------------- daemon

def _raise_max_background(mountpoint: str, value: int) -> None:
    """Let more than the kernel's default 12 async (aio/readahead) requests reach us.

    Best effort, root only: /sys/fs/fuse/connections/<minor>/max_background. The device
    number comes from mountinfo, since stat() on the mount would wait for our own loop.
    """
    target = os.path.abspath(mountpoint)
    try:
        with open("/proc/self/mountinfo", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if fields[4] == target:
                    conn = f"/sys/fs/fuse/connections/{fields[2].split(':')[1]}"
            with open(f"{conn}/max_background", "w") as out:
                out.write(str(value))
            with open(f"{conn}/congestion_threshold", "w") as out:
                out.write(str(max(1, value * 3 // 4)))
    except (OSError, NameError, IndexError) as exc:
        log.info("kernel max_background left at its default of 12 (is fusectl mounted on "
                 "/sys/fs/fuse/connections? %s)", exc)


def run_daemon(source: str, mountpoint: str, params: dict[str, float], debug: bool,
               max_background: int = 64) -> int:
    import pyfuse3

    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s slowfs[%(process)d] %(levelname)s %(message)s")
    os.umask(0)                  # the kernel already applied the caller's umask
    ops = _make_operations()(source, params)
    options = set(pyfuse3.default_options)
    options |= {"fsname=slowfs", "subtype=slowfs"}
    if os.geteuid() == 0:
        options.add("allow_other")
    if debug:
        options.add("debug")
    pyfuse3.init(ops, mountpoint, options)
    log.info("mounted %s on %s", source, mountpoint)
    _raise_max_background(mountpoint, max_background)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(ops._timer.run)
            nursery.start_soon(_signals)
            # Many tasks: hung or queued requests each hold one, and the control
            # channel must still find a free reader.
            await pyfuse3.main(min_tasks=1, max_tasks=512)
            nursery.cancel_scope.cancel()

    async def _signals() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("signal %d: unmounting", signum)
                pyfuse3.terminate()
                return

    clean = False
    try:
        trio.run(main)
        clean = True
    finally:
        pyfuse3.close(unmount=True)
        log.info("unmounted %s%s", mountpoint, "" if clean else " after an error")
    return 0


def spawn_detached(argv_rest: list[str], mountpoint: str, log_path: str | None) -> int:
    """Start the foreground daemon in its own session; return once the mount is usable."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from slowfs_client import MountError, wait_ready

    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="slowfs-", suffix=".log")
        os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "mount", "-f"] + argv_rest
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True)
    try:
        wait_ready(mountpoint, proc, timeout_s=15)
    except MountError as exc:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        sys.stderr.write(tail)
        print(f"slowfs: {exc}", file=sys.stderr)
        return 1
    print(f"slowfs mounted on {mountpoint} (pid {proc.pid}, log {log_path})")
    return 0


# --------------------------------------------------------------------------- CLI

class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):           # one sentence, exit 2, no usage dump
        raise _Usage(message)


def _param_type(key: str):
    def convert(text: str) -> float:
        try:
            return check_value(key, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = key
    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="slowfs.py", description="slow-BACKING emulator (FUSE)")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    m = sub.add_parser("mount", help="mount SOURCE on MOUNTPOINT through the slow model")
    m.add_argument("-f", "--foreground", action="store_true",
                   help="run the daemon in the foreground")
    m.add_argument("--log", help="daemon log file when not in the foreground")
    m.add_argument("--debug", action="store_true", help="debug logging (and FUSE debug)")
    m.add_argument("--max-background", type=int, default=64, metavar="N",
                   help="kernel limit on async requests in flight to the daemon "
                        "(default 64; the kernel's own default is 12)")
    for key, p in PARAMS.items():
        m.add_argument("--" + key.replace("_", "-"), dest=key, type=_param_type(key),
                       default=None, metavar="N",
                       help=f"{p.doc} (default {p.default:g})")
    m.add_argument("source", metavar="SOURCE")
    m.add_argument("mountpoint", metavar="MOUNTPOINT")
    s = sub.add_parser("stats", help="print the daemon's counters as JSON")
    s.add_argument("mountpoint", metavar="MOUNTPOINT")
    t = sub.add_parser("set", help="change parameters/faults: key=value ...")
    t.add_argument("mountpoint", metavar="MOUNTPOINT")
    t.add_argument("assignments", nargs="+", metavar="KEY=VALUE")
    r = sub.add_parser("reset", help="zero the counters")
    r.add_argument("mountpoint", metavar="MOUNTPOINT")
    return parser


def _check_mount_args(source: str, mountpoint: str) -> None:
    if not os.path.isdir(source):
        raise _Usage(f"SOURCE {source!r} is not a directory")
    if not os.path.isdir(mountpoint):
        raise _Usage(f"MOUNTPOINT {mountpoint!r} is not a directory")
    src, mnt = os.path.realpath(source), os.path.realpath(mountpoint)
    if mnt == src or mnt.startswith(src.rstrip("/") + "/"):
        raise _Usage(f"MOUNTPOINT {mountpoint!r} must not be inside SOURCE {source!r}")
    if os.path.ismount(mnt):
        raise _Usage(f"MOUNTPOINT {mountpoint!r} is already a mount point")


def _control(cmd: str, mountpoint: str, assignments: list[str]) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import slowfs_client

    try:
        if cmd == "stats":
            print(json.dumps(slowfs_client.stats(mountpoint), indent=2, sort_keys=True))
        elif cmd == "set":
            params = parse_assignments(assignments)
            slowfs_client.set(mountpoint, **params)
        else:
            slowfs_client.reset(mountpoint)
    except ValueError as exc:
        raise _Usage(str(exc)) from None
    except OSError as exc:
        raise _Usage(f"{mountpoint!r} is not a reachable slowfs mount "
                     f"({os.strerror(exc.errno) if exc.errno else exc}); for `set`, the "
                     f"daemon log names a rejected value") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
        if args.cmd != "mount":
            return _control(args.cmd, args.mountpoint, getattr(args, "assignments", []))
        _check_mount_args(args.source, args.mountpoint)
        params = {k: getattr(args, k) for k in PARAMS if getattr(args, k) is not None}
        if args.foreground:
            return run_daemon(args.source, args.mountpoint, params, args.debug,
                              args.max_background)
        return spawn_detached(argv[1:], args.mountpoint, args.log)
    except _Usage as exc:
        print(f"slowfs: {str(exc).rstrip('.')}.", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
