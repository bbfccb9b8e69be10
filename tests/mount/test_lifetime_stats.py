"""Lifetime statistics: totals over every mount of a cache directory, beside the per-mount
figures (`cachefs-ctl stats`, `--json` key "lifetime"). They are saved every commit
interval and at unmount; a kill -9 loses at most the last interval."""

from __future__ import annotations

import mmap
import os
import shutil
import sqlite3
import subprocess
import tempfile
from pathlib import Path

import pytest

from cachefs.stats import COUNTERS
from tests.conftest import CTL, wait_until

# These count the reads the daemon answers: FUSE passthrough reads never reach it.
pytestmark = [pytest.mark.fuse, pytest.mark.no_passthrough]

READS = ("read_ops", "read_bytes", "hit_ops", "hit_bytes", "miss_ops", "miss_bytes",
         "bypass_ops", "bypass_bytes", "backing_read_ops", "backing_read_bytes")


def _read_direct(path: Path, size: int, block: int = 65536) -> bytes:
    """Read through O_DIRECT so every read reaches the daemon (no page cache)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        out = bytearray()
        buf = mmap.mmap(-1, block)
        off = 0
        while off < size:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            out += buf[:n]
            off += n
        return bytes(out)
    finally:
        os.close(fd)


def _settled(m) -> dict:
    """Stats once background work (promotions, commits) has stopped moving counters."""
    last: list[dict] = []

    def still() -> bool:
        s = m.stats()
        same = bool(last) and all(s[k] == last[-1][k] for k in COUNTERS) \
            and s["metadata_pending"] == 0
        last.append(s)
        return same

    wait_until(still, 20, m.proc, "counters to settle")
    return last[-1]


def _saved(cache: Path) -> dict[str, int]:
    """The totals in the database, read from a copy of it and its WAL: the daemon holds the
    database locked while it runs (its WAL index is in its memory). A copy taken in the
    middle of a commit reads as the commit before, or as nothing yet."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("cachefs.db", "cachefs.db-wal"):
            if (cache / name).exists():
                shutil.copyfile(cache / name, Path(tmp, name))
        db = sqlite3.connect(Path(tmp, "cachefs.db"))
        try:
            rows = db.execute("SELECT key, value FROM meta WHERE key LIKE 'lifetime.%'"
                              ).fetchall()
        except sqlite3.DatabaseError:
            rows = []
        finally:
            db.close()
    return {k[len("lifetime."):]: float(v) if k == "lifetime.since" else int(v)
            for k, v in rows}


def _workload(m, files: dict[str, bytes], rounds: int) -> None:
    for _ in range(rounds):
        for name, data in files.items():
            assert _read_direct(m.path(name), len(data)) == data


def test_lifetime_totals_span_remounts(make_mount, mode):
    files = {f"f{i}": os.urandom(200_000 + 4096 * i) for i in range(3)}
    m = make_mount("--mode", mode, "--promote-after", "1")
    for name, data in files.items():
        (m.backing / name).write_bytes(data)
    m.path("w").write_bytes(b"w" * 70_000)
    _workload(m, files, 3)
    s1 = _settled(m)
    assert s1["hit_ops"] > 0 and s1["miss_ops"] > 0 and s1["write_ops"] > 0
    assert all(s1["lifetime"][k] == s1[k] for k in COUNTERS)       # the first mount
    since = s1["lifetime"]["since"]
    m.restart()

    s2_start = m.stats()
    for k in READS + ("write_ops", "write_bytes"):
        assert s2_start[k] == 0
        assert s2_start["lifetime"][k] == s1[k], k
    _workload(m, files, 2)
    s2 = _settled(m)
    assert s2["hit_ops"] > 0
    for k in READS + ("write_ops", "write_bytes", "promotions", "evictions"):
        assert s2["lifetime"][k] == s1[k] + s2[k], (k, s1[k], s2[k], s2["lifetime"][k])
    assert s2["lifetime"]["since"] == since
    lt = s2["lifetime"]
    assert lt["hit_ratio"] == round(lt["hit_ops"] / lt["read_ops"], 4)

    text = subprocess.run([*CTL, "stats", str(m.mnt)], capture_output=True, text=True,
                          timeout=30, check=True).stdout
    assert "lifetime" in text and f"{lt['read_ops']} ops" in text

    m.stop()
    saved = _saved(m.cache)                                   # unmount saved the totals
    for k in READS:
        assert saved[k] == s2["lifetime"][k], k


def test_lifetime_totals_after_kill9(make_mount, mode):
    files = {"a": os.urandom(300_000)}
    m = make_mount("--mode", mode, "--promote-after", "1")
    (m.backing / "a").write_bytes(files["a"])
    _workload(m, files, 3)
    s1 = _settled(m)
    # the saver runs every commit interval (1 s): wait for it to record these reads
    wait_until(lambda: _saved(m.cache).get("read_ops") == s1["read_ops"], 15, m.proc,
               "the lifetime totals to be saved")
    m.kill()
    m.start()
    s2_start = m.stats()
    for k in READS:
        assert s2_start["lifetime"][k] == s1[k], k
    _workload(m, files, 1)
    s2 = _settled(m)
    m.kill()                                  # before or after the next save: at most an
    m.start()                                 # interval of counts is lost
    lt = m.stats()["lifetime"]
    for k in READS:
        assert s1[k] <= lt[k] <= s1[k] + s2[k], (k, s1[k], s2[k], lt[k])
