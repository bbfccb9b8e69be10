"""Issue 17, item 8: in write-back, times set explicitly before the destage (tar x, rsync -t,
cp -p, touch -d) are what BACKING holds after it, not the destage time."""

import os
import shutil
import subprocess
import threading
import time

import pytest

from tests.conftest import ctl_flush, wait_until

pytestmark = pytest.mark.fuse


def make_source(root) -> dict[str, int]:
    """A small tree with old mtimes; name -> mtime_ns."""
    times = {}
    for i in range(12):
        p = root / "d" / f"f{i}"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(os.urandom(1000 + 7000 * i))
        t = 1_500_000_000_000_000_000 + i * 86_400 * 10**9     # 2017, a day apart
        os.utime(p, ns=(t, t))
        times[f"d/f{i}"] = t
    return times


def mtimes(root, names) -> dict[str, int]:
    return {n: os.stat(root / n).st_mtime_ns for n in names}


@pytest.mark.parametrize("tool", ["tar", "rsync", "cp"])
def test_explicit_mtimes_survive_the_destage(make_mount, tmp_path, tool):
    if tool == "rsync" and shutil.which("rsync") is None:
        pytest.skip("rsync is not installed (make install installs it)")
    src = tmp_path / "src"
    src.mkdir()
    want = make_source(src)
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M")
    if tool == "tar":
        subprocess.run(["tar", "cf", str(tmp_path / "t.tar"), "-C", str(src), "d"], check=True)
        subprocess.run(["tar", "xf", str(tmp_path / "t.tar"), "-C", str(m.mnt)], check=True)
    elif tool == "rsync":
        subprocess.run(["rsync", "-a", f"{src}/d", str(m.mnt)], check=True)
    else:
        subprocess.run(["cp", "-pr", str(src / "d"), str(m.mnt)], check=True)
    assert m.stats()["dirty_bytes"] > 0                 # the data is not in BACKING yet
    assert mtimes(m.mnt, want) == want                  # the mount shows the source's times
    time.sleep(0.05)
    ctl_flush(m)
    assert mtimes(m.backing, want) == want              # and so does BACKING after the destage
    for n in want:
        assert (m.backing / n).read_bytes() == (src / n).read_bytes()
    m.restart()
    assert mtimes(m.mnt, want) == want


def test_a_write_after_the_times_wins_and_times_survive_a_remount(make_mount):
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M")
    old = 1_400_000_000_000_000_000
    for name in ("a", "b"):
        with open(m.path(name), "wb") as f:
            f.write(os.urandom(50_000))
        os.utime(m.path(name), ns=(old, old))
    with open(m.path("b"), "r+b") as f:                 # written again after its times
        f.write(b"new")
    m.restart()                                         # dirty data and times kept
    assert m.stats()["dirty_bytes"] > 0
    before = time.time_ns()
    ctl_flush(m)
    assert os.stat(m.backing / "a").st_mtime_ns == old
    assert os.stat(m.backing / "b").st_mtime_ns >= before - 5 * 10**9


