"""Shared fixtures: real cachefs mounts over real directories, cleaned up even on failure."""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CACHEFS = [sys.executable, "-m", "cachefs_cli.main"]
CTL = [sys.executable, "-m", "cachefs_cli.ctl"]
REPO = Path(__file__).resolve().parent.parent
EXT_SIZE = 64 * 1024
# Every test mount checks the extent map's invariants after each change (docs/concurrency.md;
# a violation ends the daemon, and the test with it). CACHEFS_CHECK=0 turns that off.
CHECK = [] if os.environ.get("CACHEFS_CHECK") == "0" else ["--check-invariants"]
# FUSE passthrough is on by default (as for users). Tests marked no_passthrough (they count
# the daemon's own hits, which passthrough reads bypass) mount with --no-passthrough, and
# CACHEFS_PASSTHROUGH=0 turns it off for every test.
_NO_PASSTHROUGH = {"on": os.environ.get("CACHEFS_PASSTHROUGH") == "0"}


# Tests marked damages_cache corrupt cache files on purpose: their mounts run without the
# invariant checker, which verifies every block's checksum and would rightly stop the daemon.
_DAMAGES_CACHE = {"on": False}


@pytest.fixture(autouse=True)
def _passthrough_marker(request):
    saved = _NO_PASSTHROUGH["on"], _DAMAGES_CACHE["on"]
    if request.node.get_closest_marker("no_passthrough") is not None:
        _NO_PASSTHROUGH["on"] = True
    if request.node.get_closest_marker("damages_cache") is not None:
        _DAMAGES_CACHE["on"] = True
    try:
        yield
    finally:
        _NO_PASSTHROUGH["on"], _DAMAGES_CACHE["on"] = saved


def passthrough_args(args: list[str]) -> list[str]:
    if _NO_PASSTHROUGH["on"] and "--no-passthrough" not in args:
        return ["--no-passthrough"]
    return []


def fuse_unusable() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "no permission on /dev/fuse"
    return None


# The longest tests (20-60 s each, `--durations`): run first, so that with several workers
# (make test: -n 3) none of them starts last and leaves the others idle at the end.
LONG_FIRST = ("tests/bench/", "tests/crash/", "tests/mount/test_fio_verify.py",
              "tests/mount/test_random_ops.py", "tests/mount/test_history.py",
              "tests/mount/test_faults.py", "tests/mount/test_ssd_full.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not (item.nodeid.startswith(LONG_FIRST)
                                     or "slow" in item.keywords))
    reason = fuse_unusable()
    if reason:
        for item in items:
            if "fuse" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"FUSE unusable: {reason}"))


def wait_until(cond, timeout_s: float = 15, proc: subprocess.Popen | None = None,
               what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def is_mounted(path: str | Path) -> bool:
    path = os.path.realpath(path)
    with open("/proc/self/mounts", errors="surrogateescape") as f:
        return any(line.split()[1] == path for line in f)


def unmount_when_released(mnt: str | Path, check: bool = True, busy_s: float = 10) -> None:
    """fusermount3 -u, again while the mount is busy for up to `busy_s`: one teardown on a
    loaded machine failed with EBUSY right after the test had closed its last descriptor
    (a RELEASE still pending does not do it, checked). One cause found: another program's
    call on the mount still in flight, such as a `df` (statfs of every mount) waiting for
    a hung BACKING, holds the mount."""
    deadline = time.monotonic() + busy_s
    while True:
        res = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, text=True)
        if res.returncode == 0 or "busy" not in res.stderr or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if check and res.returncode != 0:
        raise AssertionError(f"fusermount3 -u {mnt} failed: {res.stderr.strip()}")


def force_unmount(path: str | Path) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


def assert_clean_log(path: Path) -> None:
    text = path.read_text(errors="replace") if path.exists() else ""
    assert "Traceback" not in text, text[-4000:]
    assert " ERROR " not in text, text[-4000:]


