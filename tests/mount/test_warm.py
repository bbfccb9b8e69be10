"""Warming on purpose through real mounts: `cachefs-ctl prefetch`, `pin`, `unpin`, and `drop`
with pins. Proof comes from bytes read with O_DIRECT (the kernel's page cache cannot answer)
and `cachefs-ctl stats --json`: a read answered by the SSD adds to hit_ops and not to
backing_read_ops."""

import json
import os
import random
import re
import subprocess

import pytest

from tests.conftest import CTL, wait_until, pread_aligned

# These count the reads the daemon answers: FUSE passthrough reads never reach it.
pytestmark = [pytest.mark.fuse, pytest.mark.no_passthrough]

EXT = 64 * 1024
MiB = 1 << 20


def ctl(*args, check=None):
    out = subprocess.run([*CTL, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check is not None:
        assert out.returncode == check, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def read_direct(path, offsets, size=4096):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return {off: pread_aligned(fd, size, off) for off in offsets}
    finally:
        os.close(fd)


def offsets_of(size, step=4096, seed=1):
    offs = list(range(0, size, step))
    random.Random(seed).shuffle(offs)
    return offs


def assert_ssd_hits(m, name, data):
    """Every 4 KiB block of `name` reads back right, all from the SSD, none from BACKING."""
    before = m.stats()
    offs = offsets_of(len(data))
    got = read_direct(m.path(name), offs)
    assert all(got[o] == data[o:o + 4096] for o in offs), name
    after = m.stats()
    assert after["backing_read_ops"] == before["backing_read_ops"], name
    assert after["hit_ops"] - before["hit_ops"] == len(offs), name


def backing_reads_of(m, name, data):
    """Read every block of `name`; returns how many BACKING reads that took."""
    before = m.stats()["backing_read_ops"]
    offs = offsets_of(len(data), step=EXT)
    got = read_direct(m.path(name), offs)
    assert all(got[o] == data[o:o + 4096] for o in offs), name
    return m.stats()["backing_read_ops"] - before


def test_prefetch_file_then_reads_are_ssd_hits(make_mount, mode):
    m = make_mount("--mode", mode)               # --promote-after 2: one read caches nothing
    data = os.urandom(3 * MiB + 1234)
    (m.backing / "big").write_bytes(data)
    out = ctl("prefetch", m.path("big"), "--json", check=0)
    res = json.loads(out.stdout)
    assert res["total_bytes"] == res["loaded_bytes"] == len(data)
    assert res["missing_bytes"] == 0 and res["files"] == 1
    assert out.stderr == ""                      # not a terminal: no progress bar
    s = m.stats()
    assert s["prefetched_bytes"] == len(data)
    assert s["extents_cached"] == (len(data) + EXT - 1) // EXT
    assert_ssd_hits(m, "big", data)
    # Again: everything is cached already, nothing is read from BACKING.
    before = m.stats()["backing_read_ops"]
    res = json.loads(ctl("prefetch", m.path("big"), "--json", check=0).stdout)
    assert res["cached_bytes"] == len(data) and res["loaded_bytes"] == 0
    assert m.stats()["backing_read_ops"] == before


def test_prefetch_directory_tree(make_mount):
    m = make_mount()
    files = {"top": os.urandom(100_000), "a/one": os.urandom(300_000),
             "a/b/two": os.urandom(70_000), "a/b/c/three": os.urandom(5),
             "a/b/c/empty": b"", "other/not-asked": os.urandom(80_000)}
    for name, data in files.items():
        (m.backing / name).parent.mkdir(parents=True, exist_ok=True)
        (m.backing / name).write_bytes(data)
    out = ctl("prefetch", m.path("a"), m.path("top"), check=0)
    assert "cached" in out.stdout
    for name in ("top", "a/one", "a/b/two", "a/b/c/three"):
        assert_ssd_hits(m, name, files[name])
    assert backing_reads_of(m, "other/not-asked", files["other/not-asked"]) > 0


def test_prefetch_keeps_newer_written_data(make_mount, mode):
    """Dirty (write-back) or just written blocks are never overwritten by what prefetch
    reads from BACKING."""
    m = make_mount("--mode", mode)
    data = bytearray(os.urandom(MiB))
    (m.backing / "f").write_bytes(data)
    patch = os.urandom(10_000)
    with open(m.path("f"), "r+b") as f:
        f.seek(70_000)
        f.write(patch)
    data[70_000:80_000] = patch
    ctl("prefetch", m.path("f"), check=0)
    assert_ssd_hits(m, "f", bytes(data))


def test_prefetch_outside_the_mount_is_a_sentence(make_mount, tmp_path):
    m = make_mount()
    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"x")
    for args in ([outside], [m.path("no-such-file")], [m.backing]):
        out = ctl("prefetch", *args, check=2)
        assert out.stderr.startswith("cachefs-ctl: ") and out.stderr.count("\n") == 1
    assert "is not inside a cachefs mount" in ctl("prefetch", outside, check=2).stderr
    assert "does not exist" in ctl("pin", m.path("no-such-file"), check=2).stderr


def test_prefetch_that_does_not_fit_says_so_and_evicts_no_pinned_data(make_mount):
    m = make_mount("--cache-size", "4M")
    pinned, big = os.urandom(MiB), os.urandom(6 * MiB)
    (m.backing / "pinned").write_bytes(pinned)
    (m.backing / "big").write_bytes(big)
    ctl("pin", m.path("pinned"), check=0)
    out = ctl("prefetch", m.path("big"), "--json", check=1)
    res = json.loads(out.stdout)
    assert res["full"] and res["missing_bytes"] > 0
    assert res["loaded_bytes"] + res["missing_bytes"] == len(big)
    assert res["not_loaded"] == [str(m.path("big"))]
    assert "did not fit" in out.stderr and "pinned" in out.stderr
    s = m.stats()
    assert s["cache_used"] <= s["cache_size"]
    assert s["pinned_bytes"] == len(pinned)
    assert_ssd_hits(m, "pinned", pinned)
    # What was loaded (whole extents here) is served from the SSD, the rest from BACKING.
    before = m.stats()
    got = read_direct(m.path("big"), range(0, len(big), EXT))
    assert all(got[o] == big[o:o + 4096] for o in got)
    after = m.stats()
    assert after["hit_ops"] - before["hit_ops"] == res["loaded_bytes"] // EXT
    assert (after["backing_read_ops"] - before["backing_read_ops"]
            == res["missing_bytes"] // EXT)


def test_pin_survives_remount(make_mount, mode):
    m = make_mount("--mode", mode)
    data = os.urandom(MiB + 5000)
    (m.backing / "keep").write_bytes(data)
    out = ctl("pin", m.path("keep"), "--json", check=0)
    res = json.loads(out.stdout)
    assert res["pinned_files"] == 1 and res["loaded_bytes"] == len(data)
    m.restart()
    s = m.stats()
    assert s["pinned_files"] == 1
    assert s["pinned_bytes"] == (len(data) + EXT - 1) // EXT * EXT
    assert_ssd_hits(m, "keep", data)
    ctl("drop", m.mnt, check=0)                  # still pinned, not only resident
    assert_ssd_hits(m, "keep", data)


def test_pin_beyond_the_share_is_refused(make_mount):
    m = make_mount("--cache-size", "4M")
    (m.backing / "a").write_bytes(os.urandom(MiB))
    (m.backing / "b").write_bytes(os.urandom(1536 * 1024))
    ctl("pin", m.path("a"), check=0)
    out = ctl("pin", m.path("b"))
    assert out.returncode != 0
    msg = out.stderr
    assert msg.count("\n") == 1 and "refused" in msg
    for size in ("1.5 MiB", "2.5 MiB", "2.0 MiB", "4.0 MiB", "50%"):   # need, total, limit
        assert size in msg, msg
    s = m.stats()
    assert s["pinned_files"] == 1 and s["pinned_limit"] == 2 * MiB
    assert ctl("pin", m.path("b")).returncode != 0         # nothing changed meanwhile


def test_max_pinned_option_and_fstab_form(make_mount):
    m = make_mount("--cache-size", "4M", "-o", "max_pinned=75%")
    (m.backing / "b").write_bytes(os.urandom(3 * MiB))
    ctl("pin", m.path("b"), check=0)
    assert m.stats()["pinned_limit"] == 3 * MiB
    m2 = make_mount("--cache-size", "4M", "--max-pinned", "0", name="m2")
    (m2.backing / "tiny").write_bytes(b"x")
    assert "refused" in ctl("pin", m2.path("tiny"), check=2).stderr


@pytest.mark.parametrize("eviction", ["s3-fifo", "clock"])
def test_scan_does_not_evict_pinned_extents_and_unpin_lets_them_go(make_mount, eviction):
    m = make_mount("--cache-size", "4M", "--promote-after", "1", "--eviction", eviction)
    pinned = os.urandom(MiB)
    (m.backing / "pinned").write_bytes(pinned)
    scan = {f"s{i}": os.urandom(2 * MiB) for i in range(4)}
    for name, data in scan.items():
        (m.backing / name).write_bytes(data)
    ctl("pin", m.path("pinned"), check=0)
    rng = random.Random(5)

    def scan_all(passes=3):
        """Random extents of 8 MiB, two 4 KiB reads in each: the second one hits, so the
        extents reach S3-FIFO's main queue too, which must then evict."""
        fds = {name: os.open(m.path(name), os.O_RDONLY | os.O_DIRECT) for name in scan}
        try:
            for _ in range(passes):
                reads = [(name, off) for name in scan for off in range(0, 2 * MiB, EXT)]
                rng.shuffle(reads)
                for name, off in reads:
                    for o in (off, off + 32768):
                        assert pread_aligned(fds[name], 4096, o) == scan[name][o:o + 4096]
        finally:
            for fd in fds.values():
                os.close(fd)

    before = m.stats()["evictions"]
    scan_all()
    s = m.stats()
    assert s["evictions"] - before > 64                  # the whole pool turned over
    assert s["pinned_bytes"] == len(pinned)
    assert_ssd_hits(m, "pinned", pinned)
    out = ctl("unpin", m.path("pinned"), "--json", check=0)
    assert json.loads(out.stdout)["unpinned_files"] == 1
    assert m.stats()["pinned_files"] == 0
    scan_all()
    assert backing_reads_of(m, "pinned", pinned) > 0


def test_drop_leaves_pins_and_drop_pinned_drops_them(make_mount):
    m = make_mount()
    kept, other = os.urandom(MiB), os.urandom(MiB)
    (m.backing / "kept").write_bytes(kept)
    (m.backing / "other").write_bytes(other)
    ctl("pin", m.path("kept"), check=0)
    ctl("prefetch", m.path("other"), check=0)
    out = ctl("drop", m.mnt, "--json", check=0)
    res = json.loads(out.stdout)
    assert res["dropped_extents"] == MiB // EXT and res["pinned_files"] == 1
    assert_ssd_hits(m, "kept", kept)
    assert backing_reads_of(m, "other", other) > 0
    res = json.loads(ctl("drop", m.mnt, "--pinned", "--json", check=0).stdout)
    assert res["dropped_pinned_extents"] == MiB // EXT
    s = m.stats()
    assert s["pinned_files"] == 0 and s["dropped_pinned"] == MiB // EXT
    assert backing_reads_of(m, "kept", kept) > 0
    m.restart()
    assert m.stats()["pinned_files"] == 0


def test_pinned_file_changed_behind_the_cache_is_reloaded_in_background(make_mount):
    m = make_mount("--attr-timeout", "0")
    (m.backing / "p").write_bytes(os.urandom(MiB))
    ctl("pin", m.path("p"), check=0)
    new = os.urandom(MiB + 70_000)
    (m.backing / "p").write_bytes(new)           # behind the cache's back
    os.close(os.open(m.path("p"), os.O_RDONLY))  # the open notices and drops the old data
    wait_until(lambda: m.stats()["pin_reloads"] >= 1, 10, m.proc, "the pin's re-load")
    wait_until(lambda: m.stats()["pinned_bytes"] == (len(new) + EXT - 1) // EXT * EXT, 10,
               m.proc, "the whole file re-loaded")
    assert m.stats()["stale_files"] >= 1
    assert_ssd_hits(m, "p", new)
    log = m.logs[-1].read_text()
    assert "re-loaded from BACKING" in log


def test_a_pinned_file_changed_while_unmounted_is_reloaded_without_a_warning(make_mount):
    """The mount re-loads a pinned file that changed while cachefs was down before FUSE is
    up: its kernel invalidation got EINVAL, logged as a WARNING at every such mount (a
    helper's hunt; harmless: the kernel knows nothing of the file yet)."""
    m = make_mount()
    (m.backing / "p").write_bytes(os.urandom(MiB))
    ctl("pin", m.path("p"), check=0)
    m.stop()
    new = os.urandom(MiB)
    (m.backing / "p").write_bytes(new)
    m.start()
    wait_until(lambda: m.stats()["pin_reloads"] >= 1, 10, m.proc, "the pin's re-load")
    assert_ssd_hits(m, "p", new)
    assert "kernel invalidation" not in m.logs[-1].read_text()


def test_a_pinned_file_renamed_while_unmounted_keeps_its_pin(make_mount):
    """The pin was lost ("no longer exists") when its file was renamed in BACKING while
    cachefs was down (a helper's hunt); a walk of BACKING finds it by inode number."""
    m = make_mount()
    data = os.urandom(MiB)
    (m.backing / "p").write_bytes(data)
    ctl("pin", m.path("p"), check=0)
    m.stop()
    (m.backing / "d").mkdir()
    os.rename(m.backing / "p", m.backing / "d" / "q")
    m.start()
    wait_until(lambda: "was renamed to" in m.logs[-1].read_text(), 10, m.proc,
               "the pin's file found")
    s = m.stats()
    assert s["pinned_files"] == 1 and s["pins_lost"] == 0
    assert_ssd_hits(m, "d/q", data)


def test_pins_over_the_limit_of_a_smaller_pool_are_unpinned_at_mount(make_mount):
    """Pins made in a larger pool filled the whole of a smaller one after a remount, past
    --max-pinned (a helper's hunt); the latest ones over the limit now lose their pin."""
    m = make_mount("--cache-size", "64M")
    for i in range(4):
        (m.backing / f"p{i}").write_bytes(os.urandom(6 * MiB))
        ctl("pin", m.path(f"p{i}"), check=0)
    assert m.stats()["pinned_files"] == 4
    m.stop()
    m.args = ["--cache-size", "16M"]
    m.start()
    s = m.stats()
    assert 0 < s["pinned_files"] < 4
    assert s["pinned_files"] * 6 * MiB <= s["pinned_limit"]
    assert s["pins_lost"] == 4 - s["pinned_files"]
    assert "are no longer pinned" in m.logs[-1].read_text()


def test_unlinked_pinned_file_loses_its_pin(make_mount):
    m = make_mount()
    (m.backing / "gone").write_bytes(os.urandom(200_000))
    (m.backing / "stays").write_bytes(os.urandom(200_000))
    ctl("pin", m.path("gone"), m.path("stays"), check=0)
    assert m.stats()["pinned_files"] == 2
    os.unlink(m.path("gone"))
    s = m.stats()
    assert s["pinned_files"] == 1 and s["pins_lost"] == 1
    (m.backing / "gone").write_bytes(b"a new file in its place")   # may reuse the inode
    m.restart()
    s = m.stats()
    assert s["pinned_files"] == 1
    assert "was unlinked; its pin is removed" in m.logs[0].read_text()


def test_pin_follows_rename_through_the_mount(make_mount):
    m = make_mount()
    data = os.urandom(300_000)
    (m.backing / "old").write_bytes(data)
    ctl("pin", m.path("old"), check=0)
    os.rename(m.path("old"), m.path("new"))
    m.restart()
    s = m.stats()
    assert s["pinned_files"] == 1 and s["pins_lost"] == 0
    ctl("drop", m.mnt, check=0)
    assert_ssd_hits(m, "new", data)
    assert json.loads(ctl("unpin", m.path("new"), "--json", check=0).stdout)[
        "unpinned_files"] == 1


def run_on_terminal(argv, cols=120):
    """Run argv with stdout and stderr on a pseudo-terminal; returns (status, output)."""
    import fcntl
    import struct
    import termios
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, cols, 0, 0))
    proc = subprocess.Popen(argv, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:                      # EIO: the other side is closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return proc.wait(timeout=60), out.decode(errors="replace")


def test_prefetch_shows_progress_on_a_terminal_only(make_mount):
    m = make_mount()
    (m.backing / "f").write_bytes(os.urandom(8 * MiB))
    rc, out = run_on_terminal([*CTL, "prefetch", str(m.path("f"))])
    assert rc == 0, out
    # bytes done/total [elapsed<ETA, rate]
    assert re.search(r"prefetch: 100%\|.*\| 8\.00M/8\.00M \[[0-9:]+<00:00, *[0-9.]+[kMG]?B/s\]",
                     out), out
    ctl("drop", m.mnt, check=0)
    out = ctl("prefetch", m.path("f"), check=0)                        # not a terminal
    assert out.stderr == "" and "cached" in out.stdout
