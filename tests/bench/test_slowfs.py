"""The slow-BACKING emulator (bench/slowfs.py) on real FUSE mounts under tmp_path."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import slowfs_client  # noqa: E402
from slowfs_client import mounted_slowfs  # noqa: E402

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.skipif(not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
                       reason="FUSE is unusable here (/dev/fuse or fusermount3 missing)"),
]

FAST = dict(latency_ms=0, jitter_ms=0, seq_latency_ms=0, meta_latency_ms=0, bandwidth_mbs=0)
MiB = 1 << 20


def make_dirs(tmp_path: Path) -> tuple[Path, Path]:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    return src, mnt


def wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def direct_pread(path: Path, off: int, size: int = 4096) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, size)                 # page-aligned, as O_DIRECT wants
        n = os.preadv(fd, [buf], off)
        return bytes(buf[:n])
    finally:
        os.close(fd)


def test_bytes_and_counters(tmp_path):
    src, mnt = make_dirs(tmp_path)
    data = os.urandom(MiB)
    (src / "f").write_bytes(data)
    with mounted_slowfs(src, mnt, log_path=str(tmp_path / "slowfs.log"), **FAST) as m:
        assert (mnt / "f").read_bytes() == data
        m.reset()
        assert m.stats()["read_ops"] == 0
        fd = os.open(mnt / "f", os.O_RDWR)
        try:
            for off in (0, 3 * 65536, 7 * 65536, 15 * 65536):
                assert os.pread(fd, 65536, off) == data[off:off + 65536]
            payload = os.urandom(8192)
            for i in range(3):
                assert os.pwrite(fd, payload, MiB + i * 8192) == 8192
            os.fsync(fd)
        finally:
            os.close(fd)
        s = m.stats()
        assert s["read_ops"] == 4 and s["read_bytes"] == 4 * 65536
        assert s["write_ops"] == 3 and s["write_bytes"] == 3 * 8192
        assert s["fsync_ops"] == 1
        assert s["meta_ops"] >= 1
        assert s["errors_injected"] == 0
        assert (src / "f").read_bytes() == data + payload * 3

        # Namespace operations reach SOURCE, including a directory rename.
        (mnt / "d" / "sub").mkdir(parents=True)
        (mnt / "d" / "sub" / "x").write_bytes(b"hello")
        (mnt / "d").rename(mnt / "e")
        assert (mnt / "e" / "sub" / "x").read_bytes() == b"hello"
        assert (src / "e" / "sub" / "x").read_bytes() == b"hello"
        os.symlink("sub/x", mnt / "e" / "link")
        assert (mnt / "e" / "link").read_bytes() == b"hello"
        os.truncate(mnt / "e" / "sub" / "x", 2)
        assert (src / "e" / "sub" / "x").read_bytes() == b"he"
        shutil.rmtree(mnt / "e")
        assert sorted(os.listdir(mnt)) == ["f"]
    assert m.proc.returncode == 0, m.log()       # clean exit after fusermount3 -u
    assert "Traceback" not in m.log()


def test_an_unlinked_open_file_stays_writable_with_its_xattrs(tmp_path):
    """Writes to a file unlinked while open failed with ESTALE: the kernel asks for its
    security.capability before each write, and slowfs looked xattrs up by path only."""
    src, mnt = make_dirs(tmp_path)
    with mounted_slowfs(src, mnt, **FAST):
        fd = os.open(mnt / "u", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.setxattr(mnt / "u", "user.k", b"v")
            os.unlink(mnt / "u")
            assert os.write(fd, b"x" * 8192) == 8192
            assert os.getxattr(fd, "user.k") == b"v"
            assert os.fstat(fd).st_nlink == 0
            assert os.pread(fd, 8192, 0) == b"x" * 8192
        finally:
            os.close(fd)


def test_latency_is_charged(tmp_path):
    src, mnt = make_dirs(tmp_path)
    (src / "f").write_bytes(os.urandom(4 * MiB))
    with mounted_slowfs(src, mnt, latency_ms=20, jitter_ms=0, seed=1) as m:
        rng = random.Random(7)
        offsets = rng.sample(range(0, 4 * MiB, 4096), 6)
        direct_pread(mnt / "f", offsets[0])   # lookup/open warm-up
        m.reset()
        for off in offsets[1:]:
            t0 = time.monotonic()
            assert len(direct_pread(mnt / "f", off)) == 4096
            took = time.monotonic() - t0
            assert 0.019 <= took < 2.0, f"4k random read took {took * 1000:.1f} ms"
        s = m.stats()
        assert s["read_ops"] == 5 and s["random_ops"] == 5
        assert s["busy_s"] >= 5 * 0.019


def test_eio_fault_and_recovery(tmp_path):
    src, mnt = make_dirs(tmp_path)
    data = os.urandom(65536)
    (src / "f").write_bytes(data)
    with mounted_slowfs(src, mnt, **FAST) as m:
        m.set(eio=1)
        with pytest.raises(OSError) as exc:
            direct_pread(mnt / "f", 0)
        assert exc.value.errno == errno.EIO
        assert m.stats()["errors_injected"] >= 1
        m.set(eio=0)
        assert direct_pread(mnt / "f", 4096) == data[4096:8192]


def test_offline_keeps_control_channel(tmp_path):
    src, mnt = make_dirs(tmp_path)
    (src / "f").write_bytes(b"x" * 4096)
    with mounted_slowfs(src, mnt, **FAST) as m:
        m.set(offline=1)
        with pytest.raises(OSError) as exc:
            (mnt / "g").write_bytes(b"y")
        assert exc.value.errno == errno.EIO
        assert m.stats()["params"]["offline"] == 1
        m.set(offline=0)
        assert (mnt / "f").read_bytes() == b"x" * 4096


def test_hang_then_unhang(tmp_path):
    src, mnt = make_dirs(tmp_path)
    data = os.urandom(65536)
    (src / "f").write_bytes(data)
    with mounted_slowfs(src, mnt, **FAST) as m:
        fd = os.open(mnt / "f", os.O_RDONLY)
        result: list = []
        try:
            m.set(hang=1)
            reader = threading.Thread(target=lambda: result.append(os.pread(fd, 4096, 8192)),
                                      daemon=True)
            reader.start()
            wait_until(lambda: m.stats()["hung"] == 1)    # control works while hung
            assert reader.is_alive() and not result
            m.set(hang=0)
            reader.join(timeout=10)
            assert not reader.is_alive()
            assert result == [data[8192:12288]]
            assert m.stats()["hung"] == 0
        finally:
            slowfs_client.set(mnt, hang=0)
            os.close(fd)


def test_cli_stats_set_reset(tmp_path):
    src, mnt = make_dirs(tmp_path)
    with mounted_slowfs(src, mnt, **FAST) as m:
        cli = [sys.executable, str(BENCH / "slowfs.py")]
        run = subprocess.run(cli + ["set", str(mnt), "latency_ms=3", "concurrency=2"],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        out = subprocess.run(cli + ["stats", str(mnt)], capture_output=True, text=True,
                             check=True).stdout
        params = json.loads(out)["params"]
        assert params["latency_ms"] == 3 and params["concurrency"] == 2
        bad = subprocess.run(cli + ["set", str(mnt), "latency_ms=fast"],
                             capture_output=True, text=True)
        assert bad.returncode == 2
        assert "Traceback" not in bad.stderr and "latency_ms" in bad.stderr
        (mnt / "f").write_bytes(b"abc")
        assert m.stats()["write_ops"] >= 1
        subprocess.run(cli + ["reset", str(mnt)], check=True)
        assert m.stats()["write_ops"] == 0
        # The control names never reach SOURCE and are not listed.
        assert not any(n.startswith("user.slowfs.") for n in os.listxattr(mnt))
        assert not any(n.startswith("user.slowfs.") for n in os.listxattr(src))


def test_detached_mount_and_bad_input(tmp_path):
    src, mnt = make_dirs(tmp_path)
    cli = [sys.executable, str(BENCH / "slowfs.py")]
    missing = subprocess.run(cli + ["mount", str(tmp_path / "nope"), str(mnt)],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    run = subprocess.run(cli + ["mount", "--log", str(tmp_path / "d.log"), str(src), str(mnt)],
                         capture_output=True, text=True, timeout=30)
    pid = None
    try:
        assert run.returncode == 0, run.stderr
        assert os.path.ismount(mnt)
        pid = slowfs_client.stats(mnt)["pid"]
    finally:
        slowfs_client.unmount(mnt)
        if pid is not None:
            wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout_s=20)
    assert not slowfs_client.is_mounted(mnt)
