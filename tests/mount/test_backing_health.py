"""BACKING health over a BACKING that fails on demand (the bench/ slowfs emulator): readers
get EIO, cached data keeps being served, the log says it once per burst and once at
recovery, and `cachefs-ctl stats` shows the state going failing -> ok."""

import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

from tests.conftest import (CACHEFS, CTL, ctl_flush, force_unmount,  # noqa: E402
                            pread_aligned, wait_until, warm, write_synced)

pytestmark = pytest.mark.fuse
KiB = 1024


@pytest.fixture
def slow_backing(tmp_path):
    """slowfs over src. Tests name it before make_mount: set up first, it is torn down
    after the cachefs mounts on it (the other way round, its unmount found them there and
    waited 20 s for its daemon)."""
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    (src / "hot").write_bytes(os.urandom(512 * KiB))
    (src / "cold").write_bytes(os.urandom(512 * KiB))
    with mounted_slowfs(src, slow, latency_ms=0.2, jitter_ms=0) as sf:
        yield src, slow, sf


def health_lines(log: str) -> list[str]:
    return re.findall(r"^.* cachefs\.backing: BACKING .*$", log, re.M)


def test_a_burst_of_eio_is_one_warning_then_one_recovery(slow_backing, make_mount):
    src, slow, sf = slow_backing
    m = make_mount("--promote-after", "1", backing=slow)
    hot, cold = (src / "hot").read_bytes(), (src / "cold").read_bytes()
    warm(m, "hot", len(hot), passes=1)
    hot_fd = os.open(m.path("hot"), os.O_RDONLY | os.O_DIRECT)
    cold_fd = os.open(m.path("cold"), os.O_RDONLY | os.O_DIRECT)
    try:
        assert m.stats()["backing_health"]["state"] == "ok"
        sf.set(eio=1)
        offsets = random.sample(range(0, len(cold), 64 * KiB), 8)
        for off in offsets:                             # a burst of misses: all fail
            with pytest.raises(OSError) as err:
                pread_aligned(cold_fd, 4096, off)
            assert err.value.errno == errno.EIO
            # the SSD keeps serving what it holds
            assert os.pread(hot_fd, 4096, off) == hot[off:off + 4096]
        h = m.stats()["backing_health"]
        assert h["state"] == "failing" and h["errors"]["EIO"] >= len(offsets), h
        assert h["period_errors"] >= len(offsets) and h["last_error"] == "EIO on read", h
        assert h["last_error_on"] == str(slow / "cold"), h
        assert m.stats()["backing_errors"] == sum(h["errors"].values())
        text = subprocess.run([*CTL, "stats", str(m.mnt)], capture_output=True, text=True,
                              check=True).stdout
        assert re.search(r"BACKING health +failing for \d+ s: \d+ errors, last: EIO on read "
                         rf"of {re.escape(str(slow / 'cold'))}\n", text), text
        lines = health_lines(m.logs[-1].read_text())
        assert lines == [lines[0]] and lines[0].endswith(
            f"WARNING cachefs.backing: BACKING error: read of {slow / 'cold'} failed: EIO "
            "(Input/output error)"), lines

        sf.set(eio=0)
        assert os.pread(cold_fd, 4096, 4096) == cold[4096:8192]
        assert os.pread(cold_fd, 4096, 8192) == cold[8192:12288]
        h = m.stats()["backing_health"]
        assert h["state"] == "ok" and h["period_errors"] == 0, h
        lines = health_lines(m.logs[-1].read_text())
        assert len(lines) == 2 and re.search(
            r"INFO cachefs\.backing: BACKING recovered after \d+ errors over [\d.]+ s "
            r"\(last: EIO on read\)$", lines[1]), lines
    finally:
        sf.set(eio=0)
        os.close(hot_fd)
        os.close(cold_fd)
    m.stop()
    lines = health_lines(m.logs[-1].read_text())    # unmount reports what was held back
    assert len(lines) == 3 and re.search(r"BACKING error: read of .* failed: EIO "
                                         r"\(Input/output error\) \(and \d+ similar lines? "
                                         r"suppressed\)$", lines[2]), lines