@pytest.mark.parametrize("restart", [False, True])
def test_written_files_keep_the_mtime_of_their_last_write(make_mount, tmp_path, restart):
    """The destage writes BACKING later than the program wrote the mount: BACKING's mtime is
    then put back to the time of the last write (or truncate) through the mount, the one the
    mount showed, across a remount too. It was the destage time: `make` built `out` from
    `src`, `src` changed, and after the destage both had the same mtime: no rebuild."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--dirty-high", "64M",
                   "--dirty-low", "32M", "--attr-timeout", "0.1")
    m.path("src").write_bytes(b"v1\n")
    time.sleep(0.02)
    m.path("out").write_bytes(b"v1\n")                  # built from src
    time.sleep(0.02)
    with open(m.path("src"), "r+b") as f:               # src changes in place
        f.write(b"v2\n")
    with open(m.path("cut"), "wb") as f:
        f.write(os.urandom(300_000))
    time.sleep(0.02)
    os.truncate(m.path("cut"), 100_000)                 # a truncate after the write
    names = ["src", "out", "cut"]
    shown = mtimes(m.mnt, names)
    assert shown["src"] > shown["out"]
    assert m.stats()["dirty_bytes"] > 0
    if restart:
        m.restart()
    time.sleep(0.3)                                     # the destage comes later
    ctl_flush(m)
    assert mtimes(m.backing, names) == shown
    time.sleep(0.2)
    assert mtimes(m.mnt, names) == shown
    assert (m.backing / "src").read_bytes() == b"v2\n"
    if shutil.which("make"):
        (tmp_path / "Makefile").write_text(f"{m.mnt}/out: {m.mnt}/src\n\tcp $< $@\n")
        q = subprocess.run(["make", "-q", "-f", str(tmp_path / "Makefile")])
        assert q.returncode == 1, "make takes out for up to date with src"


def test_a_write_right_after_a_touch_is_not_older(make_mount):
    """`touch stamp` then a write to `out`: out's mtime is never older than the stamp's (on
    the mount and on BACKING after the destage). With the write times on a coarser clock than
    touch's, it was older in most rounds, and make would skip a rebuild."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--attr-timeout", "0")
    stamp, out = m.path("stamp"), m.path("out")
    stamp.write_bytes(b"")
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        older = []
        for i in range(100):
            os.utime(stamp)
            os.pwrite(fd, b"%d" % i, 0)
            s, o = os.stat(stamp).st_mtime_ns, os.stat(out).st_mtime_ns
            if o < s:
                older.append((i, s - o))
        assert not older, f"out older than stamp in {len(older)} of 100 rounds: {older[:5]}"
        final = os.stat(out).st_mtime_ns
    finally:
        os.close(fd)
    ctl_flush(m)
    assert os.stat(m.backing / "out").st_mtime_ns == final