@dataclass
class Mount:
    backing: Path
    cache: Path
    mnt: Path
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    logs: list[Path] = field(default_factory=list)
    wrap: list[str] = field(default_factory=list)      # runs the daemon (e.g. prlimit ...)

    def start(self) -> "Mount":
        n = len(self.logs)
        log = self.log.with_name(f"{self.log.stem}.{n}.log")
        self.logs.append(log)
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [*self.wrap, *CACHEFS, "mount", "-f", "--cache-dir", str(self.cache),
                 *([] if _DAMAGES_CACHE["on"] else CHECK),
                 *passthrough_args(self.args), *self.args, str(self.backing), str(self.mnt)],
                stdout=f,
                stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: is_mounted(self.mnt), 20, self.proc, "the mount")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log ends:\n{log.read_text(errors='replace')[-3000:]}")
        return self

    def stop(self, check: bool = True) -> None:
        """Unmount cleanly and wait for the daemon to persist and exit."""
        if self.proc is None:
            return
        if self.proc.poll() is not None:        # died already (the test said so): no unmount
            rc = self.proc.returncode
            self.proc = None
            if check:
                raise AssertionError(f"the daemon had exited with {rc}; its log ends:\n"
                                     + self.logs[-1].read_text(errors="replace")[-3000:])
            return
        unmount_when_released(self.mnt, check)
        rc = self.proc.wait(timeout=60)
        self.proc = None
        if check:
            assert rc == 0, self.logs[-1].read_text()[-4000:]
            assert_clean_log(self.logs[-1])

    def restart(self) -> "Mount":
        self.stop()
        return self.start()

    def kill(self) -> None:
        """kill -9 the daemon and detach its dead mount."""
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        force_unmount(self.mnt)

    def cleanup(self) -> None:
        force_unmount(self.mnt)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stats(self) -> dict:
        """What `cachefs-ctl stats --json` prints, asked in this process: tests poll it in
        loops, and a `cachefs-ctl` process per poll (~0.25 s of CPU: Python, trio, tqdm)
        was a large part of the suite's time on two cores. The command itself is tested
        where its output matters (test_errors, test_access, test_lifetime_stats)."""
        from cachefs_cli import client
        return client.request(str(self.mnt), "stats", timeout_s=30)["stats"]

    def path(self, *parts: str) -> Path:
        return self.mnt.joinpath(*parts)


@pytest.fixture(params=["write-through", "write-back"])
def mode(request) -> str:
    return request.param


@contextlib.contextmanager
def mount_factory(root: Path):
    """make(*args, backing=None, name="m") starts a cachefs mount under `root` (BACKING,
    cache directory and mountpoint in root/name); every mount is stopped cleanly at the end
    and, whatever happens, unmounted and its daemon killed."""
    mounts: list[Mount] = []

    def make(*args: str, backing: Path | None = None, name: str = "m",
             wrap: list[str] | None = None) -> Mount:
        base = root / name
        base.mkdir()
        b = backing or base / "backing"
        b.mkdir(exist_ok=True)
        (base / "cache").mkdir()
        (base / "mnt").mkdir()
        m = Mount(b, base / "cache", base / "mnt", list(args), base / "daemon.log",
                  wrap=wrap or [])
        mounts.append(m)
        return m.start()

    try:
        yield make
        for m in mounts:
            m.stop()
    finally:
        for m in mounts:
            m.cleanup()


@pytest.fixture
def make_mount(tmp_path, make_tmpfs):
    """Factory: make_mount(*args, backing=None) starts a cachefs mount; all are cleaned up
    (before any tmpfs of make_tmpfs goes: a cache directory on one must outlive its daemon,
    whose invariant checker found its cache files gone when the tmpfs went first)."""
    with mount_factory(tmp_path) as make:
        yield make


@pytest.fixture
def mounted(make_mount, mode):
    return make_mount("--mode", mode, "--attr-timeout", "0.2")


# -- helpers shared by the model-checking tests (random operations, kill -9 rounds) ----------

def ctl_flush(m: Mount, timeout_s: float = 60) -> dict:
    """What `cachefs-ctl flush --json` does, asked in this process (as Mount.stats): destage
    every dirty byte; fails the test if the flush fails. The command itself, its progress
    bar and its errors are test_ctl_flush.py's."""
    from cachefs_cli import client
    from cachefs.errors import UserError
    start = m.stats()["destaged_bytes"]
    try:
        client.request(str(m.mnt), "flush", timeout_s=timeout_s + 30, timeout=timeout_s)
    except UserError as exc:
        raise AssertionError(f"the flush failed: {exc}") from None
    end = m.stats()
    return {"flushed_bytes": end["destaged_bytes"] - start, "dirty_bytes": end["dirty_bytes"]}