def test_a_hung_backing_times_out_with_eio_and_health_says_so(slow_backing, make_mount):
    src, slow, sf = slow_backing
    m = make_mount("--backing-timeout", "1", backing=slow)
    cold = (src / "cold").read_bytes()
    fd = os.open(m.path("cold"), os.O_RDONLY | os.O_DIRECT)
    try:
        sf.set(hang=1)
        t0 = time.monotonic()
        with pytest.raises(OSError) as err:
            pread_aligned(fd, 4096, 0)
        assert err.value.errno == errno.EIO
        assert 0.9 < time.monotonic() - t0 < 10
        h = m.stats()["backing_health"]                 # the mount answers meanwhile
        assert h["state"] == "failing" and h["timeouts"] == 1, h
        assert h["last_error"] == "timeout on read", h
        sf.set(hang=0)
        assert os.pread(fd, 4096, 65536) == cold[65536:69632]
        assert m.stats()["backing_health"]["state"] == "ok"
    finally:
        sf.set(hang=0)
        os.close(fd)
    lines = health_lines(m.logs[-1].read_text())
    assert len(lines) == 2, lines
    assert lines[0].endswith(f"BACKING timeout: read of {slow / 'cold'} did not finish within "
                             "1 s (the caller gets EIO)"), lines
    assert "BACKING recovered after 1 error over" in lines[1], lines
    m.stop()


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_a_hung_backing_write_shows_as_a_stall_then_ends(slow_backing, make_mount, mode):
    """Writes are never abandoned, so a BACKING write that hangs is neither an error nor a
    success: past --backing-timeout it is a stall (state, `stats` row, one WARNING), and one
    INFO when it returns. (Write-back: the write's fill read or the destager's pass.)"""
    src, slow, sf = slow_backing
    m = make_mount("--mode", mode, "--backing-timeout", "1", "--max-dirty-age", "1",
                   backing=slow)
    hot = (src / "hot").read_bytes()
    warm(m, "hot", len(hot))
    fd = os.open(m.path("cold"), os.O_WRONLY)
    hfd = os.open(m.path("hot"), os.O_RDONLY | os.O_DIRECT)    # opening needs BACKING
    done = threading.Event()
    try:
        sf.set(hang=1)
        t = threading.Thread(target=lambda: (os.pwrite(fd, b"s" * 4096, 0), done.set()),
                             daemon=True)
        t.start()
        wait_until(lambda: m.stats()["backing_health"]["state"] == "stalled", 20)
        h = m.stats()["backing_health"]
        assert h["stalled_for_s"] >= 1 and str(slow / "cold") in h["stalled_on"], h
        out = subprocess.run([*CTL, "stats", str(m.mnt)], capture_output=True, text=True,
                             timeout=30)
        assert re.search(r"BACKING health +stalled for \d+ s: [\w ]+ of .*cold has not returned",
                         out.stdout), out.stdout
        assert os.pread(hfd, 8192, 4096) == hot[4096:12288]   # hits are served meanwhile
        sf.set(hang=0)
        t.join(30)
        assert done.is_set()
        # (a read that timed out meanwhile, e.g. the kernel's getxattr before the write,
        # may leave the state "failing" until that operation works again)
        wait_until(lambda: m.stats()["backing_health"]["stalled_for_s"] is None, 20)
    finally:
        sf.set(hang=0)
        os.close(fd)
        os.close(hfd)
    text = m.logs[-1].read_text()
    stalled = re.findall(r"BACKING stalled: [\w ]+ of \S*cold has not returned after \d+ s", text)
    over = re.findall(r"BACKING stall over: no write has been waiting 1 s or longer", text)
    assert len(stalled) == 1 and len(over) == 1, text[-3000:]
    m.stop()


@pytest.mark.parametrize("mode", ["write-through", "write-back"])
def test_descriptors_opened_before_a_hang_keep_reading_cached_data(slow_backing, make_mount,
                                                                   mode):
    """The kernel asks for a file's attributes before a read once --attr-timeout has
    passed; cachefs's getattr asked BACKING, and its timeout failed every read of the
    descriptor with EIO although the cache holds the data (a helper's hunt). A file with
    open descriptors gets the attributes last seen while BACKING does not answer, at once
    while one of its calls hangs (new opens still fail)."""
    src, slow, sf = slow_backing
    m = make_mount("--mode", mode, "--backing-timeout", "1", "--attr-timeout", "0.2",
                   "--no-passthrough", backing=slow)
    hot = (src / "hot").read_bytes()
    warm(m, "hot", len(hot))
    fd = os.open(m.path("hot"), os.O_RDONLY)
    try:
        sf.set(hang=1)
        took = []
        for i in range(6):
            time.sleep(0.3)                     # the kernel's attributes expire
            off = random.randrange(0, len(hot) - 8192)
            t = time.monotonic()
            assert os.pread(fd, 8192, off) == hot[off:off + 8192], i
            took.append(time.monotonic() - t)
        assert max(took[1:]) < 0.5, took        # the first one waited for the timeout
        assert m.stats()["backing_health"]["state"] == "failing"
        # (no new open here: a lookup hung in slowfs's root holds the root's lock, which
        # the setxattr that ends the hang needs)
        sf.set(hang=0)
        with open(src / "hot", "ab") as f:          # BACKING answers again: seen
            f.write(b"more")
        wait_until(lambda: os.fstat(fd).st_size == len(hot) + 4, 20, m.proc,
                   "BACKING's new size")
    finally:
        sf.set(hang=0)
        os.close(fd)
    assert "files with open descriptors get the attributes last seen" in \
        m.logs[-1].read_text()
    m.stop()


