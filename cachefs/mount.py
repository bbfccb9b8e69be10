"""Mount lifecycle: validation, cache directory, recovery, the trio nursery, pyfuse3, signals,
shutdown.

Order at start: validate options and paths (UserError for every user mistake), lock the cache
directory, open the store and load the extent map, start services, mount FUSE, then report
ready (to the waiting `cachefs mount`, and to systemd). Order at stop: the FUSE loop ends ->
services stop -> a durable commit of all metadata (shielded) -> the store closes clean.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import resource
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
from typing import Callable

import pyfuse3
import trio

from .backing import Backing, open_root
from .cache import Cache
from .config import EXT_SIZE, Config, dirty_marks, format_size
from .control import ControlServer
from .errors import CommandFailed, UserError
from .fs import Operations
from .inodes import InodeTable
from .stats import Stats
from .store import MetadataStore
from .warm import Warm

log = logging.getLogger("cachefs")

MIN_FREE_FRACTION = 0.10


def _inside(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def check_paths(cfg: Config) -> None:
    """Every mistake in BACKING, MOUNTPOINT and the cache directory, as a sentence."""
    cfg.validate()
    for what, path in (("BACKING", cfg.backing), ("MOUNTPOINT", cfg.mountpoint)):
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                raise UserError(f"{what} {path} is a dead FUSE mount (transport endpoint is "
                                f"not connected); run fusermount3 -u {path} first.") from None
        if not os.path.exists(path):
            raise UserError(f"{what} {path} does not exist.")
        if not os.path.isdir(path):
            raise UserError(f"{what} {path} is not a directory.")
    if os.path.ismount(cfg.mountpoint) and _is_fuse_mount(cfg.mountpoint):
        raise UserError(f"MOUNTPOINT {cfg.mountpoint} is already mounted "
                        "(unmount it first with cachefs umount).")
    if _inside(cfg.backing, cfg.mountpoint) or _inside(cfg.mountpoint, cfg.backing):
        raise UserError(f"BACKING {cfg.backing} and MOUNTPOINT {cfg.mountpoint} must not "
                        "contain each other.")
    for what, path in (("BACKING", cfg.backing), ("MOUNTPOINT", cfg.mountpoint)):
        if _same(cfg.cache_dir, path):
            raise UserError(f"the cache directory {cfg.cache_dir} is {what} itself; it must "
                            "be a directory of its own on the fast local disk.")
        if _inside(cfg.cache_dir, path):
            raise UserError(f"the cache directory {cfg.cache_dir} is inside {what} {path}; "
                            "it must be on the fast local disk, outside both.")
        if _inside(path, cfg.cache_dir):
            raise UserError(f"{what} {path} is inside the cache directory {cfg.cache_dir}; "
                            "the cache directory must be a directory of its own, apart "
                            "from both.")
    if os.path.exists(cfg.cache_dir) and not os.path.isdir(cfg.cache_dir):
        raise UserError(f"the cache directory {cfg.cache_dir} is not a directory.")
    if not os.path.exists("/dev/fuse"):
        raise UserError("/dev/fuse does not exist: load the fuse kernel module "
                        "(modprobe fuse) or run where FUSE is available.")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise UserError("no permission to open /dev/fuse: run as root or add the user to "
                        "the group that owns /dev/fuse.")
    if shutil.which("fusermount3") is None and os.geteuid() != 0:
        raise UserError("fusermount3 is not installed (apt-get install fuse3).")


def _is_fuse_mount(path: str) -> bool:
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and _unescape(fields[1]) == real:
                    return True
    except OSError:
        return True
    return False


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def prepare_cache_dir(cfg: Config, data_files: bool = True) -> None:
    """Create the cache directory (and data/) if needed and make it private (make_private;
    `data_files=False` leaves the data files to the daemon's own call)."""
    try:
        os.makedirs(cfg.cache_dir, mode=0o700, exist_ok=True)
        os.makedirs(os.path.join(cfg.cache_dir, "data"), mode=0o700, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the cache directory {cfg.cache_dir}: "
                        f"{exc.strerror}.") from None
    if not os.access(cfg.cache_dir, os.W_OK):
        raise UserError(f"the cache directory {cfg.cache_dir} is not writable.")
    make_private(cfg.cache_dir, data_files)


# Files of the cache directory besides data/ (SQLite gives -wal and -shm the mode of the
# database file, so that one is created 0600 before SQLite opens it: see MetadataStore).
PRIVATE_FILES = ("cachefs.db", "cachefs.db-wal", "cachefs.db-shm", "cachefs.log", "lock",
                 "doubt.log", "doubt.log.prev", "control.sock", "reserve")


def make_private(cache_dir: str, data_files: bool = True) -> None:
    """The cache directory holds BACKING's paths, sizes and data: only the daemon's user
    may read it. The directory, data/ and its subdirectories become 0700 (also when they
    existed with wider modes) and every file of ours loses its group and other bits. Files
    created later are private by their creation mode (the daemon runs with umask 0).

    Raises UserError if a mode cannot be changed (for example, another user owns the
    directory)."""
    data = os.path.join(cache_dir, "data")
    paths = [cache_dir, data, *(os.path.join(cache_dir, name) for name in PRIVATE_FILES)]
    try:
        with os.scandir(data) as it:
            subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        subdirs = []
    paths += subdirs
    if data_files:                      # a stat per data file: milliseconds per thousand
        for sub in subdirs:
            with os.scandir(sub) as it:
                paths += [e.path for e in it
                          if e.is_file(follow_symlinks=False) and e.stat().st_mode & 0o077]
    for path in paths:
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
                continue
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UserError(f"cannot make {path} private to its user (mode 0700 for "
                            f"directories, 0600 for files): {exc.strerror}.") from None


def lock_cache_dir(cache_dir: str) -> int:
    """Take the one-instance-per-cache-dir lock; the fd stays open for the daemon's life."""
    path = os.path.join(cache_dir, "lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"the cache directory {cache_dir} is in use by another cachefs "
                        f"(pid {owner}); one instance may use a cache directory.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def cache_dir_usage(cache_dir: str) -> int:
    """Bytes the cache directory itself occupies on its filesystem (data files, database)."""
    used = 0
    for dirpath, _, names in os.walk(cache_dir):
        for name in names:
            try:
                used += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return used


def cache_capacity(cfg: Config, cached_bytes: int) -> int:
    """The pool size in bytes: --cache-size, or what keeps the cache filesystem 10 % free.

    `cached_bytes` is what cachefs already holds there (cache_dir_usage): it counts as
    free for the pool, so a warm cache keeps every extent across a remount instead of
    shrinking by what it holds.
    """
    sv = os.statvfs(cfg.cache_dir)
    total = sv.f_blocks * sv.f_frsize
    avail = sv.f_bavail * sv.f_frsize
    if cfg.cache_size is not None:
        if cfg.cache_size > total:
            raise UserError(f"--cache-size {format_size(cfg.cache_size)} is larger than the "
                            f"cache filesystem ({format_size(total)}).")
        return cfg.cache_size
    size = avail + cached_bytes - int(total * MIN_FREE_FRACTION)
    if size < 16 * EXT_SIZE:
        raise UserError(f"the cache filesystem of {cfg.cache_dir} has less than "
                        f"{MIN_FREE_FRACTION:.0%} free ({format_size(avail)} available); "
                        "free space or give --cache-size.")
    return size


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state, if it is listening."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(message.encode())


FUSECTL = "/sys/fs/fuse/connections"
MAX_BACKGROUND = 64


def raise_max_background(real_mountpoint: str, limit: int = MAX_BACKGROUND) -> int | None:
    """Let the kernel keep more asynchronous requests (aio, readahead) in flight for this
    mount than its default of 12, so that fast hits are not queued behind slow BACKING
    writes (measured: 70/30 mix, read latency 7.1 ms -> 0.2 ms). Root only, best effort:
    mounts fusectl if needed. Returns the limit set, or None. Reads /proc, never the mount
    itself (a stat of our own mount from the event loop would deadlock)."""
    if os.geteuid() != 0:
        return None
    real = real_mountpoint             # resolved before mounting: realpath would stat us
    dev = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape(fields[4]) == real:
                dev = fields[2].split(":")[1]
    if dev is None:
        return None
    conn = os.path.join(FUSECTL, dev)
    try:
        if not os.path.isdir(conn):
            subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL],
                           capture_output=True, timeout=10)
        with open(os.path.join(conn, "max_background"), "w") as f:
            f.write(str(limit))
        with open(os.path.join(conn, "congestion_threshold"), "w") as f:
            f.write(str(limit * 3 // 4))
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("could not raise the FUSE max_background limit (%s); keeping 12", exc)
        return None
    return limit


def fuse_options(cfg: Config) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts.add(f"fsname={os.path.realpath(cfg.backing)}")
    opts.add("subtype=cachefs")
    if os.geteuid() == 0:
        opts.add("allow_other")
    if cfg.debug:
        opts.add("debug")
    opts.update(cfg.fuse_options)
    return opts


class Daemon:
    """One mounted cachefs: owns the services and their shutdown order."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.stats = Stats()
        self.backing = Backing(cfg.backing_threads, cfg.backing_timeout_s,
                               open_root(cfg.backing))
        self.store = MetadataStore(cfg.cache_dir)
        self.control_path = os.path.join(cfg.cache_dir, "control.sock")
        self.clean_start = True
        self._lifetime_saved: dict[str, int] | None = {}     # None after a failed save
        self.cache: Cache | None = None
        self.ops: Operations | None = None
        self.warm: Warm | None = None

    def open(self) -> None:
        root_st = os.fstat(self.backing.root_fd)
        self.clean_start = self.store.open(os.path.realpath(self.cfg.backing), root_st)
        if not self.clean_start:
            log.warning("the last stop of this cache was not clean; cached data is "
                        "revalidated against BACKING as files are opened")
        self.store.set_meta("mode", self.cfg.mode)
        self.store.ensure_reserve()
        self.stats.set_lifetime_base(*self.store.load_lifetime())
        capacity = cache_capacity(self.cfg, cache_dir_usage(self.cfg.cache_dir)) // EXT_SIZE
        high, low = dirty_marks(self.cfg, capacity * EXT_SIZE)
        self.cfg = dataclasses.replace(self.cfg, dirty_high=high, dirty_low=low)
        self.cache = Cache(self.cfg, self.store, self.backing, self.stats, capacity)
        self.cache.load(self.clean_start)
        if self.cache.dirty:
            log.info("%s of dirty data from an earlier write-back mount will be destaged",
                     format_size(self.cache.dirty_bytes()))
        inodes = InodeTable(root_st)
        self.ops = Operations(self.cfg, self.cache, self.backing, inodes, self.control_path)
        self.warm = Warm(self.cfg, self.cache, self.backing, self.store, self.stats, inodes)
        self.warm.load()
        self.cache.name_listener(self.warm)
        log.info("cache %s: %s for %s, %d extents (%s) warm", self.cfg.cache_dir,
                 format_size(capacity * EXT_SIZE), self.cfg.backing, len(self.cache.pool),
                 format_size(self.cache.used_bytes()))

    async def stats_cmd(self, request: dict, progress) -> dict:
        return {"stats": self.snapshot()}

    def snapshot(self) -> dict:
        d = self.cache.destager
        eta = d.eta_s()
        return {
            "backing": self.cfg.backing, "mountpoint": self.cfg.mountpoint,
            "cache_dir": self.cfg.cache_dir, "mode": self.cfg.mode, "pid": os.getpid(),
            **self.cache.status(), **self.warm.status(), **self.stats.snapshot(),
            "dirty_high": d.high, "dirty_low": d.low, "throttling": d.throttling(),
            "destage_rate": round(d.rate), "eta_s": None if eta is None else round(eta, 1),
            "throttle_delay_s": round(self.stats.throttle_delay_ns / 1e9, 3),
            "last_destage_error": d.last_error,
            "lifetime": self.stats.lifetime_snapshot(),
        }

    async def flush_cmd(self, request: dict, progress) -> dict:
        """Destage everything; progress lines every half second; fails with the reason."""
        timeout = request.get("timeout")
        await self.cache.destager.flush(timeout, progress)
        return {"dirty_bytes": 0}

    async def drop_cmd(self, request: dict, progress) -> dict:
        """Evict clean data; pinned files keep theirs unless `pinned` (then pins go too)."""
        pinned = 0
        if request.get("pinned"):
            pinned = self.warm.unpin_all("cachefs-ctl drop --pinned")
        n = self.cache.drop_clean()
        if pinned:
            self.stats.dropped_pinned += pinned
        log.info("cachefs-ctl drop: %d clean extents dropped (%d of them pinned)%s", n,
                 pinned, "" if request.get("pinned") else
                 f"; {self.warm.status()['pinned_files']} pinned files keep their data")
        await self.cache.persist()
        return {"dropped_extents": n, "dropped_bytes": n * EXT_SIZE,
                "dropped_pinned_extents": pinned, **self.warm.status()}

    async def prefetch_cmd(self, request: dict, progress) -> dict:
        return await self.warm.prefetch(_paths(request), progress)

    async def pin_cmd(self, request: dict, progress) -> dict:
        return await self.warm.pin(_paths(request), progress)

    async def unpin_cmd(self, request: dict, progress) -> dict:
        return await self.warm.unpin(_paths(request))

    async def pid_cmd(self, request: dict, progress) -> dict:
        return {"pid": os.getpid()}

    async def serve(self, ready: Callable[[str | None], None]) -> None:
        control = ControlServer(self.control_path, {
            "stats": self.stats_cmd, "drop": self.drop_cmd, "pid": self.pid_cmd,
            "flush": self.flush_cmd, "prefetch": self.prefetch_cmd, "pin": self.pin_cmd,
            "unpin": self.unpin_cmd})
        mounted = False
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(control.run)
                await nursery.start(self.cache.run_readahead)
                await nursery.start(self.cache.run_promoter)
                await nursery.start(self.cache.persister.run)
                await nursery.start(self.ops.run_invalidator)
                await nursery.start(self.ops.run_closer)
                await nursery.start(self.cache.destager.run)
                await nursery.start(self.warm.run)
                await nursery.start(self._run_lifetime_saver)
                if self.cache.dirty and not self.cache.write_back:
                    await self._destage_before_write_through()
                real_mountpoint = os.path.realpath(self.cfg.mountpoint)   # before mounting
                try:
                    pyfuse3.init(self.ops, self.cfg.mountpoint, fuse_options(self.cfg))
                except RuntimeError as exc:
                    raise UserError(f"mounting {self.cfg.mountpoint} failed ({exc}); libfuse "
                                    "says why above (an unknown -o option, a busy or "
                                    "unusable mountpoint).") from None
                mounted = True
                if raise_max_background(real_mountpoint):
                    log.info("FUSE max_background raised to %d", MAX_BACKGROUND)
                nursery.start_soon(self._signals)
                ready(None)
                sd_notify("READY=1")
                log.info("mounted %s on %s (%s)", self.cfg.backing, self.cfg.mountpoint,
                         self.cfg.mode)
                await _fuse_main()
                nursery.cancel_scope.cancel()
        finally:
            if mounted:
                pyfuse3.close(unmount=True)
            clean = True
            with trio.CancelScope(shield=True):
                sd_notify("STOPPING=1")
                try:
                    await self.cache.persist(durable=True)
                except OSError as exc:
                    clean = False
                    log.error("the last metadata commit failed (%s); the next mount "
                              "recovers as after a crash", exc)
            self._save_lifetime()
            try:
                self.store.close(clean=clean)
            except sqlite3.Error as exc:
                clean = False
                log.error("closing the metadata database failed (%s); the next mount "
                          "recovers as after a crash", exc)
            if clean:
                log.info("unmounted %s; metadata persisted", self.cfg.mountpoint)

    async def _run_lifetime_saver(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Save the lifetime totals every commit interval in which a counter moved (a
        kill -9 loses at most one interval of them); unmount saves the final ones."""
        task_status.started()
        while True:
            await trio.sleep(self.cfg.commit_interval_s)
            totals = self.stats.lifetime()
            if totals != self._lifetime_saved:
                # In the store's thread, after any commit in flight: never on the event loop.
                await self.store.run_async(self._save_lifetime, totals)

    def _save_lifetime(self, totals: dict[str, int] | None = None) -> None:
        if totals is None:
            totals = self.stats.lifetime()
        if totals == self._lifetime_saved:
            return
        try:
            self.store.save_lifetime(totals)
        except sqlite3.Error as exc:           # statistics never stop the mount
            if self._lifetime_saved is not None:
                log.warning("could not save the lifetime statistics (%s); retrying", exc)
            self._lifetime_saved = None
            return
        self._lifetime_saved = totals

    async def _destage_before_write_through(self) -> None:
        log.info("destaging %s of write-back data before mounting in write-through mode",
                 format_size(self.cache.dirty_bytes()))
        try:
            await self.cache.destager.flush(None)
        except CommandFailed as exc:
            raise UserError(f"cannot mount in write-through mode: {exc} Mount in "
                            "write-back mode or repair BACKING.") from None

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for signum in sigs:
                log.info("signal %d: unmounting", signum)
                pyfuse3.terminate()
                return


def _paths(request: dict) -> list[str]:
    paths = request.get("paths")
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise CommandFailed("give one or more paths under the mount.")
    return paths


async def _fuse_main() -> None:
    """pyfuse3's main loop. The kernel ends the FUSE connection with ENODEV at an unmount
    (pyfuse3 returns), but with ECONNABORTED when it was aborted (echo 1 > .../abort under
    /sys/fs/fuse/connections, or a kernel timeout, for a file system that asked for abort
    errors), which pyfuse3 raises: the session is over all the same, and cachefs shuts down
    cleanly rather than end with a traceback."""
    try:
        await pyfuse3.main()
    except ConnectionAbortedError:
        log.warning("the kernel aborted the FUSE connection; shutting down")


def raise_fd_limit() -> int:
    """Raise the soft limit of open descriptors to the hard limit (trio uses epoll, so no
    select() limit applies): every open handle holds one or two BACKING descriptors.
    Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.info("could not raise the open file limit from %d to %d: %s", soft, hard, exc)
    return soft


def run(cfg: Config, ready: Callable[[str | None], None]) -> int:
    """Run a mount in this process until it is unmounted; returns the exit status."""
    try:
        check_paths(cfg)
        raise_fd_limit()
        prepare_cache_dir(cfg)
        lock_fd = lock_cache_dir(cfg.cache_dir)
        daemon = Daemon(cfg)
        daemon.open()
    except UserError as exc:
        ready(str(exc))
        raise
    os.umask(0)
    try:
        trio.run(daemon.serve, ready)
    except UserError as exc:
        ready(str(exc))
        raise
    finally:
        os.close(lock_fd)
    return 0
