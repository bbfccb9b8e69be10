"""Mount lifecycle: validation, cache directory, recovery, the trio nursery, pyfuse3, signals,
shutdown.

Order at start: validate options and paths (UserError for every user mistake), lock the cache
directory, open the store and load the extent map, start services, mount FUSE, then report
ready (to the waiting `cachefs mount`, and to systemd). Order at stop: the FUSE loop ends ->
services stop -> a durable commit of all metadata (shielded) -> the store closes clean.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from typing import Callable

import pyfuse3
import trio

from . import integrity, oplog
from . import mounttable
from .backing import LOCAL_FS_TYPES, Backing
from .backingpaths import open_root
from .cache import Cache
from .config import EXT_SIZE, Config, dirty_marks, format_size
from .control import ControlServer, register, unregister
from .controlpath import socket_path
from .errors import BackingTimeout, CommandFailed, InvariantError, UserError
from .fs import Operations
from .handles import FD_RESERVE, FDS_PER_HANDLE
from .health import BackingHealth
from .history import MAX_WINDOW_S, History
from .inodes import InodeTable
from .metrics import MetricsServer, bind
from .openmode import FUSE_SUPER_MAGIC, fuse_device
from .preflight import (cache_capacity, cache_dir_usage, check_paths, lock_cache_dir,
                        lock_mountpoint, memory_warning, prepare_cache_dir, raise_fd_limit,
                        room_warning, volatile_cache_warning)
from .startup import USER_MISTAKE, Progress, sd_notify
from .stats import Stats
from .statx import fs_type, mount_id
from .store import MetadataStore
from .verify import Verifier
from .warm import Warm

log = logging.getLogger("cachefs")

# ready(None, warnings) once mounted, ready(why) when the mount failed before that.
Ready = Callable[..., None]


FUSECTL = "/sys/fs/fuse/connections"
FD_LIMIT_WARN = 1024        # a descriptor limit below this is said at mount
MAX_BACKGROUND = 64
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def raise_max_background(real_mountpoint: str, limit: int = MAX_BACKGROUND) -> int | None:
    """Let the kernel keep more asynchronous requests (aio, readahead) in flight for this
    mount than its default of 12, so that fast hits are not queued behind slow BACKING
    writes (measured: 70/30 mix, read latency 7.1 ms -> 0.2 ms). Root only, best effort:
    mounts fusectl if needed. Returns the limit set, or None. Reads /proc, never the mount
    itself (a stat of our own mount from the event loop would deadlock)."""
    if os.geteuid() != 0:
        return None
    # resolved before mounting: realpath would stat us
    dev = mounttable.device_of(real_mountpoint)
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


def fsname(path: str) -> str:
    """BACKING's path as the mount's source (/proc/mounts, df): pyfuse3 passes options as
    ASCII and libfuse splits them at commas, so a BACKING named with any other letter
    (`/srv/données`) or a comma failed to mount. Bytes outside printable ASCII and `%`
    are written %XX, a comma and a backslash are escaped for libfuse."""
    out = []
    for b in os.fsencode(path):
        c = chr(b)
        if b < 0x20 or b > 0x7E or c == "%":
            out.append(f"%{b:02X}")
        elif c in ",\\":
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)


def fuse_options(cfg: Config) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts.add(f"fsname={fsname(os.path.realpath(cfg.backing))}")
    opts.add("subtype=cachefs")
    if os.geteuid() == 0:
        opts.add("allow_other")
    # --debug traces requests in cachefs's own log (trace.py); libfuse's raw trace on
    # stderr is `-o debug`, passed through like any FUSE option.
    opts.update(cfg.fuse_options)
    return opts


def resident_bytes() -> int | None:
    """The daemon's resident memory (RSS), None where /proc does not tell."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


