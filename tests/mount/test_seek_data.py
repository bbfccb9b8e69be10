"""lseek(2) SEEK_DATA and SEEK_HOLE through cachefs: where BACKING has data and holes, and in
write-back dirty blocks too (BACKING may still have a hole there), within the logical size.
Every answer (an offset, or ENXIO) at every 4 KiB boundary and a few unaligned offsets is
compared with a plain ext4 file that had the same writes. Needs a pyfuse3 with
deps/passthrough's lseek patch (without it the kernel treats files as all data, as
documented)."""

from __future__ import annotations

import errno
import os

import pytest

from tests.conftest import ctl_flush

pytestmark = pytest.mark.fuse

KiB = 1024
MiB = 1 << 20


def _lseek_patched() -> bool:
    try:
        import pyfuse3
    except ImportError:
        return False
    return hasattr(pyfuse3.Operations, "lseek")


def answers(path) -> list:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        out = []
        for off in [*range(0, size + 8 * KiB, 4 * KiB), 1, 5000, size - 1, size]:
            for whence in (os.SEEK_DATA, os.SEEK_HOLE):
                try:
                    out.append((off, whence, os.lseek(fd, off, whence)))
                except OSError as exc:
                    out.append((off, whence, errno.errorcode[exc.errno]))
        return out
    finally:
        os.close(fd)


def make_sparse(path) -> None:
    """Data [0, 64K), a hole to 1M, data [1M, 1M + 4K), a hole to 2M (the end)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, os.urandom(64 * KiB), 0)
        os.pwrite(fd, os.urandom(4 * KiB), MiB)
        os.ftruncate(fd, 2 * MiB)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_through(path, writes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        for off, n in writes:
            os.pwrite(fd, b"\xab" * n, off)
    finally:
        os.close(fd)


@pytest.mark.skipif(not _lseek_patched(), reason="pyfuse3 without the lseek patch")
def test_seek_data_and_hole_match_a_plain_file(make_mount, tmp_path, mode):
    m = make_mount("--mode", mode, "--max-dirty-age", "300")
    ref = tmp_path / "ref"
    make_sparse(ref)
    make_sparse(m.backing / "f")
    assert answers(m.path("f")) == answers(ref), "BACKING's holes"
    # data into a hole, at the end of a data run, and past the end (the file grows)
    writes = [(512 * KiB, 8 * KiB), (64 * KiB, 4 * KiB), (3 * MiB, 4 * KiB)]
    write_through(ref, writes)
    write_through(m.path("f"), writes)
    if mode == "write-back":
        assert m.stats()["dirty_bytes"], "the writes should still be dirty"
    assert answers(m.path("f")) == answers(ref), "after writes"
    if mode == "write-back":
        ctl_flush(m)
    assert answers(m.path("f")) == answers(ref), "after the flush"
    assert answers(m.backing / "f") == answers(ref), "BACKING after the flush"


@pytest.mark.skipif(not _lseek_patched(), reason="pyfuse3 without the lseek patch: the "
                    "kernel answers SEEK_DATA/SEEK_HOLE itself")
def test_seeks_racing_a_shrinking_truncate_are_no_backing_failure(make_mount):
    """BACKING's lseek answers ENXIO when the file shrank between cachefs's stat and its
    lseek: the program's answer, as on ext4. It was counted as a failing BACKING (ENXIO is
    also what a device gone says): thousands of `backing_errors` and WARNING lines in a few
    seconds, and `stats` reported BACKING health failing (found by a helper's race hunt)."""
    import multiprocessing as mp
    import random
    import time

    m = make_mount()
    path = str(m.path("f"))
    with open(path, "wb") as f:
        f.write(b"a" * (8 * MiB))

    def truncater(stop):
        rng = random.Random(1)
        while not stop.is_set():
            os.truncate(path, rng.choice([4 * KiB, 8 * MiB]))

    stop = mp.Event()
    proc = mp.Process(target=truncater, args=(stop,))
    proc.start()
    rng = random.Random(2)
    fd = os.open(path, os.O_RDONLY)
    seeks = 0
    try:
        end = time.monotonic() + 3
        while time.monotonic() < end:
            try:
                os.lseek(fd, rng.randrange(0, 8 * MiB), rng.choice([os.SEEK_DATA, os.SEEK_HOLE]))
            except OSError as exc:
                assert exc.errno == errno.ENXIO
            seeks += 1
    finally:
        stop.set()
        proc.join(timeout=30)
        os.close(fd)
    assert seeks > 1000
    s = m.stats()
    assert s["backing_errors"] == 0, s["backing_errors"]
    assert s["backing_health"]["state"] == "ok"