def test_a_node_made_right_after_a_write_is_not_older(make_mount):
    """A write then a symlink made at once: the symlink's mtime (BACKING stamps it, from the
    kernel's coarse clock) is never older than the file's (xfstests generic/423, write-back:
    the write's mtime, which the destage gives BACKING, was taken from the fine clock, up to
    a clock tick after the symlink's)."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--attr-timeout", "0")
    fd = os.open(m.path("f"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        older = []
        for i in range(100):
            os.pwrite(fd, b"%d" % i, 0)
            os.symlink("nowhere", m.path(f"l{i}"))
            f, link = os.stat(m.path("f")).st_mtime_ns, os.lstat(m.path(f"l{i}")).st_mtime_ns
            if link < f:
                older.append((i, f - link))
        assert not older, f"the symlink older than the file in {len(older)} of 100 rounds: " \
                          f"{older[:5]}"
    finally:
        os.close(fd)


def test_a_truncate_right_after_a_write_is_not_older(make_mount):
    """write, then ftruncate: the mtime does not go back (the truncate's time came from
    BACKING's coarser clock, up to a few ms before the write's)."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600", "--attr-timeout", "0")
    fd = os.open(m.path("t"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        back = []
        for i in range(300):
            os.pwrite(fd, b"x" * 100, 0)
            w = os.fstat(fd).st_mtime_ns
            os.ftruncate(fd, 100 + i % 2)
            t = os.fstat(fd).st_mtime_ns
            if t < w:
                back.append(w - t)
        assert not back, f"the mtime went back in {len(back)} of 300 rounds: {back[:5]}"
    finally:
        os.close(fd)


def test_times_set_while_a_destage_pass_runs_stay(make_mount):
    """A utime right after the writes (cp -a, rsync -t, tar x) while the destager is busy
    (dirty data over the high mark) reached BACKING during the file's destage pass, whose
    write and its own utime (the last write's time) then replaced it: 21 of 30 files had
    the destage time, on the mount and on BACKING."""
    m = make_mount("--mode", "write-back", "--cache-size", "64M", "--dirty-high", "16M",
                   "--dirty-low", "8M")
    want = 1_600_000_000_000_000_000
    data = os.urandom(9 << 20)
    names = [f"f{i}" for i in range(24)]
    for name in names:
        with open(m.path(name), "wb") as f:
            f.write(data)
        os.utime(m.path(name), ns=(want, want))
    assert {n: t for n, t in mtimes(m.mnt, names).items() if t != want} == {}
    ctl_flush(m)
    assert {n: t for n, t in mtimes(m.mnt, names).items() if t != want} == {}
    m.stop()
    assert {n: t for n, t in mtimes(m.backing, names).items() if t != want} == {}


def _view(p) -> tuple:
    """What git keeps in its index for a file (and compares): all but atime."""
    st = os.stat(p)
    return (st.st_ino, st.st_size, st.st_mode, st.st_mtime_ns, st.st_ctime_ns)


def test_a_destage_is_no_change_of_the_file(make_mount):
    """git checkout, then the destage: git's index holds the ctime the file had, and the
    destage (its writes, the times it puts back on BACKING) moved BACKING's ctime, so
    `git diff-index --quiet HEAD` said the tree was dirty and `git read-tree -m -u` refused
    ("not uptodate") until something refreshed the index. The ctime seen through the mount
    stays what it was, also after a remount, until the file really changes again."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "0.2", "--attr-timeout", "0.1")
    names = [f"f{i}" for i in range(20)]
    for n in names:
        m.path(n).write_bytes(os.urandom(3000))
    before = {n: _view(m.path(n)) for n in names}
    ctl_flush(m)
    time.sleep(0.3)                             # past the kernel's attribute timeout
    assert {n: _view(m.path(n)) for n in names} == before, "the destage changed the stat"
    backing = {n: os.stat(m.backing / n).st_ctime_ns for n in names}
    assert any(backing[n] != before[n][4] for n in names), "no destage moved BACKING's ctime"
    m.restart()
    assert {n: _view(m.path(n)) for n in names} == before, "the remount changed the stat"
    os.chmod(m.path("f0"), 0o600)               # a real change: the ctime moves
    time.sleep(0.3)
    assert os.stat(m.path("f0")).st_ctime_ns > before["f0"][4]
    with open(m.path("f1"), "r+b") as f:        # so does a write, destaged or not
        f.write(b"changed")
    ctl_flush(m)
    time.sleep(0.3)
    st = os.stat(m.path("f1"))
    assert st.st_ctime_ns > before["f1"][4] and st.st_ctime_ns == st.st_mtime_ns


def test_the_ctime_seen_while_first_destages_run_stays_the_one_before_them(make_mount):
    """stat(2) in a loop while new files are destaged for the first time: a getattr whose
    BACKING stat came after a pass's thread moved the ctime, answered before the loop took
    the pass's end, showed that ctime (no mask yet for a first destage), later ones the one
    from before (the flake of test_a_destage_is_no_change_of_the_file, under load)."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "0.05", "--attr-timeout", "0")
    seen: dict[str, set] = {}
    stop = threading.Event()

    def hammer(names):
        while not stop.is_set():
            for n in names:
                seen[n].add(os.stat(m.path(n)).st_ctime_ns)

    for rnd in range(6):
        names = [f"r{rnd}f{i}" for i in range(30)]
        for n in names:
            m.path(n).write_bytes(os.urandom(3000))
            seen[n] = set()
        stop.clear()
        threads = [threading.Thread(target=hammer, args=(names,)) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: m.stats()["dirty_bytes"] == 0, 15, m.proc, "the destages")
            time.sleep(0.1)
        finally:
            stop.set()
            for t in threads:
                t.join()
    moved = {n: sorted(c) for n, c in seen.items() if len(c) > 1}
    assert not moved, f"{len(moved)} files showed more than one ctime: {list(moved.items())[:3]}"


def test_an_atime_set_alone_after_explicit_times_and_a_write_survives_the_destage(make_mount):
    """touch -d, a write, then touch -a: the destage put back the atime of the first touch
    (recorded for it) over the later one BACKING had taken (a helper's differential hunt:
    4 of 4 runs)."""
    m = make_mount("--mode", "write-back", "--max-dirty-age", "600")
    p = m.path("c1")
    p.write_bytes(os.urandom(200_000))
    t1 = 1_533_715_688_000_000_000                      # 2018-08-08
    os.utime(p, ns=(t1, t1))
    with open(p, "r+b") as f:
        f.write(b"x")
    t2 = 1_499_411_227_000_000_000                      # 2017-07-07
    subprocess.run(["touch", "-a", "-d", "@1499411227", str(p)], check=True)   # mtime OMIT
    assert os.stat(p).st_atime_ns == t2
    ctl_flush(m)
    assert os.stat(m.backing / "c1").st_atime_ns == t2
    assert os.stat(p).st_atime_ns == t2
