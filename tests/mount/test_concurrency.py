"""Concurrent readers and a writer on the same extents over a slow BACKING: promotions that
race with writes and truncates must never leave old bytes in the cache."""

import os
import random
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from slowfs_client import mounted_slowfs  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.slow]
SIZE = 256 * 1024


def test_reads_racing_writes_and_truncates_never_leave_stale_cache(make_mount, tmp_path,
                                                                   mode):
    src, slow = tmp_path / "src", tmp_path / "slow"
    src.mkdir()
    slow.mkdir()
    model = bytearray(os.urandom(SIZE))
    (src / "f").write_bytes(model)
    with mounted_slowfs(src, slow, latency_ms=1, jitter_ms=1, seq_latency_ms=1) as _:
        m = make_mount("--mode", mode, "--promote-after", "1", "--sequential-cutoff", "0",
                       "--attr-timeout", "0.2", backing=slow)
        stop = threading.Event()
        errors = []

        def reader(seed):
            rng = random.Random(seed)
            fd = os.open(m.path("f"), os.O_RDONLY | os.O_DIRECT)
            try:
                while not stop.is_set():
                    os.pread(fd, 4096, rng.randrange(0, SIZE // 4096) * 4096)
            except OSError as exc:
                errors.append(exc)
            finally:
                os.close(fd)

        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        rng = random.Random(5)
        fd = os.open(m.path("f"), os.O_RDWR | os.O_DIRECT)
        try:
            for i in range(400):
                if i % 50 == 49:
                    size = rng.randrange(SIZE // 2, SIZE)
                    os.ftruncate(fd, size)
                    del model[size:]
                    os.ftruncate(fd, SIZE)                   # grow back: zeros
                    model.extend(bytes(SIZE - size))
                    continue
                off = rng.randrange(0, SIZE - 200)
                chunk = os.urandom(rng.randrange(1, 200))
                os.pwrite(fd, chunk, off)
                model[off:off + len(chunk)] = chunk
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors
        got = b"".join(os.pread(fd, 4096, off) for off in range(0, SIZE, 4096))
        os.close(fd)
        assert len(got) == SIZE
        assert got == bytes(model), next(i for i in range(SIZE) if got[i] != model[i])
        assert m.stats()["hit_ops"] > 0
        m.stop()