def ctl_drop(m: Mount) -> None:
    """`cachefs-ctl drop`: evict clean cached data (the next reads and fills go to BACKING)."""
    out = subprocess.run([*CTL, "drop", str(m.mnt), "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr


def read_file_view(path: str | Path, direct: bool = False) -> tuple[int, bytes]:
    """(fstat size, every byte up to EOF) of a file; O_DIRECT bypasses the page cache, so
    through a mount it shows what the daemon serves now."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        size = os.fstat(fd).st_size
        parts, off = [], 0
        while True:
            chunk = pread_aligned(fd, 1 << 20, off)
            if not chunk:
                break
            parts.append(chunk)
            off += len(chunk)
        return size, b"".join(parts)
    finally:
        os.close(fd)


def tree_view(root: str | Path, direct: bool = False) -> dict[str, tuple[int, bytes]]:
    """Every regular file directly under `root`: name -> (fstat size, bytes)."""
    return {name: read_file_view(os.path.join(root, name), direct)
            for name in sorted(os.listdir(root))}


def env_seed(default: int) -> int:
    """The base seed of a randomized test: CACHEFS_SEED if set (to reproduce a failure)."""
    return int(os.environ.get("CACHEFS_SEED", default))


def env_long() -> bool:
    """CACHEFS_LONG=1 selects the long variants of the randomized tests."""
    return os.environ.get("CACHEFS_LONG", "") not in ("", "0")


def flush_all(m: Mount) -> None:
    """`cachefs-ctl flush`, then no dirty byte is left."""
    ctl_flush(m)
    assert m.stats()["dirty_bytes"] == 0


@pytest.fixture
def make_tmpfs(tmp_path):
    """Factory: make_tmpfs(size) mounts a tmpfs of that size (a small cache filesystem) and
    returns its path; every one is unmounted at the end, also on failure."""
    with unmounted_at_end() as made:
        def make(size: str) -> Path:
            where = tmp_path / f"tmpfs{len(made)}"
            where.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                            str(where)], check=True)
            made.append(where)
            return where

        yield make


@pytest.fixture
def make_loopfs(tmp_path):
    """Factory: make_loopfs(kind, size_mib) makes a filesystem of that kind (btrfs, xfs) in a
    sparse image file, mounts it through a loop device and returns its path (skips where
    its mkfs or loop devices are missing); every one is unmounted at the end."""
    with unmounted_at_end() as made:
        def make(kind: str, size_mib: int) -> Path:
            mkfs = shutil.which(f"mkfs.{kind}")
            if mkfs is None:
                pytest.skip(f"mkfs.{kind} is not installed")
            image = tmp_path / f"{kind}{len(made)}.img"
            with open(image, "wb") as f:
                f.truncate(size_mib << 20)
            subprocess.run([mkfs, "-q", "-f", str(image)], check=True, capture_output=True)
            where = tmp_path / f"{kind}{len(made)}"
            where.mkdir()
            res = subprocess.run(["mount", "-o", "loop", str(image), str(where)],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                pytest.skip(f"no loop mount here: {res.stderr.strip()}")
            made.append(where)
            return where

        yield make


@contextlib.contextmanager
def unmounted_at_end():
    """The list of filesystems a fixture mounted: each is unmounted (lazily) at the end,
    also when the test failed."""
    made: list[Path] = []
    try:
        yield made
    finally:
        for where in made:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


# -- reading through a mount ------------------------------------------------------------------

def write_synced(path, data: bytes, off: int = 0) -> None:
    """Write `data` at `off` of the file at `path` (made if missing) and fsync it: an
    acknowledged, durable write-back write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_blocks(path, offsets, size: int = 4096) -> dict[int, bytes]:
    """Read with O_DIRECT so the kernel page cache cannot answer for cachefs."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return {off: pread_aligned(fd, size, off) for off in offsets}
    finally:
        os.close(fd)


def pread_aligned(fd: int, size: int, off: int) -> bytes:
    """os.pread into a page-aligned buffer: an O_DIRECT open served by FUSE passthrough
    reads the cache file with O_DIRECT, which (as on any local disk) needs aligned memory."""
    buf = mmap.mmap(-1, size)
    try:
        n = os.preadv(fd, [buf], off)
        return buf[:n]
    finally:
        buf.close()


def dio_align_of(directory: Path) -> tuple[int, int]:
    """The O_DIRECT alignment (memory, offset) the filesystem of `directory` states (statx
    STATX_DIOALIGN), (0, 0) where it states none."""
    from cachefs.statx import dio_align
    fd, name = tempfile.mkstemp(dir=directory)
    try:
        return dio_align(fd)
    finally:
        os.close(fd)
        os.unlink(name)


def direct_passthrough(m: Mount) -> bool:
    """Can an O_DIRECT read-only open of this mount go passthrough? Only where BACKING's
    filesystem and the cache's both state their direct I/O alignment and the cache's is no
    stricter (cachefs/openmode.py, _direct_ok): ext4 and XFS do; btrfs (Linux 6.18) and
    tmpfs state none, and their O_DIRECT opens stay on the daemon."""
    (b_mem, b_off), (c_mem, c_off) = dio_align_of(m.backing), dio_align_of(m.cache)
    return 0 < c_mem <= b_mem and 0 < c_off <= b_off


def warm(m: Mount, name: str, size: int, passes: int = 2) -> None:
    """Read every 4 KiB block of a file `passes` times in random order, then wait until
    all its extents are cached."""
    offsets = list(range(0, size, 4096))
    for _ in range(passes):
        random.shuffle(offsets)
        read_blocks(m.path(name), offsets)
    want = (size + EXT_SIZE - 1) // EXT_SIZE
    wait_until(lambda: m.stats()["extents_cached"] >= want, 10, what="promotion")


def close_quietly(handles: list) -> None:
    """Close every handle's fd (objects with `.fd`), whatever errors, and empty the list:
    after a failure or a kill -9 the descriptors of a dead mount must still go."""
    for h in handles:
        try:
            os.close(h.fd)
        except OSError:
            pass
    handles.clear()
