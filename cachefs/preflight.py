"""Checks and preparation before a mount: BACKING, the mountpoint and the cache directory
(refusing every user mistake with a sentence), the cache directory made private and locked,
the pool size, and the descriptor limit. Used by the daemon (`mount.run`) and by
`cachefs mount` before it starts the daemon in the background.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import resource
import shutil
import signal
import sqlite3
import stat
import subprocess
import time

from . import mounttable
from .config import EXT_SIZE, Config, format_size
from .errors import UserError
from .room import MIN_FREE_FRACTION, full_sentence, is_full, with_room
from .statx import file_id, fs_type

log = logging.getLogger("cachefs")

LOCK_WAIT_S = 60.0          # how long a mount waits for an unmounted cachefs to save its state
DEAD_CHECK_S = 2.0          # how long a mount's daemon may take to answer a statfs


def _inside(path: str, parent: str) -> bool:
    """Whether `path` is `parent` or below it: by name, or by node (the same directory
    reached through a bind mount: a cache directory in BACKING that way cached its own
    files, a helper's hunt)."""
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    if path == parent or path.startswith(parent.rstrip("/") + "/"):
        return True
    node = file_id(parent)
    while node is not None:
        if file_id(path) == node:
            return True
        up = os.path.dirname(path)
        if up == path:
            return False
        path = up
    return False


def _same(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    node = file_id(a)
    return node is not None and node == file_id(b)


VOLATILE_FS_TYPES = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def volatile_cache_warning(cfg: Config) -> str | None:
    """A sentence when write-back data would live in memory only: the cache directory on
    tmpfs or ramfs (a fsync there survives no reboot or power loss); else None."""
    if cfg.mode != "write-back":
        return None
    try:
        fd = os.open(cfg.cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        kind = VOLATILE_FS_TYPES.get(fs_type(fd))
    except OSError:
        return None
    finally:
        os.close(fd)
    if kind is None:
        return None
    return (f"the cache directory {cfg.cache_dir} is on {kind} (memory): in write-back mode "
            "the writes it holds, fsynced ones included, are lost at a reboot or power loss "
            "before they reach BACKING; put it on a disk, or mount in write-through mode.")


def room_warning(cfg: Config, held: int) -> str | None:
    """A sentence when --cache-size is more than the cache filesystem can give the pool:
    its free space plus what cachefs holds there already (`held`); else None. The mount
    goes on (the pool stops where the filesystem fills: docs/operations.md)."""
    if cfg.cache_size is None:
        return None
    sv = os.statvfs(cfg.cache_dir)
    room = sv.f_bavail * sv.f_frsize + held
    if cfg.cache_size <= room:
        return None
    return (f"--cache-size {format_size(cfg.cache_size)} is more than the cache filesystem "
            f"has room for ({format_size(sv.f_bavail * sv.f_frsize)} free, "
            f"{format_size(held)} used by this cache already): the pool stops growing where it "
            "fills up, and promotions then pause while clean data is evicted; free space "
            "there or give a smaller --cache-size.")


MAP_BYTES_PER_EXTENT = 1536    # the daemon's memory per 64 KiB extent of a full, busy pool:
                               # its map, eviction queues and ghost entries (measured: 1.4 KiB,
                               # docs/operations.md "Memory and mount time")


def memory_warning(capacity_exts: int, memory: tuple[int, str] | None = None) -> str | None:
    """A sentence when the extent map of a full pool of `capacity_exts` extents would take
    more than a quarter of the memory the daemon may use (`memory`: bytes and what they are;
    default: `memory_available()`)."""
    memory = memory or memory_available()
    if memory is None:
        return None
    limit, what = memory
    need = capacity_exts * MAP_BYTES_PER_EXTENT
    if need * 4 <= limit:
        return None
    return (f"a full pool of {format_size(capacity_exts * EXT_SIZE)} takes about "
            f"{format_size(need)} of the daemon's memory (about 1.5 KiB per 64 KiB extent), "
            f"more than a quarter of {what} ({format_size(limit)}); give a smaller "
            "--cache-size or watch the daemon's resident memory (cachefs-ctl stats).")


def memory_available() -> tuple[int, str] | None:
    """The memory this process may use: the host's, or its control group's limit where that
    is lower (a systemd MemoryMax=, a container), with the words naming it."""
    try:
        best = (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this host's memory")
    except (OSError, ValueError):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0":                                    # cgroup v2
            limit_file = f"/sys/fs/cgroup{path.rstrip('/')}/memory.max"
        elif "memory" in controllers.split(","):                # cgroup v1
            limit_file = f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.limit_in_bytes"
        else:
            continue
        try:
            with open(limit_file) as f:
                limit = int(f.read())                       # "max": no limit (ValueError)
        except (OSError, ValueError):
            continue
        if limit < best[0]:
            best = (limit, f"the memory limit of its control group {path}")
    return best


def check_overlaps(cfg: Config) -> None:
    """BACKING, MOUNTPOINT and the cache directory inside one another, as a sentence (also
    what `cachefs install-unit` checks: a unit it wrote that `cachefs mount` refuses
    restarted every 5 s for ever; a helper's hunt)."""
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


SQLITE_PATH_MAX = 512     # bytes of a database's path SQLite's unix VFS takes, NUL included


def check_paths(cfg: Config) -> None:
    """Every mistake in BACKING, MOUNTPOINT and the cache directory, as a sentence."""
    cfg.validate()
    _answers_within(cfg.backing, cfg.backing_timeout_s)
    for what, path in (("BACKING", cfg.backing), ("MOUNTPOINT", cfg.mountpoint)):
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN and what == "MOUNTPOINT" and _clear_dead(path):
                continue
            if exc.errno == errno.ENOTCONN:
                raise UserError(f"{what} {path} is a dead FUSE mount (transport endpoint is "
                                f"not connected); run fusermount3 -u {path} first.") from None
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                live = what == "MOUNTPOINT" and mounttable.is_cachefs(mounttable.resolve(path))
                raise UserError(f"{what} {path} " + (
                    "is already mounted (unmount it first with cachefs umount); it answers "
                    f"{exc.strerror}: its BACKING fails?" if live else
                    f"cannot be examined: {exc.strerror}.")) from None
        if not os.path.exists(path):
            raise UserError(f"{what} {path} does not exist.")
        if not os.path.isdir(path):
            raise UserError(f"{what} {path} is not a directory.")
    if os.path.ismount(cfg.mountpoint) and _is_fuse_mount(cfg.mountpoint):
        # A stat of a mount's root is answered from the kernel's attribute cache for up to
        # --attr-timeout after its daemon died (a restart right after a crash met "already
        # mounted"); a statfs always asks the daemon.
        if not _not_connected(cfg.mountpoint):
            raise UserError(f"MOUNTPOINT {cfg.mountpoint} is already mounted "
                            "(unmount it first with cachefs umount).")
        if not _clear_dead(cfg.mountpoint):
            raise UserError(f"MOUNTPOINT {cfg.mountpoint} is a dead FUSE mount (transport "
                            "endpoint is not connected); run fusermount3 -u "
                            f"{cfg.mountpoint} first.")
    check_overlaps(cfg)
    if os.path.exists(cfg.cache_dir) and not os.path.isdir(cfg.cache_dir):
        raise UserError(f"the cache directory {cfg.cache_dir} is not a directory.")
    _check_cache_dir_path(cfg.cache_dir)
    check_cache_dir_contents(cfg)
    _check_cache_size(cfg)
    if not os.path.exists("/dev/fuse"):
        raise UserError("/dev/fuse does not exist: load the fuse kernel module "
                        "(modprobe fuse) or run where FUSE is available.")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise UserError("no permission to open /dev/fuse: run as root or add the user to "
                        "the group that owns /dev/fuse.")
    if shutil.which("fusermount3") is None and os.geteuid() != 0:
        raise UserError("fusermount3 is not installed (apt-get install fuse3).")


def _check_cache_dir_path(cache_dir: str) -> None:
    """SQLite opens no database whose path, with its "-journal" suffix, reaches
    SQLITE_PATH_MAX bytes (resolved: a symbolic link does not shorten it). A deeper cache
    directory was reported as a corrupt database, with --discard-dirty as the way out."""
    real = os.fsencode(os.path.realpath(cache_dir))
    if len(real) + len(b"/cachefs.db-journal") >= SQLITE_PATH_MAX:
        raise UserError(f"the cache directory {cache_dir} has too long a path "
                        f"({len(real)} bytes, resolved) for SQLite, which keeps cachefs's "
                        f"metadata there: use one of at most "
                        f"{SQLITE_PATH_MAX - 1 - len('/cachefs.db-journal')} bytes (a bind "
                        "mount of it works; a symbolic link does not, SQLite resolves it).")


def _check_cache_size(cfg: Config) -> None:
    """--cache-size larger than the cache filesystem, refused before anything is made there
    (the database and the reserve file would stay behind)."""
    if cfg.cache_size is None:
        return
    where = os.path.abspath(cfg.cache_dir)
    while not os.path.exists(where):            # the directory is made later
        where = os.path.dirname(where)
    sv = os.statvfs(where)
    total = sv.f_blocks * sv.f_frsize
    if cfg.cache_size > total:
        raise UserError(f"--cache-size {format_size(cfg.cache_size)} is larger than the "
                        f"cache filesystem ({format_size(total)}).")


def _answers_within(backing: str, timeout_s: float) -> None:
    """A stat and a statvfs of BACKING in a child process (the kernel may answer a stat
    from its attribute cache; a statvfs of a network or FUSE filesystem always asks its
    server): a hung server refuses the mount with a sentence after --backing-timeout
    instead of blocking `cachefs mount`. A process, not a thread: a task waiting on a hung
    FUSE server cannot be killed, and a thread of ours would keep us from exiting."""
    pid = os.fork()
    if pid == 0:                                        # the child: stat, then go
        try:                      # no pipe of ours (a caller reading our output) stays open
            os.closerange(0, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
            os.stat(backing)
            os.statvfs(backing)
        except BaseException:
            pass                  # what is wrong with it is said by the checks that follow
        os._exit(0)
    deadline = time.monotonic() + timeout_s
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)     # it goes when its server answers, if ever
            raise UserError(f"BACKING {backing} does not answer: a stat of it did not "
                            f"finish within {timeout_s:g} s (--backing-timeout); mount "
                            "again once its server answers.")
        time.sleep(0.005)


def _not_connected(path: str, timeout_s: float = DEAD_CHECK_S) -> bool:
    """Whether the FUSE mount on `path` has lost its daemon (a statfs fails with ENOTCONN),
    asked in a child process: a live daemon that cannot answer (its BACKING hangs) counts as
    alive after `timeout_s`."""
    pid = os.fork()
    if pid == 0:
        try:
            os.statvfs(path)
        except OSError as exc:
            os._exit(1 if exc.errno == errno.ENOTCONN else 0)
        except BaseException:
            pass
        os._exit(0)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 1
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)     # it goes when the daemon answers
            return False
        time.sleep(0.005)


def daemon_pid(mountpoint: str, exclude: tuple[int, ...] = ()) -> int | None:
    """The pid of the cachefs daemon serving `mountpoint`, from /proc (its command line
    names the mountpoint: absolute, or relative to its working directory), or None.
    `exclude`: pids not to count (a starting daemon and the `cachefs mount` waiting for it
    name the mountpoint too)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")[:-1]
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if b"mount" not in argv or not any(b"cachefs" in a for a in argv[:3]):
            continue
        last = os.fsdecode(argv[-1])
        if os.path.normpath(os.path.join(cwd, last)) == mountpoint:
            return int(entry)
    return None


def _clear_dead(path: str) -> bool:
    """A dead cachefs mount left at MOUNTPOINT (its daemon crashed or was killed): unmount it,
    so that a restart (systemd's Restart=on-failure) mounts again instead of refusing for
    good. Other dead FUSE mounts are left to the operator."""
    real = mounttable.resolve(path)
    if not mounttable.is_cachefs(real):
        return False
    if daemon_pid(real, (os.getpid(), os.getppid())) is not None:
        return False                # alive, whatever its answers say (a helper's hunt)
    for flags in ("-u", "-uz"):
        if subprocess.run(["fusermount3", flags, real], capture_output=True).returncode == 0:
            log.warning("MOUNTPOINT %s was a dead cachefs mount (its daemon is gone): "
                        "unmounted it first; dirty data it left on the SSD is destaged by "
                        "this mount", real)
            return True
    return False


def _is_fuse_mount(path: str) -> bool:
    real = os.path.realpath(path)
    try:
        return any(mnt == real for mnt, _ in mounttable.mounts())
    except OSError:
        return True


def _ours(name: str) -> bool:
    """A name a cache directory of cachefs holds (or lost+found of a filesystem's root)."""
    return (name in PRIVATE_FILES or name in ("data", "lost+found")
            or name.startswith(("damaged-", "cachefs.db.")))


def check_cache_dir_contents(cfg: Config) -> None:
    """A directory that is not a cache directory, given as one (BACKING and --cache-dir
    swapped, a typo): it was made 0700, losing every other user's access, and its files
    named lock, reserve or cachefs.log were overwritten (a helper's hunt). Refused unless
    empty or holding only cachefs's files. And a cache directory given as BACKING is
    refused too: its database and data files would be served and written as files."""
    try:
        names = os.listdir(cfg.cache_dir)
    except FileNotFoundError:
        names = []
    except OSError as exc:
        raise UserError(f"the cache directory {cfg.cache_dir} cannot be read: "
                        f"{exc.strerror}.") from None
    if "cachefs.db" not in names:
        foreign = sorted(n for n in names if not _ours(n))
        if foreign:
            raise UserError(f"the cache directory {cfg.cache_dir} is not empty and is no "
                            f"cache directory of cachefs (it holds {foreign[0]!r}"
                            + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "")
                            + "): give an empty or new directory (BACKING and --cache-dir "
                            "swapped?).")
    try:
        backing_names = set(os.listdir(cfg.backing))
    except OSError:
        return
    if {"cachefs.db", "data", "lock"} <= backing_names:
        raise UserError(f"BACKING {cfg.backing} is a cache directory of cachefs (it holds "
                        "cachefs.db, data and lock): give the slow directory as BACKING "
                        "(BACKING and --cache-dir swapped?).")


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


def stranded_elsewhere(backing: str, cache_dir: str) -> None:
    """With no --cache-dir, the cache directory is named after BACKING's path. BACKING
    reached under another path (renamed, bind-mounted elsewhere, its disk mounted at
    another place) got a new, empty one, and the write-back data the old one holds was
    stranded: the mount came up cold and silent, and a file truncated before the unmount
    read empty (a helper's hunt). A new default cache directory is refused while a sibling
    holds dirty data of this very BACKING directory (the same device and inode as recorded;
    an NFS mount gets a new device number at every mount and is not found this way)."""
    if os.path.exists(os.path.join(cache_dir, "cachefs.db")):
        return
    try:
        st = os.stat(backing)
        entries = list(os.scandir(os.path.dirname(cache_dir)))
    except OSError:
        return
    for entry in entries:
        db = os.path.join(entry.path, "cachefs.db")
        if entry.path == cache_dir or not os.path.exists(db):
            continue
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.1)
            try:
                meta = dict(con.execute("SELECT key, value FROM meta WHERE key IN "
                                        "('backing', 'backing_dev')"))
                dirty = con.execute("SELECT COUNT(*) FROM extents WHERE dirty != 0"
                                    ).fetchone()[0]
            finally:
                con.close()
        except sqlite3.Error:       # in use by a running mount (its BACKING is there), or
            continue                # left by a crash with its WAL: not readable from here
        if dirty and meta.get("backing_dev") == f"{st.st_dev}:{st.st_ino}":
            old = meta.get("backing", "?")
            raise UserError(f"BACKING {backing} was mounted before as {old}, and its cache "
                            f"directory {entry.path} still holds write-back data not yet in "
                            f"BACKING ({dirty} extents): mount it from {old} again (a bind "
                            f"mount of {backing} there will do) with --cache-dir {entry.path} "
                            "and flush, or give --cache-dir to use another cache directory.")


def lock_mountpoint(mountpoint: str) -> int | None:
    """Hold the directory under MOUNTPOINT locked from the check that nothing is mounted
    there until the daemon exits: two `cachefs mount` of one MOUNTPOINT started together
    both passed that check and stacked two mounts, the lower one hidden with its cache (an
    fstab line and a unit at boot, a retrying script: a helper's hunt). The second waits
    until the first is mounted (then check_paths refuses it), or refuses after LOCK_WAIT_S.
    None when the directory cannot be opened (check_paths says why)."""
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            # Another start that is not mounted yet, or a daemon stopped before its mount
            # was made that is still exiting (a thread finishing a BACKING write): wait a
            # while; a start that mounts meanwhile is then found by check_paths.
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
        except OSError:
            pass
        os.close(fd)
        raise UserError(f"MOUNTPOINT {mountpoint} is being mounted by another cachefs; one "
                        "mount per MOUNTPOINT.") from None


_DIR_LOCKS: list[int] = []      # the cache directories' own flocks: held until exit


def _lock_directory(cache_dir: str, lock_fd: int) -> None:
    """The cache directory itself locked too: its `lock` file removed by an operator (a
    "stale lock") or a cleaner let a second daemon in beside a live one; the two then
    wrote one database over the other (a helper's hunt). A directory cannot be removed
    while it holds the cache. The holder of `lock` holds this one; a moment's wait covers
    one that is exiting."""
    dfd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    deadline = time.monotonic() + 1
    while True:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _DIR_LOCKS.append(dfd)
            return
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
        os.close(dfd)
        os.close(lock_fd)
        raise UserError(f"the cache directory {cache_dir} is in use by another cachefs (its "
                        "`lock` file was removed or replaced while it runs); one instance may "
                        "use a cache directory: unmount the other first.") from None


def lock_cache_dir(cache_dir: str, mountpoint: str) -> int:
    """Take the one-instance-per-cache-dir lock; the fd stays open for the daemon's life.

    The lock file names the holder's pid and mount. A holder whose mount is gone (a plain
    umount(8) returns before the daemon has saved its state and exited) is waited for, up
    to LOCK_WAIT_S: `umount; mount` at once was refused ("in use by another cachefs")."""
    path = os.path.join(cache_dir, "lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            lines = os.pread(fd, 8192, 0).decode(errors="replace").split("\n")
            owner = lines[0].strip() or "unknown"
            try:
                held = json.loads(lines[1]) if len(lines) > 1 and lines[1] else None
            except ValueError:
                held = None
            if held is not None and not mounttable.is_cachefs(held):
                if deadline is None:
                    deadline = time.monotonic() + LOCK_WAIT_S
                    log.warning("the cachefs that used %s (pid %s) has been unmounted and is "
                                "still saving its state: waiting for it", cache_dir, owner)
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
            os.close(fd)
            raise UserError(f"the cache directory {cache_dir} is in use by another cachefs "
                            f"(pid {owner}); one instance may use a cache directory.") from None
    _lock_directory(cache_dir, fd)
    holder = f"{os.getpid()}\n{json.dumps(mounttable.resolve(mountpoint))}\n".encode()

    def write_holder() -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder, 0)
    # On a full btrfs even this rewrite needs new space: the reserve file gives it (a mount
    # over a full cache filesystem failed here with a traceback; a helper's hunt).
    try:
        with_room(cache_dir, write_holder)
    except OSError as exc:          # a new cache directory on a full filesystem: no reserve
        os.close(fd)                # to give up yet (a traceback, an empty log: a helper's hunt)
        if is_full(exc):
            raise UserError(full_sentence(cache_dir)) from None
        raise UserError(f"the cache directory {cache_dir} cannot be written: "
                        f"{exc.strerror}.") from None
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
