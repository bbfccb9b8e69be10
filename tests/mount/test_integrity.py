"""Issue 17: block checksums. Bytes flipped in a cache file under a running mount are caught
on read (clean: the right bytes from BACKING and the block dropped; dirty: EIO, a report,
never destaged); `cachefs-ctl verify` finds flipped, zeroed and truncated blocks; a file
cached by an earlier mount is verified before the kernel serves it (passthrough)."""

import errno
import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import (CTL, ctl_flush, direct_passthrough, pread_aligned, read_blocks,
                            wait_until, warm)

pytestmark = [pytest.mark.fuse, pytest.mark.damages_cache]

SIZE = 1 << 20


def cache_file(m, name: str):
    ino = os.stat(m.backing / name).st_ino
    return m.cache / "data" / f"{ino & 0xFF:02x}" / str(ino)


def flip(path, off: int) -> None:
    """Flip one bit of the byte at `off` of a cache file, as failing flash would."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), off)
    finally:
        os.close(fd)


def verify(m, *args) -> tuple[int, dict]:
    out = subprocess.run([*CTL, "verify", str(m.mnt), *args, "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)


def read_all(path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return b"".join(pread_aligned(fd, 65536, off) for off in range(0, SIZE, 65536))
    finally:
        os.close(fd)


@pytest.mark.no_passthrough
def test_a_zeroed_cache_file_logs_a_line_not_one_per_block_and_counts_every_block(make_mount):
    """A wiped or zeroed cache directory wrote one WARNING per 4 KiB block (262,000 lines
    per GiB: a helper's hunt); now one per file and minute, and the counter has them all."""
    m = make_mount("--promote-after", "1")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    warm(m, "f", SIZE)
    path = cache_file(m, "f")
    path.write_bytes(bytes(SIZE))
    before = m.stats()
    assert read_all(m.path("f")) == data
    s = m.stats()
    assert s["checksum_errors"] - before["checksum_errors"] == SIZE // 4096
    assert m.logs[-1].read_text().count("checksum mismatch") == 1


@pytest.mark.no_passthrough
def test_a_flipped_clean_block_is_served_from_backing_and_dropped(make_mount, mode):
    m = make_mount("--mode", mode, "--promote-after", "1")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    warm(m, "f", SIZE)
    flip(cache_file(m, "f"), 5 * 4096 + 77)
    before = m.stats()
    assert read_all(m.path("f")) == data            # the right bytes, from BACKING
    s = m.stats()
    assert s["checksum_errors"] - before["checksum_errors"] == 1
    assert s["drops"]["checksum"] - before["drops"]["checksum"] == 1
    assert s["lost_dirty_blocks"] == 0
    log = m.logs[-1].read_text()
    assert "checksum mismatch in the cache of f at offset 20480" in log
    assert read_all(m.path("f")) == data            # and again (refilled, or from BACKING)
    # a 4 KiB read of one rotten block (the hit path's one-block case) does the same
    flip(cache_file(m, "f"), 9 * 4096 + 5)
    assert read_blocks(m.path("f"), [9 * 4096])[9 * 4096] == data[9 * 4096:10 * 4096]
    assert m.stats()["checksum_errors"] - before["checksum_errors"] == 2


@pytest.mark.no_passthrough
def test_a_flipped_dirty_block_fails_reads_and_is_never_destaged(make_mount):
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M")
    old = os.urandom(SIZE)
    (m.backing / "f").write_bytes(old)
    new = os.urandom(8192)
    fd = os.open(m.path("f"), os.O_WRONLY)
    try:
        os.pwrite(fd, new, 65536)                  # two dirty blocks of extent 1
    finally:
        os.close(fd)
    assert m.stats()["dirty_bytes"] == 8192
    flip(cache_file(m, "f"), 65536 + 4096 + 9)     # the second one rots on the SSD
    with pytest.raises(OSError) as err:
        read_blocks(m.path("f"), [65536 + 4096])
    assert err.value.errno == errno.EIO
    # the other dirty block and the clean data read right
    assert read_blocks(m.path("f"), [65536])[65536] == new[:4096]
    assert read_blocks(m.path("f"), [0])[0] == old[:4096]
    s = m.stats()
    assert s["checksum_dirty_errors"] == 1 and s["lost_dirty_blocks"] == 1
    assert s["lost"] == [{"path": "f", "offset": 65536 + 4096}]
    metrics = subprocess.run([*CTL, "metrics", str(m.mnt)], capture_output=True,
                             text=True).stdout
    assert any(line.startswith("cachefs_lost_dirty_blocks{") and line.endswith(" 1.0")
               for line in metrics.splitlines()), metrics
    assert any(line.startswith("cachefs_checksum_dirty_errors_total{") and
               line.endswith(" 1.0") for line in metrics.splitlines())
    human = subprocess.run([*CTL, "stats", str(m.mnt)], capture_output=True, text=True).stdout
    assert "LOST: 1 dirty blocks damaged on the SSD (f@69632)" in human
    out = subprocess.run([*CTL, "flush", str(m.mnt), "--timeout", "30"], capture_output=True,
                         text=True)
    assert out.returncode != 0
    assert "1 dirty blocks (4.0 KiB) are damaged on the cache SSD" in out.stderr
    # the good dirty block reached BACKING, the damaged one never did
    on_backing = (m.backing / "f").read_bytes()
    assert on_backing[65536:65536 + 4096] == new[:4096]
    assert on_backing[65536 + 4096:65536 + 8192] == old[65536 + 4096:65536 + 8192]
    rc, res = verify(m)
    assert rc == 1 and res["lost"] == [{"path": "f", "offset": 65536 + 4096}]
    # rewriting the block whole makes it good again
    fresh = os.urandom(4096)
    fd = os.open(m.path("f"), os.O_WRONLY)
    try:
        os.pwrite(fd, fresh, 65536 + 4096)
    finally:
        os.close(fd)
    assert read_blocks(m.path("f"), [65536 + 4096])[65536 + 4096] == fresh
    ctl_flush(m)
    assert (m.backing / "f").read_bytes()[65536 + 4096:65536 + 8192] == fresh
    assert m.stats()["lost_dirty_blocks"] == 0
    m.stop(check=False)                         # the log has the ERROR line, as it must


def test_verify_finds_flipped_zeroed_and_truncated_blocks(make_mount, mode):
    m = make_mount("--mode", mode, "--promote-after", "1")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    (m.backing / "g").write_bytes(data[:200_000])
    warm(m, "f", SIZE)
    warm(m, "g", 200_000)
    rc, res = verify(m)
    assert rc == 0, res
    assert res["files"] == 2 and res["blocks_checked"] == 256 + 49
    path = cache_file(m, "f")
    flip(path, 3 * 4096)                            # a flipped bit
    with open(path, "r+b") as f:
        f.seek(100 * 4096)
        f.write(bytes(4096))                        # a zeroed block
    os.truncate(path, SIZE - 65536)                 # the last extent cut away
    rc, res = verify(m, str(m.path("f")))           # only f
    assert rc == 1
    assert res["files"] == 1
    assert res["damaged_clean_blocks"] == 1 + 1 + 16, res
    assert res["damaged_dirty_blocks"] == 0
    s = m.stats()
    assert s["checksum_errors"] == 18 and s["verified_blocks"] >= 256
    assert read_all(m.path("f")) == data            # dropped blocks come from BACKING
    warm(m, "f", SIZE)
    rc, res = verify(m)
    assert rc == 0, res
    human = subprocess.run([*CTL, "verify", str(m.mnt)], capture_output=True, text=True)
    assert human.returncode == 0 and "every checked block is sound" in human.stdout


def test_verify_against_backing_drops_blocks_that_differ(make_mount):
    m = make_mount("--mode", "write-through", "--promote-after", "1", "--attr-timeout", "60")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    warm(m, "f", SIZE)
    st = os.stat(m.backing / "f")
    with open(m.backing / "f", "r+b") as f:         # changed behind the cache, times kept
        f.seek(8192)
        f.write(b"x" * 100)
    os.utime(m.backing / "f", ns=(st.st_atime_ns, st.st_mtime_ns))
    rc, res = verify(m)
    assert rc == 0                                  # the checksums hold: the SSD is sound
    rc, res = verify(m, "--against-backing")
    assert rc == 1 and res["stale_blocks"] == 1, res


@pytest.mark.no_passthrough
def test_verify_against_backing_drops_the_kernels_stale_pages_too(make_mount, tmp_path):
    """The blocks that differed were dropped from the cache, but the kernel's page cache of
    the file kept the same stale bytes: reads stayed wrong until the pages were evicted (a
    helper's hunt, 4 of 4). BACKING here shows whole seconds and ctime = mtime (as sshfs),
    so a change that keeps the size and mtime is seen by nothing but verify."""
    from tests.mount.test_renumbering_backing import renumbering
    src, bk = tmp_path / "src", tmp_path / "bk"
    src.mkdir()
    bk.mkdir()
    data = os.urandom(SIZE)
    (src / "f").write_bytes(data)
    os.utime(src / "f", (1_767_268_800, 1_767_268_800))
    with renumbering(src, bk, "f"):
        m = make_mount("--mode", "write-through", "--promote-after", "1", backing=bk)
        warm(m, "f", SIZE)
        assert m.path("f").read_bytes() == data     # into the kernel's page cache
        with open(src / "f", "r+b") as f:           # changed behind the cache, times kept
            f.seek(8192)
            f.write(b"x" * 100)
        os.utime(src / "f", (1_767_268_800, 1_767_268_800))
        want = (src / "f").read_bytes()
        rc, res = verify(m, "--against-backing")
        assert rc == 1 and res["stale_blocks"] == 1, res
        wait_until(lambda: m.path("f").read_bytes() == want, 5, what="the stale pages to go")
        m.stop()


def test_verify_of_paths_outside_the_mount_is_a_clear_error(make_mount, tmp_path):
    m = make_mount()
    out = subprocess.run([*CTL, "verify", str(m.mnt), str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 2
    assert "is not under the mount" in out.stderr and "Traceback" not in out.stderr


def test_a_file_from_an_earlier_mount_is_verified_before_passthrough(make_mount):
    m = make_mount("--mode", "write-through", "--promote-after", "1")
    if m.stats()["passthrough"] != "on":
        pytest.skip("FUSE passthrough is not available here")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    (m.backing / "g").write_bytes(data)
    warm(m, "f", SIZE)
    warm(m, "g", SIZE)
    m.restart()
    flip(cache_file(m, "g"), 7 * 4096 + 1)          # rotted while unmounted
    # (O_DIRECT opens go passthrough only where both filesystems state their alignment)
    read = read_all if direct_passthrough(m) else (lambda p: p.read_bytes())
    for name in ("f", "g"):
        assert read(m.path(name)) == data           # served by the daemon, checked
    wait_until(lambda: m.stats()["verified_blocks"] >= 2 * 256 - 1, 10, what="verification")
    s = m.stats()
    assert s["passthrough_opens"] == 0
    assert s["checksum_errors"] >= 1                 # g's block: dropped, read from BACKING
    assert read(m.path("f")) == data                # verified: the kernel serves it now
    assert m.stats()["passthrough_opens"] == 1


def test_the_background_scrub_finds_damage_nobody_read(make_mount):
    m = make_mount("--promote-after", "1", "--scrub-interval", "1", "--scrub-rate", "64M")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    warm(m, "f", SIZE)
    flip(cache_file(m, "f"), 9 * 4096 + 3)
    wait_until(lambda: m.stats()["checksum_errors"] == 1, 10, what="the scrub")
    wait_until(lambda: m.stats()["scrubs"] >= 1, 10, what="the scrub's end")  # (counted then)
    s = m.stats()
    assert s["checksum_errors"] == 1 and s["verified_blocks"] >= 256
    assert "scrub: 1 files, 256 blocks checked" in m.logs[-1].read_text()
    assert read_all(m.path("f")) == data


@pytest.mark.parametrize("value", ["soon", "-1", "5x"])
def test_a_bad_scrub_interval_is_a_sentence(tmp_path, value):
    out = subprocess.run([*CTL[:-1], "cachefs_cli.main", "mount", "--scrub-interval", value,
                          str(tmp_path), str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and "--scrub-interval" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.no_passthrough
@pytest.mark.parametrize("damage", ["missing", "truncated", "replaced"])
def test_cache_files_damaged_while_unmounted(make_mount, damage):
    """Issue 17, item 4: cache files removed, cut or replaced between two mounts. Clean data
    is read from BACKING; dirty data is never served as garbage (EIO, named in stats) and
    never destaged."""
    m = make_mount("--mode", "write-back", "--promote-after", "1", "--max-dirty-age", "600",
                   "--dirty-high", "64M", "--dirty-low", "32M")
    data = os.urandom(SIZE)
    (m.backing / "f").write_bytes(data)
    warm(m, "f", SIZE)
    new = os.urandom(4096)
    fd = os.open(m.path("f"), os.O_WRONLY)
    try:
        os.pwrite(fd, new, SIZE - 4096)                 # one dirty block, in the last extent
    finally:
        os.close(fd)
    path = cache_file(m, "f")
    m.stop()
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        os.truncate(path, SIZE // 2)
    else:
        path.write_bytes(os.urandom(SIZE))
    m.start()
    got = read_blocks(m.path("f"), range(0, SIZE - 65536, 65536), 65536)
    assert b"".join(got[o] for o in sorted(got)) == data[:SIZE - 65536]   # clean: BACKING
    with pytest.raises(OSError) as err:
        read_blocks(m.path("f"), [SIZE - 4096])
    assert err.value.errno == errno.EIO
    s = m.stats()
    assert s["lost"] == [{"path": "f", "offset": SIZE - 4096}]
    out = subprocess.run([*CTL, "flush", str(m.mnt), "--timeout", "30"], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "damaged on the cache SSD" in out.stderr
    assert (m.backing / "f").read_bytes() == data       # garbage never reached BACKING
    m.stop(check=False)


def remove_cache_files(m) -> None:
    """What a cleaner of old files (systemd-tmpfiles, tmpreaper) or an operator does to a
    cache directory under a running mount."""
    shutil.rmtree(m.cache / "data")


def test_cache_files_removed_under_the_mount_are_not_read_as_zeros(make_mount, mode):
    """A cache file removed behind the daemon was made again, empty, at the next open, and
    taken for the file's cache: zeros were served as its bytes, through passthrough and the
    daemon alike. Its blocks are now forgotten and read from BACKING again (clean), or lost
    (dirty: EIO, a report, never destaged), as for damage found by checksums."""
    m = make_mount("--mode", mode, "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M", "--cache-size", "128M")
    old = os.urandom(SIZE)
    (m.backing / "f").write_bytes(old)
    warm(m, "f", SIZE)
    new = os.urandom(8192)
    if mode == "write-back":
        (m.backing / "g").write_bytes(old)
        fd = os.open(m.path("g"), os.O_WRONLY)
        try:
            os.pwrite(fd, new, 65536)              # two dirty blocks, nowhere but the SSD
        finally:
            os.close(fd)
    # Removed once closed (RELEASE comes after close(2)): a file still open at the removal
    # is written again at its last close (test_a_cache_file_removed_while_open_...).
    names = [cache_file(m, n) for n in ("f", "g") if (m.backing / n).exists()]
    wait_until(lambda: not daemon_holds(m, names), 10, what="the last release")
    remove_cache_files(m)
    rc, res = verify(m)                 # (read by name, the files were skipped: "sound")
    assert rc == 1 and res["damaged_clean_blocks"] == SIZE // 4096, res
    assert res["damaged_dirty_blocks"] == (2 if mode == "write-back" else 0), res
    assert m.path("f").read_bytes() == old                       # passthrough open, or not
    fd = os.open(m.path("f"), os.O_RDONLY | os.O_DIRECT)
    try:
        assert pread_aligned(fd, SIZE, 0) == old
    finally:
        os.close(fd)
    s = m.stats()
    assert s["drops"]["cache_error"] >= SIZE // 65536 and s["cache_errors"] >= 1
    if mode == "write-back":
        with pytest.raises(OSError) as err:
            read_blocks(m.path("g"), [65536])
        assert err.value.errno == errno.EIO
        assert read_blocks(m.path("g"), [0])[0] == old[:4096]
        assert m.stats()["lost_dirty_blocks"] == 2
        out = subprocess.run([*CTL, "flush", str(m.mnt), "--timeout", "30"],
                             capture_output=True, text=True)
        assert out.returncode != 0 and "2 dirty blocks (8.0 KiB) are damaged" in out.stderr
        assert (m.backing / "g").read_bytes() == old          # nothing of the loss reached it
        fd = os.open(m.path("g"), os.O_WRONLY)
        try:
            os.pwrite(fd, new, 65536)              # rewritten whole: good again
        finally:
            os.close(fd)
        ctl_flush(m)
        assert (m.backing / "g").read_bytes() == old[:65536] + new + old[65536 + 8192:]
    m.path("h").write_bytes(new)                   # new data goes into new cache files
    assert m.path("h").read_bytes() == new
    log = m.logs[-1].read_text()
    assert "is gone (removed behind cachefs?)" in log, log[-3000:]
    m.stop(check=False)                         # the log has the ERROR line, as it must


def test_a_cache_file_removed_while_open_is_written_again_at_its_close(make_mount, mode):
    """A cache file removed behind the daemon while the file was open lived on in the
    daemon's descriptor only, and went with its last close: its clean blocks had to be read
    from BACKING again and, in write-back, its dirty ones were lost (EIO, never destaged).
    Its data is now written again under its name at that close, durably: the blocks stay
    cached, the dirty ones reach BACKING, also after a kill -9 right after the close."""
    m = make_mount("--mode", mode, "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M", "--cache-size", "128M")
    old = os.urandom(SIZE)
    (m.backing / "f").write_bytes(old)
    warm(m, "f", SIZE)
    want = bytearray(old)
    fd = os.open(m.path("f"), os.O_RDWR)
    try:
        a, b = os.urandom(8192), os.urandom(4096)
        os.pwrite(fd, a, 65536)                   # dirty in write-back before the removal
        want[65536:65536 + 8192] = a
        remove_cache_files(m)
        os.pwrite(fd, b, 5 * 65536)               # and after it
        want[5 * 65536:5 * 65536 + 4096] = b
        assert os.pread(fd, SIZE, 0) == want
    finally:
        os.close(fd)
    wait_until(lambda: m.stats()["cache_files_restored"] == 1, 10, what="the restore")
    assert cache_file(m, "f").exists()
    s = m.stats()
    assert s["lost_dirty_blocks"] == 0 and s["drops"]["cache_error"] == 0, s
    rc, res = verify(m)
    assert rc == 0 and res["damaged_clean_blocks"] == 0 == res["damaged_dirty_blocks"], res
    reads = m.stats()["backing_read_bytes"]
    assert read_all(m.path("f")) == want
    assert m.stats()["backing_read_bytes"] == reads          # still cached, all of it
    m.kill()                                  # the restored file was made durable
    m.start()
    assert read_all(m.path("f")) == want
    ctl_flush(m)
    assert (m.backing / "f").read_bytes() == want
    log = m.logs[0].read_text()
    assert "was removed behind cachefs while open" in log, log[-3000:]
    assert " ERROR " not in log, log[-3000:]


def daemon_holds(m, paths) -> bool:
    """Has the daemon one of `paths` open (the kernel's RELEASE comes after close(2))?"""
    fds = f"/proc/{m.proc.pid}/fd"
    held = set()
    for n in os.listdir(fds):
        try:
            held.add(os.readlink(f"{fds}/{n}"))
        except OSError:
            pass
    return any(str(p) in held for p in paths)


def test_a_cache_file_that_cannot_be_opened_keeps_its_dirty_blocks(make_mount):
    """An open that could not open the file's cache file (a failing SSD, a file made
    immutable, no descriptor left) dropped every extent of it, dirty ones too: the open
    then served BACKING's older bytes, `flush` found nothing dirty and fsynced writes were
    lost. Now clean blocks are dropped (counted) and dirty ones kept: their reads fail with
    EIO while the cache file cannot be opened, and all of it is back once it can."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--cache-size", "128M",
                   "--dirty-high", "64M", "--dirty-low", "32M")
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (m.backing / "f").write_bytes(old)
    (m.backing / "g").write_bytes(old)
    warm(m, "f", SIZE)
    fd = os.open(m.path("g"), os.O_WRONLY)
    try:
        os.pwrite(fd, new, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    locked = [cache_file(m, "f"), cache_file(m, "g")]
    wait_until(lambda: not daemon_holds(m, locked), 10, what="the last release")
    if subprocess.run(["chattr", "+i", *map(str, locked)], capture_output=True).returncode:
        pytest.skip("the cache filesystem has no immutable files (chattr +i)")
    try:
        assert read_all(m.path("f")) == old                  # clean: from BACKING
        assert m.stats()["drops"]["cache_error"] == SIZE // 65536
        with pytest.raises(OSError) as err:                  # dirty: not BACKING's old bytes
            read_all(m.path("g"))
        assert err.value.errno == errno.EIO
        assert m.stats()["dirty_bytes"] == SIZE
        fd = os.open(m.path("g"), os.O_WRONLY)      # a write into its dirty blocks: EIO,
        try:                                        # not the cache file's EPERM (ENOENT
            with pytest.raises(OSError) as err:     # with the cache filesystem gone)
                os.pwrite(fd, os.urandom(4096), 0)
            assert err.value.errno == errno.EIO
        finally:
            os.close(fd)
    finally:
        subprocess.run(["chattr", "-i", *map(str, locked)], check=True)
    assert read_all(m.path("g")) == new
    ctl_flush(m)
    assert (m.backing / "g").read_bytes() == new
    m.stop(check=False)
    log = m.logs[-1].read_text()
    assert "256 DIRTY blocks kept (not in BACKING yet)" in log, log[-3000:]
    assert "Traceback" not in log


@pytest.mark.parametrize("removed", [("cachefs.db",), ("cachefs.db", "cachefs.db-wal")],
                         ids=["db", "db-and-wal"])
def test_a_database_removed_under_the_mount_is_written_again(make_mount, removed):
    """cachefs.db removed while mounted (a cleanup script, an operator): SQLite went on
    writing the removed file, the unmount said the dirty data stayed for the next mount,
    and the next mount was refused (cached data, no database): fsynced data never reached
    BACKING (a helper's hunt). The next commit writes the database again; a kill -9 after
    it and a remount find all of it."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600")
    a, b = os.urandom(30000), os.urandom(30000)
    (m.path("a")).write_bytes(a)
    for name in removed:
        (m.cache / name).unlink()
    fd = os.open(m.path("b"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b)
        os.fsync(fd)                            # a durable commit: the database is back
    finally:
        os.close(fd)
    assert (m.cache / "cachefs.db").exists()
    m.kill()
    m.start()
    assert m.path("a").read_bytes() == a and m.path("b").read_bytes() == b
    ctl_flush(m)
    assert (m.backing / "a").read_bytes() == a and (m.backing / "b").read_bytes() == b
    log = m.logs[0].read_text()
    assert "was removed or replaced behind cachefs while mounted: written again" in log