def test_writes_past_the_high_mark_go_on_while_backing_hangs(slow_backing, make_mount):
    """Write-back: a write past --dirty-high waits for the destager to make room; while
    BACKING hangs none is made, and the writer waited for the whole hang (90 s for a 90 s
    hang, a helper's hunt) although the pool had room. Once BACKING is stalled (a write has
    not returned for --backing-timeout) held writes go on after one sleep; nothing is lost."""
    src, slow, sf = slow_backing
    m = make_mount("--mode", "write-back", "--backing-timeout", "1", "--dirty-high", "1M",
                   "--dirty-low", "512K", "--cache-size", "64M", backing=slow)
    data = bytearray(os.urandom(8 << 20))
    fd = os.open(m.path("w"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data[:4096], 0)
        os.fsync(fd)
        sf.set(hang=1)
        ends = threading.Timer(30, sf.set, kwargs={"hang": 0})    # held writers fail below
        ends.start()
        t = time.monotonic()
        try:
            for i in range(8):
                os.pwrite(fd, data[i << 20:(i + 1) << 20], i << 20)
                assert time.monotonic() - t < 25, f"write {i}: held for the hang"
        finally:
            ends.cancel()
        assert m.stats()["dirty_bytes"] >= 6 << 20
        assert m.stats()["backing_health"]["state"] == "stalled"
    finally:
        sf.set(hang=0)
        os.close(fd)
    ctl_flush(m)
    assert (src / "w").read_bytes() == data
    m.stop()


def test_mount_over_a_hung_backing_is_refused_after_the_timeout(tmp_path, slow_backing):
    """`cachefs mount` over a BACKING whose server does not answer returns with a sentence
    and exit 2 after --backing-timeout (it blocked in a stat of BACKING forever)."""
    src, slow, sf = slow_backing
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    sf.set(hang=1)
    try:
        t0 = time.monotonic()
        res = subprocess.run([*CACHEFS, "mount", "--backing-timeout", "1", "--cache-dir",
                              str(tmp_path / "cache"), str(slow), str(mnt)],
                             capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    finally:
        sf.set(hang=0)
        force_unmount(mnt)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert f"BACKING {slow} does not answer" in res.stderr, res.stderr
    assert took < 20, took


def test_ctl_reaches_the_daemon_while_backing_hangs(slow_backing, make_mount):
    """cachefs-ctl finds the daemon without asking the mount root (whose attributes come
    from BACKING): with BACKING's server stopped, `stats` answers at once and shows the
    failure (it said "is not a directory" once the root's getattr timed out)."""
    src, slow, sf = slow_backing
    m = make_mount("--backing-timeout", "1", "--attr-timeout", "0", backing=slow)
    server = sf.stats()["pid"]
    os.kill(server, signal.SIGSTOP)                 # a server that answers nothing at all
    try:
        def root_times_out():       # once BACKING's attributes are no longer cached
            try:
                os.stat(m.mnt)
                return False
            except OSError as exc:
                assert exc.errno == errno.EIO
                return True
        wait_until(root_times_out, 20, what="the root's getattr to time out")
        link = m.mnt.parent / "link"
        link.symlink_to(m.mnt)              # through a symlink too (realpath would stat it)
        for cmd in (["stats", str(m.mnt)], ["stats", str(link)],
                    ["stats", str(m.mnt), "--json"]):
            t0 = time.monotonic()
            out = subprocess.run([*CTL, *cmd], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            assert time.monotonic() - t0 < 5
        assert json.loads(out.stdout)["backing_health"]["state"] == "failing"
    finally:
        os.kill(server, signal.SIGCONT)
    out = subprocess.run([*CACHEFS, "umount", str(link)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr          # (it was "not a cachefs mount")
    assert not os.path.ismount(m.mnt)
    m.stop(check=False)


def test_a_backing_whose_server_died_gives_eio_and_the_live_mount_stays(slow_backing,
                                                                        make_mount, tmp_path):
    """A FUSE BACKING (sshfs, rclone, ...) whose server dies answers ENOTCONN (first
    ECONNABORTED): passed on, every call on the live cachefs mount failed with "transport
    endpoint is not connected", the errno of a dead FUSE mount, and a `cachefs mount` on its
    mountpoint took it for one and unmounted it, dirty data and all (a helper's hunt). Now
    EIO, and the second mount is refused with a sentence."""
    src, slow, sf = slow_backing
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", backing=slow)
    write_synced(m.path("f"), os.urandom(4 * 65536))
    sf.proc.kill()                                  # BACKING's server dies
    sf.proc.wait()
    for _ in range(2):
        with pytest.raises(OSError) as err:
            os.statvfs(m.mnt)
        assert err.value.errno == errno.EIO, err.value
    other = tmp_path / "other"
    other.mkdir()
    res = subprocess.run([*CACHEFS, "mount", "--cache-dir", str(tmp_path / "c2"), str(other),
                          str(m.mnt)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "already mounted" in res.stderr, res.stderr
    assert m.proc.poll() is None
    with open("/proc/self/mounts", errors="surrogateescape") as f:
        assert [line.split()[2] for line in f if line.split()[1] == str(m.mnt)] == \
            ["fuse.cachefs"]
    force_unmount(slow)
    m.stop(check=False)
