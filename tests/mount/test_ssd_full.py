"""A full cache filesystem degrades the cache, never the mount (issue 8, item 4): promotions
stop, clean data is evicted, write-back writes go around the cache, metadata commits are
retried, and no acknowledged byte is lost."""

import errno
import os
import subprocess
import time

import pytest

from tests.conftest import CACHEFS, CTL, ctl_flush, is_mounted, pread_aligned, wait_until

pytestmark = pytest.mark.fuse

MiB = 1 << 20


def fill_up(path):
    """Another tenant takes every free byte of the filesystem."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (MiB, 4096):
            try:
                while True:
                    os.write(fd, bytes(size))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def read_direct(path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        out = bytearray()
        while True:
            chunk = pread_aligned(fd, MiB, len(out))
            if not chunk:
                return bytes(out)
            out += chunk
    finally:
        os.close(fd)


def test_full_cache_filesystem_keeps_the_mount(make_mount, make_tmpfs, mode):
    m = make_mount("--mode", mode, "--cache-size", "24M", "--dirty-high", "8M",
                   "--dirty-low", "4M", "--sequential-cutoff", "0")
    m.stop()
    tiny_fs = make_tmpfs("32m")           # the cache filesystem
    m.cache = tiny_fs / "cache"
    model = {name: bytearray(os.urandom(12 * MiB)) for name in ("a", "b")}
    for name, data in model.items():
        (m.backing / name).write_bytes(data)
    m.start()
    for _ in range(2):                                        # cached
        assert read_direct(m.path("a")) == model["a"]
    wait_until(lambda: m.stats()["extents_cached"] >= 150, 30, what="a cached")
    fill_up(tiny_fs / "tenant")
    # Promotions, write-back writes into new extents and commits all need space now.
    assert m.path("b").read_bytes() == model["b"]
    fd = os.open(m.path("c"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        model["c"] = bytearray()
        for i in range(64):
            block = os.urandom(64 * 1024)
            os.pwrite(fd, block, i * 64 * 1024)
            model["c"] += block
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(m.path("a"), "r+b") as f:                       # cached blocks, rewritten
        for off in range(0, 12 * MiB, MiB):
            f.seek(off + 100)
            f.write(b"rewritten")
            model["a"][off + 100:off + 109] = b"rewritten"
    for name, data in model.items():
        assert m.path(name).read_bytes() == data, name
    s = m.stats()
    assert s["cache_full_events"] > 0
    assert m.proc.poll() is None                              # the daemon is alive
    os.unlink(tiny_fs / "tenant")                             # the tenant goes away
    if mode == "write-back":
        out = subprocess.run([*CTL, "flush", str(m.mnt), "--timeout", "60"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    for name, data in model.items():
        assert m.path(name).read_bytes() == data, name
    m.stop()
    for name, data in model.items():
        assert (m.backing / name).read_bytes() == data, name



def test_a_full_copy_on_write_cache_filesystem_keeps_the_daemon(make_mount, make_loopfs,
                                                                 mode):
    """On a btrfs that filled up the daemon died of SIGBUS (exit 135, a helper's hunt):
    SQLite kept the WAL's index in a mapped file, cachefs.db-shm, and dirtying one of its
    pages again needs a new block on a copy-on-write filesystem. ext4, xfs and tmpfs answer
    such a write with an error instead, which the store handles."""
    m = make_mount("--mode", mode, "--cache-size", "24M", "--dirty-high", "16M",
                   "--dirty-low", "12M", "--max-dirty-age", "1000", "--sequential-cutoff", "0")
    m.stop()
    fs = make_loopfs("btrfs", 300)
    m.cache = fs / "cache"
    r = os.urandom(12 * MiB)
    (m.backing / "r").write_bytes(r)
    m.start()
    d = os.urandom(4 * MiB)
    with open(m.path("d"), "wb") as f:
        f.write(d)
        f.flush()
        os.fsync(f.fileno())
    fill_up(fs / "tenant")
    e = b""
    for _ in range(15):                         # commits need new blocks now
        assert m.path("r").read_bytes() == r
        chunk = os.urandom(70000)
        with open(m.path("e"), "ab") as f:
            f.write(chunk)
        e += chunk
        assert m.path("d").read_bytes() == d
        time.sleep(0.2)
    assert m.proc.poll() is None, m.logs[-1].read_text()[-3000:]
    m.stop(check=False)
    assert "Bus error" not in m.logs[-1].read_text()
    os.unlink(fs / "tenant")
    m.start()
    assert m.path("d").read_bytes() == d and m.path("e").read_bytes() == e
    ctl_flush(m)
    assert (m.backing / "d").read_bytes() == d and (m.backing / "e").read_bytes() == e
    m.stop()


def write_back_on_tiny_fs(make_mount, make_tmpfs):
    """A write-back mount whose cache directory is on a 32 MiB filesystem of its own."""
    m = make_mount("--mode", "write-back", "--cache-size", "24M", "--dirty-high", "16M",
                   "--dirty-low", "12M", "--max-dirty-age", "1000", "--sequential-cutoff", "0")
    m.stop()
    tiny_fs = make_tmpfs("32m")
    m.cache = tiny_fs / "cache"
    m.start()
    return m, tiny_fs


def dirty_and_full(m, tiny_fs) -> bytes:
    """4 MiB of fsync'd write-back data only in the cache, then a tenant fills the rest."""
    data = os.urandom(4 * MiB)
    fd = os.open(m.path("d"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert m.stats()["dirty_bytes"] >= 3 * MiB
    fill_up(tiny_fs / "tenant")
    return data


def flushed_and_on_backing(m, data: bytes) -> None:
    assert m.path("d").read_bytes() == data
    out = subprocess.run([*CTL, "flush", str(m.mnt), "--timeout", "60"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    m.stop()
    assert (m.backing / "d").read_bytes() == data


@pytest.mark.parametrize("how", ["unmount", "kill"])
def test_remount_on_a_full_cache_filesystem_keeps_dirty_data(make_mount, make_tmpfs, how):
    """The daemon stops (cleanly, or by kill -9) while the cache filesystem is full and
    starts again before any space is freed: the reserve file makes room for the database,
    the mount comes up, reads serve the newest bytes and a flush puts them on BACKING.
    (The remount failed with a traceback: the database's in-use mark did not fit.)"""
    m, tiny_fs = write_back_on_tiny_fs(make_mount, make_tmpfs)
    data = dirty_and_full(m, tiny_fs)
    if how == "kill":
        m.kill()
    else:
        m.stop()                        # its close commits: the reserve makes room
    m.start()
    flushed_and_on_backing(m, data)


@pytest.mark.parametrize("how", ["unmount", "kill"])
def test_no_room_for_the_database_is_a_clear_error(make_mount, make_tmpfs, how):
    """No reserve file and not a byte free: the mount is refused with a sentence and exit
    2, also with --discard-dirty (after a clean unmount SQLite cannot make its -wal file and
    says "disk I/O error": that was taken for a corrupt database, and --discard-dirty was
    offered, which would have thrown the dirty data away), and once space is freed the
    mount serves the data."""
    m, tiny_fs = write_back_on_tiny_fs(make_mount, make_tmpfs)
    data = dirty_and_full(m, tiny_fs)
    if how == "kill":
        m.kill()
    else:
        m.stop()
    (m.cache / "reserve").unlink(missing_ok=True)
    fill_up(tiny_fs / "tenant2")
    for extra in ([], ["--discard-dirty"]):
        res = subprocess.run([*CACHEFS, "mount", "-f", "--cache-dir", str(m.cache), *m.args,
                              *extra, str(m.backing), str(m.mnt)], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 2, (res.returncode, res.stderr)
        assert "is full" in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert "corrupt" not in res.stderr, res.stderr
    os.unlink(tiny_fs / "tenant2")
    m.start()
    flushed_and_on_backing(m, data)


@pytest.mark.parametrize("fg", [False, True], ids=["background", "foreground"])
def test_a_new_cache_directory_on_a_full_filesystem_is_a_clear_error(tmp_path, make_tmpfs, fg):
    """A new cache directory has no reserve to give up: writing its lock file failed with
    ENOSPC, a traceback (foreground) or "the daemon stopped before the mount was ready"
    with an empty log (background), exit 1 (a helper's operator hunt)."""
    tiny_fs = make_tmpfs("8M")
    fill_up(tiny_fs / "tenant")
    backing, mnt = tmp_path / "b", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    res = subprocess.run([*CACHEFS, "mount", *(["-f"] if fg else []), "--cache-dir",
                          str(tiny_fs / "c"), "--cache-size", "4M", str(backing), str(mnt)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "is full" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not is_mounted(mnt)


def test_a_mount_refused_for_want_of_room_leaves_the_cache_clean(tmp_path, make_tmpfs):
    """Refused ("less than 10% free") after the database was marked in use: the next mount
    took it for an unclean stop and revalidated (in write-back, re-dirtied the blocks in
    doubt) for nothing (a helper's hunt)."""
    fs = make_tmpfs("32M")
    with open(fs / "tenant", "wb") as f:
        f.write(bytes(31 * MiB))
    backing, mnt = tmp_path / "b", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    cmd = [*CACHEFS, "mount", "--cache-dir", str(fs / "c"), str(backing), str(mnt)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "less than 10% free" in res.stderr, res.stderr
    res = subprocess.run([*cmd, "--cache-size", "4M"], capture_output=True, text=True,
                         timeout=60)
    try:
        assert res.returncode == 0, res.stderr
    finally:
        subprocess.run([*CACHEFS, "umount", str(mnt)], capture_output=True, timeout=60)
    log = (fs / "c" / "cachefs.log").read_text()
    assert "not clean" not in log, log


def test_reserve_makes_room_to_open_after_a_clean_unmount(make_mount, make_tmpfs):
    """A clean unmount leaves no -wal file; on a full filesystem the next open needs room
    for it: the reserve file gives it, and the dirty data is served and flushed."""
    m, tiny_fs = write_back_on_tiny_fs(make_mount, make_tmpfs)
    data = os.urandom(4 * MiB)
    with open(m.path("d"), "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    m.stop()
    assert (m.cache / "reserve").exists() and not (m.cache / "cachefs.db-wal").exists()
    fill_up(tiny_fs / "tenant")
    m.start()
    flushed_and_on_backing(m, data)


def test_a_file_in_passthrough_never_loses_writes_when_the_ssd_fills(
        make_mount, tmp_path, mode):
    """A file read in FUSE passthrough (the kernel reads its cache file by itself) is
    written through another descriptor, once 64 MiB past its end: its cache file would have
    to grow by 64 MiB of zeros, more than the cache filesystem has. cachefs detached the
    cache file: in write-back every dirty byte in it was lost (fsynced ones too; BACKING got
    zeros), and in both modes the passthrough reader went on reading the detached file,
    stale. Then that write failed with ENOSPC. Now the cache file stops growing at the
    file's end (heldwrites._freeze): the write goes to BACKING, every write is kept, the
    cache filesystem keeps its free space, the passthrough reader reads the file's bytes up
    to that end (every one of them the newest), and other opens read all of it."""
    from tests.crash.test_power_cut import Ssd
    from tests.mount.test_passthrough import _available, cache_fully, open_passthrough
    reason = _available()
    if reason:
        pytest.skip(reason)
    m = make_mount("--mode", mode, "--cache-size", "24M", "--dirty-high", "8M",
                   "--dirty-low", "4M")
    m.stop()
    ssd = Ssd(tmp_path / "ssd.img", tmp_path / "ssd")       # ext4, 256 MiB
    try:
        m.cache = ssd.path / "cache"
        sv = os.statvfs(ssd.path)
        with open(ssd.path / "tenant", "wb") as f:          # leaves ~40 MiB
            f.truncate(0)
            os.posix_fallocate(f.fileno(), 0, sv.f_bavail * sv.f_frsize - 40 * MiB)
        m.start()
        _held_file_on_a_full_ssd(m, mode, ssd.path, cache_fully, open_passthrough)
        m.stop()
    finally:
        ssd.remove()


def _free(path) -> int:
    sv = os.statvfs(path)
    return sv.f_bavail * sv.f_frsize


def _held_file_on_a_full_ssd(m, mode, ssd, cache_fully, open_passthrough):
    model = bytearray(os.urandom(2 * MiB))
    m.path("H").write_bytes(model)
    cache_fully(m, "H", len(model))
    held = open_passthrough(m, "H")
    fd = os.open(m.path("H"), os.O_WRONLY)
    try:
        def write(off, data):
            os.pwrite(fd, data, off)
            model.extend(bytes(max(0, off - len(model))))
            model[off:off + len(data)] = data
        for i in range(8):
            write(i * 256 * 1024, os.urandom(4096))
        free = _free(ssd)
        write(len(model) + 64 * MiB, os.urandom(64 * 1024))      # no ENOSPC
        assert _free(ssd) >= free - 4 * MiB, (free, _free(ssd))
        for i in range(8):
            write(i * 256 * 1024 + 8192, os.urandom(4096))
        for _ in range(4):
            write(len(model), os.urandom(100_000))
        os.fsync(fd)
        assert m.stats()["passthrough_frozen"] == 1
        got = os.pread(held, len(model) + 4096, 0)
        assert len(got) >= 2 * MiB, len(got)
        bad = [i for i in range(0, len(got), 4096) if got[i:i + 4096] != model[i:i + 4096]]
        assert not bad, f"the passthrough reader: {len(bad)} blocks stale, first at {bad[0]}"
    finally:
        os.close(fd)
        os.close(held)
    assert m.path("H").read_bytes() == model
    if mode == "write-back":
        res = subprocess.run([*CTL, "flush", str(m.mnt)], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
    assert (m.backing / "H").read_bytes() == model


def test_a_full_cache_filesystem_heals_once_the_load_stops(make_mount, make_tmpfs):
    """Another tenant leaves the cache filesystem ~20 MiB while readers promote far more.
    The first full event gives up the 8 MiB reserve file (so a commit fits). It was never
    made again (that needs 16 MiB free), promotions went on to the filesystem's last block,
    every commit failed from then on, and the holes of evicted extents (punched after a
    commit) were never punched: the cache stayed full and unusable until someone else freed
    space. While the reserve is gone the SSD now counts as full, and the pool shrinks until
    the reserve can be made again."""
    m = make_mount("--mode", "write-through", "--cache-size", "40M")
    m.stop()
    tiny_fs = make_tmpfs("64m")
    m.cache = tiny_fs / "cache"
    data = {f"d{i}": os.urandom(16 * MiB) for i in range(4)}
    for name, blob in data.items():
        (m.backing / name).write_bytes(blob)
    m.start()
    with open(tiny_fs / "tenant", "wb") as f:                # leaves ~20 MiB
        f.write(bytes(int(os.statvfs(tiny_fs).f_bavail * 4096 - 20 * MiB)))
    for _ in range(3):
        for name, blob in data.items():
            assert read_direct(m.path(name)) == blob
    def healed():
        s = m.stats()
        return ((m.cache / "reserve").exists() and s["metadata_pending"] == 0
                and os.statvfs(tiny_fs).f_bavail > 0)
    wait_until(healed, 30, what="the reserve file back and the metadata committed")
    assert m.stats()["cache_full_events"] > 0
    for name, blob in data.items():
        assert read_direct(m.path(name)) == blob
