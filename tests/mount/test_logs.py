"""The daemon's log says what an operator needs at mount and unmount: the mode and the sizes
at mount, what was done and what stays dirty at unmount (real mount, real log)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess

import pytest

from cachefs.preflight import MAP_BYTES_PER_EXTENT
from tests.conftest import CACHEFS, CTL, unmount_when_released, wait_until

pytestmark = pytest.mark.fuse


@contextlib.contextmanager
def cli_mounted(backing, mnt, cache, *args: str, wrap: tuple[str, ...] = ()):
    """`cachefs mount ARGS --cache-dir CACHE BACKING MNT` as an operator runs it (in the
    background; its terminal output is the result's), run through `wrap` if given:
    unmounted at the end, and its daemon gone, so that the next mount may come."""
    r = subprocess.run([*wrap, *CACHEFS, "mount", *args, "--cache-dir", str(cache),
                        str(backing), str(mnt)], capture_output=True, text=True, timeout=60)
    try:
        yield r
    finally:
        unmount_when_released(mnt, check=False)
        wait_until(lambda: subprocess.run(
            ["pgrep", "-f", "--", f"--cache-dir {cache} "]).returncode, 30,
            what="the daemon to exit")


def test_mount_and_unmount_lines(make_mount):
    m = make_mount("--mode", "write-back", "--cache-size", "64M", "--max-dirty-age", "3600")
    m.path("f").write_bytes(os.urandom(1 << 20))
    m.stop()
    log = m.logs[-1].read_text()
    assert re.search(rf"INFO cachefs: mounted {m.backing} on {m.mnt} \(write-back\): cache "
                     rf"64\.0 MiB in {m.cache}, 0 B in 0 extents warm; dirty high 16\.0 MiB, "
                     r"low 8\.0 MiB, 0 B dirty now\n", log), log
    assert re.search(rf"INFO cachefs: unmounted {m.mnt} \(write-back\) after \d+ s: \d+ reads "
                     r".*, \d+ writes \(1\.0 MiB\); cache 1\.0 MiB of 64\.0 MiB; 1\.0 MiB dirty "
                     r"kept on the SSD, destaged after the next mount; metadata persisted\n",
                     log), log

    m.start()                                   # the next mount says what it found
    m.stop()
    log = m.logs[-1].read_text()
    assert "1.0 MiB in 16 extents warm; dirty high 16.0 MiB, low 8.0 MiB, 1.0 MiB dirty " \
           "now" in log, log


def test_sighup_reopens_the_log_and_keeps_the_mount(tmp_path):
    """logrotate renames cachefs.log and sends SIGHUP (`postrotate kill -HUP`): the daemon
    goes on logging in a new cachefs.log and stays mounted. SIGHUP unmounted it (a helper's
    hunt: rotating the log unmounted production, and the log could not be rotated)."""
    import signal

    from tests.conftest import is_mounted

    backing, cache, mnt = (tmp_path / n for n in ("backing", "cache", "mnt"))
    for d in (backing, cache, mnt):
        d.mkdir()
    (backing / "f").write_bytes(b"x" * 5000)
    subprocess.run([*CACHEFS, "mount", "--cache-dir", str(cache), str(backing), str(mnt)],
                   check=True, timeout=60)
    try:
        pid = int(subprocess.run(["pgrep", "-f", "--", f"mount -f --cache-dir {cache} "],
                                 capture_output=True, text=True).stdout.split()[0])
        os.rename(cache / "cachefs.log", cache / "cachefs.log.1")
        os.kill(pid, signal.SIGHUP)
        wait_until(lambda: (cache / "cachefs.log").exists(), 10, what="a new cachefs.log")
        assert is_mounted(mnt)
        assert (mnt / "f").read_bytes() == b"x" * 5000
        assert "SIGHUP: log reopened" in (cache / "cachefs.log").read_text()
        assert "unmounting" not in (cache / "cachefs.log.1").read_text()
    finally:
        unmount_when_released(mnt, check=False)
    wait_until(lambda: "unmounted" in (cache / "cachefs.log").read_text(), 30,
               what="the daemon's last line in the new log")


def test_a_write_back_cache_on_tmpfs_is_mounted_with_a_warning(tmp_path, make_tmpfs):
    """fsync in write-back acknowledges what the cache directory holds: on tmpfs that is
    memory, gone at a reboot, and the mount said nothing (a helper's hunt). `cachefs mount`
    now warns on the terminal and in the log; write-through (BACKING has every write) does
    not."""
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    for mode, warned in (("write-back", True), ("write-through", False)):
        cache = make_tmpfs("16M") / mode
        cache.mkdir()
        with cli_mounted(backing, mnt, cache, "--mode", mode) as r:
            assert r.returncode == 0, r.stderr
            assert ("is on tmpfs (memory)" in r.stderr) == warned, r.stderr
            assert ("is on tmpfs (memory)" in (cache / "cachefs.log").read_text()) == warned


def test_a_cache_size_beyond_the_free_space_is_mounted_with_a_warning(tmp_path, make_tmpfs):
    """--cache-size is checked against the cache filesystem's size, not against what is free
    on it: a pool promised more than the filesystem can give was mounted silently (a
    helper's hunt). It still mounts (the pool stops where the filesystem fills), with a
    warning on the terminal and in the log; a size that fits has none."""
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    fs = make_tmpfs("48M")
    (fs / "other-tenant").write_bytes(b"x" * (30 << 20))
    for size, warned in (("40M", True), ("4M", False)):
        cache = fs / size
        cache.mkdir()
        with cli_mounted(backing, mnt, cache, "--cache-size", size) as r:
            assert r.returncode == 0, r.stderr
            said = f"--cache-size {size[:-1]}"
            assert (said in r.stderr and "free" in r.stderr) == warned, r.stderr
            assert (said in (cache / "cachefs.log").read_text()) == warned
            (backing / "f").write_bytes(b"y" * 100_000)
            assert (mnt / "f").read_bytes() == b"y" * 100_000


def test_a_pool_whose_map_outgrows_the_host_memory_is_mounted_with_a_warning(tmp_path,
                                                                              make_tmpfs):
    """The daemon keeps its extent map in memory: about 1.5 KiB per 64 KiB extent of a full,
    busy pool (docs/operations.md "Memory and mount time"). A pool whose map would take more
    than a quarter of the host's memory mounts with a warning that says so; the daemon's
    resident memory is in `cachefs-ctl stats` and the metrics."""
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    big = int(phys / 4 / MAP_BYTES_PER_EXTENT * 1.25) * 65536       # 25 % over the line
    fs = make_tmpfs(str(big + (1 << 30)))        # a size limit, not memory taken
    for size, warned in ((big, True), (big // 2, False)):
        cache = fs / str(size)
        cache.mkdir()
        with cli_mounted(backing, mnt, cache, "--cache-size", str(size)) as r:
            assert r.returncode == 0, r.stderr
            assert ("of the daemon's memory" in r.stderr) == warned, r.stderr
            assert ("of the daemon's memory" in (cache / "cachefs.log").read_text()) == warned
            out = subprocess.run([*CTL, "stats", str(mnt)], capture_output=True, text=True,
                                 timeout=30)
            assert re.search(r"\ndaemon +pid \d+, up \d+ s, [\d.]+ MiB resident memory\n",
                             out.stdout), out.stdout
            metrics = subprocess.run([*CTL, "metrics", str(mnt)], capture_output=True,
                                     text=True, timeout=30).stdout
            rss = float(re.search(r"\ncachefs_resident_memory_bytes\{.*\} (\S+)\n",
                                  metrics).group(1))
            assert 10 << 20 < rss < 1 << 30


@pytest.fixture
def memory_cgroup():
    """Factory: memory_cgroup(limit) makes a control group with that memory limit (cgroup v1
    or v2) and returns the command prefix that runs a program in it; removed at the end."""
    made = []

    def make(limit: int) -> tuple[str, ...]:
        for root, limit_file in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
                                 ("/sys/fs/cgroup", "memory.max")):
            path = f"{root}/cachefs-test-{os.getpid()}-{len(made)}"
            try:
                os.mkdir(path)
            except OSError:
                continue
            made.append(path)
            try:
                with open(f"{path}/{limit_file}", "w") as f:
                    f.write(str(limit))
            except OSError:
                continue
            return ("sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$@"', "sh")
        pytest.skip("no memory control group can be made here")

    try:
        yield make
    finally:
        for path in made:
            wait_until(lambda: _rmdir(path), 30, what=f"the removal of {path}")


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False        # still has a process (the daemon exiting)
    return True


def test_the_memory_limit_of_the_daemons_control_group_counts(tmp_path, make_tmpfs,
                                                                memory_cgroup):
    """A daemon started under a memory limit (systemd's MemoryMax=, a container) has that
    limit, not the host's memory, to keep its map in: the warning compares with it."""
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    limit = 1 << 30
    size = int(limit / 4 / MAP_BYTES_PER_EXTENT * 1.25) * 65536
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert size * MAP_BYTES_PER_EXTENT // 65536 * 4 < phys      # no warning for the host
    fs = make_tmpfs(str(size + (1 << 30)))
    cache = fs / "c"
    cache.mkdir()
    with cli_mounted(backing, mnt, cache, "--cache-size", str(size),
                     wrap=memory_cgroup(limit)) as r:
        assert r.returncode == 0, r.stderr
        assert "more than a quarter of the memory limit of its control group" in r.stderr, \
            r.stderr
        (backing / "f").write_bytes(b"z" * 100_000)
        assert (mnt / "f").read_bytes() == b"z" * 100_000