class Daemon:
    """One mounted cachefs: owns the services and their shutdown order."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.stats = Stats()
        self.progress = Progress(None)       # run() gives the one the waiters hear
        self.mountpoint_lock: int | None = None   # preflight.lock_mountpoint's, until mounted
        self._backing_moved = False          # BACKING's path leads elsewhere (_check_backing_path)
        root = open_root(cfg.backing)
        try:
            local = LOCAL_FS_TYPES.get(fs_type(root))
        except OSError:
            local = None
        self.backing = Backing(cfg.backing_threads, cfg.backing_timeout_s, root,
                               BackingHealth(self.stats), inline=local is not None)
        log.info("BACKING is %s", f"on a local {local} filesystem: its metadata calls run "
                 "on the event loop" if local else "not on a local filesystem: every call "
                 "runs in a worker thread, with timeouts for reads")
        self.warnings: list[str] = []       # logged, and said by the waiting `cachefs mount`
        volatile = volatile_cache_warning(cfg)
        if volatile:
            self._warn(volatile)
        self.store = MetadataStore(cfg.cache_dir)
        self.control_path = socket_path(cfg.cache_dir, cfg.stats_group)
        self.clean_start = True
        self._lifetime_saved: dict[str, int] | None = {}     # None after a failed save
        self.cache: Cache | None = None
        self.ops: Operations | None = None
        self._terminating = False       # a signal ended the session: files may be open still
        self.warm: Warm | None = None
        self.metrics: MetricsServer | None = None
        self.history: History | None = None

    def _warn(self, text: str) -> None:
        self.warnings.append(text)
        log.warning("%s", text[0].upper() + text[1:])

    def open(self) -> None:
        if self.cfg.metrics is not None:      # a port in use is found before the slow part
            self.metrics = MetricsServer(bind(self.cfg.metrics), self.snapshot)
        root_st = os.fstat(self.backing.root_fd)
        self.store.backing_mount = mount_id(self.backing.root_fd)
        self.clean_start = self.store.open(os.path.realpath(self.cfg.backing), root_st,
                                           self.cfg.discard_dirty)
        if not self.clean_start:
            log.warning("the last stop of this cache was not clean; cached data is "
                        "revalidated against BACKING as files are opened")
        self.store.set_meta("mode", self.cfg.mode)
        reserve = self.store.ensure_reserve()
        self.stats.set_lifetime_base(*self.store.load_lifetime())
        held = cache_dir_usage(self.cfg.cache_dir)
        try:
            capacity = cache_capacity(self.cfg, held) // EXT_SIZE
        except UserError:
            # Refused (too little room) after the database was marked in use: it is left as
            # it was, or the next mount took this for an unclean stop (a helper's hunt).
            self.store.close(clean=self.clean_start)
            raise
        for warning in (room_warning(self.cfg, held), memory_warning(capacity)):
            if warning:
                self._warn(warning)
        high, low = dirty_marks(self.cfg, capacity * EXT_SIZE)
        self.cfg = dataclasses.replace(self.cfg, dirty_high=high, dirty_low=low)
        self.cache = Cache(self.cfg, self.store, self.backing, self.stats, capacity)
        if not reserve:                     # no room for it: the SSD counts as full
            self.cache.state.reserve_given_up()
        pool = self.cache.state.pool
        self.progress.phase(lambda: f"loading the extent map: {len(pool)} extents",
                            lambda: len(pool))
        try:
            self.cache.load(self.clean_start, self._renumbered(root_st),
                            self.cfg.discard_dirty)
        except UserError:
            self.store.close(clean=self.clean_start)
            raise
        self.store.record_backing(root_st)
        if self.cache.dirty:
            log.info("%s of dirty data from an earlier mount (write-back, or written by a "
                     "shared mapping in passthrough) will be destaged",
                     format_size(self.cache.dirty_bytes()))
        inodes = InodeTable(root_st)
        self.ops = Operations(self.cfg, self.cache, inodes, self.control_path)
        self.warm = Warm(self.cfg, self.cache, self.backing, self.store, self.stats, inodes)
        self.warm.load()
        self.cache.name_listener(self.warm)
        self.verifier = Verifier(self.cache, self.backing, self.stats)
        integrity.CHECK_READS[0] = self.cfg.read_checksums
        self.cache.modes.verifier = self.verifier.want
        cache = self.cache
        self.history = History(self.stats, lambda: (cache.dirty_bytes(), cache.used_bytes()))
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
            "resident_bytes": resident_bytes(),
            **self.cache.status(), **self.warm.status(), **self.cache.modes.status(),
            **self.stats.snapshot(),
            "dirty_high": d.high, "dirty_low": d.low, "throttling": d.throttling(),
            "destage_rate": round(d.rate), "eta_s": None if eta is None else round(eta, 1),
            "throttle_delay_s": round(self.stats.throttle_delay_ns / 1e9, 3),
            "last_destage_error": d.last_error,
            "backing_health": self.backing.health.snapshot(),
            "lifetime": self.stats.lifetime_snapshot(),
            "windows": self.history.windows(),
        }

    async def history_cmd(self, request: dict, progress) -> dict:
        """The samples of the last `window` seconds (per second up to an hour, per minute
        up to a day), as columns; times are Unix times."""
        window = request.get("window", 3600)
        if isinstance(window, bool) or not isinstance(window, (int, float)) \
                or not 1 <= window <= MAX_WINDOW_S:
            raise CommandFailed(f"the history window is a number of seconds from 1 to "
                                f"{MAX_WINDOW_S}.")
        return {"history": self.history.samples(window, time.time() - trio.current_time())}

    async def flush_cmd(self, request: dict, progress) -> dict:
        """Destage everything; progress lines every half second; fails with the reason."""
        timeout = request.get("timeout")
        await self.cache.modes.settle()     # what mappings wrote is to be destaged too
        await self.cache.destager.flush(timeout, progress)
        return {"dirty_bytes": 0}

    async def drop_cmd(self, request: dict, progress) -> dict:
        """Evict clean data; pinned files keep theirs unless `pinned` (then pins go too)."""
        pinned = 0
        if request.get("pinned"):
            pinned = self.warm.unpin_all("cachefs-ctl drop --pinned")
        skipped = self.stats.drop_skipped_passthrough
        n = self.cache.drop_clean()
        skipped = self.stats.drop_skipped_passthrough - skipped
        if pinned:
            self.stats.dropped_pinned += pinned
        log.info("cachefs-ctl drop: %d clean extents dropped (%d of them pinned)%s", n,
                 pinned, "" if request.get("pinned") else
                 f"; {self.warm.status()['pinned_files']} pinned files keep their data")
        await self.cache.persist()
        return {"dropped_extents": n, "dropped_bytes": n * EXT_SIZE,
                "dropped_pinned_extents": pinned, "kept_passthrough_extents": skipped,
                **self.warm.status()}

    async def prefetch_cmd(self, request: dict, progress) -> dict:
        return await self.warm.prefetch(_paths(request), progress)

    async def pin_cmd(self, request: dict, progress) -> dict:
        return await self.warm.pin(_paths(request), progress)

    async def unpin_cmd(self, request: dict, progress) -> dict:
        return await self.warm.unpin(_paths(request))

    async def verify_cmd(self, request: dict, progress) -> dict:
        """Check cached blocks against their checksums (and BACKING): all, or the files
        under `paths`."""
        inos = None
        if request.get("paths"):
            inos = [t.ino for t in await self.warm.scan(_paths(request))]
        return await self.verifier.verify(inos, bool(request.get("against_backing")),
                                          progress)

    async def pid_cmd(self, request: dict, progress) -> dict:
        return {"pid": os.getpid()}

    async def serve(self, ready: Ready) -> None:
        control = ControlServer(self.control_path, {
            "stats": self.stats_cmd, "drop": self.drop_cmd, "pid": self.pid_cmd,
            "flush": self.flush_cmd, "prefetch": self.prefetch_cmd, "pin": self.pin_cmd,
            "unpin": self.unpin_cmd, "history": self.history_cmd, "verify": self.verify_cmd},
            group=self.cfg.stats_group)
        mounted = unmounted = False     # unmounted: the kernel ended the session
        registered = None
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
                await nursery.start(self.verifier.run)
                await nursery.start(self.verifier.run_scrub, self.cfg.scrub_interval_s,
                                    self.cfg.scrub_rate)
                await nursery.start(self._run_lifetime_saver)
                if self.metrics is not None:
                    await nursery.start(self.metrics.run)
                await nursery.start(self.history.run)
                await nursery.start(self.cache.modes.run)
                nursery.start_soon(self._watch_backing)
                if self.cfg.check_invariants:
                    nursery.start_soon(self._check_invariants)
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
                if self.mountpoint_lock is not None:    # the mount is there: a second
                    os.close(self.mountpoint_lock)      # start is refused by check_paths
                    self.mountpoint_lock = None
                self.cache.mounted_at = real_mountpoint
                registered = register(real_mountpoint, self.control_path)
                self.cache.modes.mounted(fuse_device(real_mountpoint))
                if raise_max_background(real_mountpoint):
                    log.info("FUSE max_background raised to %d", MAX_BACKGROUND)
                nursery.start_soon(self._signals)
                ready(None, self.warnings)
                sd_notify("READY=1")
                log.info("%s", oplog.mount_line(self.snapshot()))
                unmounted = await _fuse_main() and not self._terminating
                nursery.cancel_scope.cancel()
        finally:
            if registered is not None:
                unregister(registered, self.control_path)
            if mounted:
                pyfuse3.close(unmount=True)
            clean = True
            with trio.CancelScope(shield=True):
                sd_notify("STOPPING=1")
                try:
                    if unmounted:
                        self.ops.release_all()
                    await self.cache.modes.settle()
                    await self.cache.persist(durable=True)
                except OSError as exc:
                    clean = False
                    log.error("the last metadata commit failed (%s); the next mount "
                              "recovers as after a crash", exc)
            self._save_lifetime()
            self.backing.health.flush()         # the counts of lines held back
            if self.ops is not None:
                self.ops.flush_log()
            self.cache.state.flush_log()
            summary = oplog.unmount_line(self.snapshot())
            try:
                self.store.close(clean=clean)
            except sqlite3.Error as exc:
                clean = False
                log.error("closing the metadata database failed (%s); the next mount "
                          "recovers as after a crash", exc)
            if clean:
                log.info("%s", summary)

    async def _check_invariants(self) -> None:
        """--check-invariants: the whole extent map against its invariants, twice a second
        (every change is checked as it happens too); a violation ends the daemon."""
        while True:
            await trio.sleep(0.5)
            self.cache.state.map.check()
            self._check_protection()

    def _check_protection(self) -> None:
        """Each inode the eviction policy protects has one holder per owner: passthrough
        (openmode's held files) and warm (pins, loads). A protection no owner holds would
        keep its extents in the pool for good (it happened: a reused inode number). A held
        file detached is not protected: the kernel no longer reads its cache file."""
        want: dict[int, int] = {}
        held = [ino for ino, h in self.cache.modes.held.items() if h.current]
        for ino in (*held, *self.warm.holders()):
            want[ino] = want.get(ino, 0) + 1
        have = self.cache.state.pool.protected
        if have != want:
            wrong = {ino: (have.get(ino, 0), want.get(ino, 0))
                     for ino in set(have) | set(want) if have.get(ino, 0) != want.get(ino, 0)}
            raise InvariantError(f"eviction protection (held, owned) by inode: {wrong}")

    def _renumbered(self, root_st: os.stat_result) -> str | None:
        """Why BACKING's inode numbers may have changed since the last mount, or None: a
        FUSE BACKING whose root has another device number was mounted again, and many
        number their files anew at every mount (CacheState._distrust_numbers). NFS and
        local filesystems keep their numbers (an NFS mount gets a new device too)."""
        before, now = self.store.previous_backing_mount, self.store.backing_mount
        if before not in (None, "None") and now is not None:
            if before == str(now):      # (device numbers are given out again: not these)
                return None
            what = f"mount {before} then, {now} now"
        else:
            before = self.store.previous_backing_dev
            if before is None or before == f"{root_st.st_dev}:{root_st.st_ino}":
                return None
            what = f"device {before.partition(':')[0]} then, {root_st.st_dev} now"
        try:
            if fs_type(self.backing.root_fd) != FUSE_SUPER_MAGIC:
                return None
        except OSError:
            return None
        return f"is a FUSE filesystem mounted again since cachefs last used it ({what})"

    async def _watch_backing(self) -> None:
        """Once a second: is a BACKING write stalled (running past --backing-timeout)? Every
        10 s: does BACKING's path still lead to the directory the daemon opened?"""
        tick = 0
        while True:
            await trio.sleep(1)
            self.backing.health.check_stalls(self.cfg.backing_timeout_s, self.backing.what)
            tick += 1
            if tick % 10 == 0:
                await self._check_backing_path()

    async def _check_backing_path(self) -> None:
        """BACKING unmounted lazily, or another filesystem mounted or a directory renamed
        into its place: the daemon goes on serving, and destaging into, the directory it
        opened (as any program holding a directory does), which nothing said (a helper's
        hunt: fsynced data went with a lazily unmounted tmpfs). One WARNING when the path
        leads elsewhere, one line when it leads back."""
        root = os.fstat(self.backing.root_fd)
        try:
            st = await self.backing.read_call("stat", os.stat, self.cfg.backing)
            moved = (st.st_dev, st.st_ino) != (root.st_dev, root.st_ino)
        except BackingTimeout:              # hung: not known (its health says so)
            return
        except OSError:                     # gone
            moved = True
        if moved and not self._backing_moved:
            log.warning("BACKING's path %s no longer leads to the directory this mount opened "
                        "(unmounted, or another filesystem or directory put in its place): "
                        "cachefs goes on serving and destaging into the directory it opened; "
                        "unmount and mount again to use what the path leads to now",
                        self.cfg.backing)
        elif not moved and self._backing_moved:
            log.info("BACKING's path %s leads to the directory this mount opened again",
                     self.cfg.backing)
        self._backing_moved = moved

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
        self.progress.phase(lambda: f"destaging write-back data before mounting in "
                            f"write-through mode: {format_size(self.cache.dirty_bytes())} "
                            "left", self.cache.dirty_bytes)
        try:
            await self.cache.destager.flush(None)
        except CommandFailed as exc:
            raise UserError(f"cannot mount in write-through mode: {exc} Mount in "
                            "write-back mode or repair BACKING.") from None

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for signum in sigs:
                if signum == signal.SIGHUP:
                    # logrotate's `postrotate kill -HUP`: a new log file, not an unmount (it
                    # was one: rotating the log unmounted production, a helper's hunt).
                    _reopen_log()
                    continue
                log.info("signal %d: unmounting", signum)
                self._terminating = True
                pyfuse3.terminate()
                return


def _reopen_log() -> None:
    """SIGHUP: a background daemon (`cachefs mount`, whose stdout and stderr are
    CACHE_DIR/cachefs.log, named in CACHEFS_LOG_FILE) opens that path again, so that a log
    rotated by renaming goes on in a new file; in the foreground (systemd's journal, a
    terminal) there is nothing to reopen."""
    path = os.environ.get("CACHEFS_LOG_FILE")
    if not path:
        log.info("SIGHUP: logging to stderr, nothing to reopen (SIGTERM or `cachefs umount` "
                 "unmounts)")
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        log.warning("SIGHUP: cannot reopen the log %s (%s); logging on to the old file",
                    path, exc)
        return
    for std in (sys.stdout, sys.stderr):
        std.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    log.info("SIGHUP: log reopened (%s)", path)


def _paths(request: dict) -> list[str]:
    paths = request.get("paths")
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise CommandFailed("give one or more paths under the mount.")
    return paths


async def _fuse_main() -> bool:
    """pyfuse3's main loop. The kernel ends the FUSE connection with ENODEV at an unmount
    (pyfuse3 returns: True), but with ECONNABORTED when it was aborted (echo 1 > .../abort
    under /sys/fs/fuse/connections, or a kernel timeout, for a file system that asked for
    abort errors), which pyfuse3 raises: the session is over all the same, and cachefs
    shuts down cleanly rather than end with a traceback (False: files may be open still)."""
    try:
        await pyfuse3.main()
    except ConnectionAbortedError:
        log.warning("the kernel aborted the FUSE connection; shutting down")
        return False
    return True


def run(cfg: Config, ready: Ready, progress: Progress | None = None) -> int:
    """Run a mount in this process until it is unmounted; returns the exit status.

    `ready` gets None and the mount's warnings once mounted, or why not: a user mistake
    (UserError) as USER_MISTAKE and its sentence, so that `cachefs mount` in the background
    exits 2 for it too. `progress` hears of the long phases of the start."""
    oplog.quiet_late_replies()
    progress = progress or Progress(None)
    try:
        held = lock_mountpoint(cfg.mountpoint)     # until mounted (Daemon.serve)
        check_paths(cfg)
        fd_limit = raise_fd_limit()
        prepare_cache_dir(cfg)
        lock_fd = lock_cache_dir(cfg.cache_dir, cfg.mountpoint)
        progress.phase("opening the cache directory")
        daemon = Daemon(cfg)
        daemon.progress = progress
        daemon.mountpoint_lock = held
        if fd_limit < FD_LIMIT_WARN:
            daemon._warn(f"the daemon may open only {fd_limit} descriptors (its hard limit): "
                         f"about {max(fd_limit - FD_RESERVE, fd_limit // 4) // FDS_PER_HANDLE}"
                         " files can be open through the mount at once, further opens fail "
                         "with ENFILE; raise it (ulimit -n, systemd's LimitNOFILE=)")
        daemon.open()
    except UserError as exc:
        ready(USER_MISTAKE + str(exc))
        raise
    os.umask(0)
    try:
        trio.run(daemon.serve, ready)
    except UserError as exc:
        ready(USER_MISTAKE + str(exc))
        raise
    finally:
        os.close(lock_fd)
    return 0
