"""Linux AIO writes (cachefs/aio.py): aligned writes go through io_submit on an O_DIRECT fd,
the rest through pwrite; the bytes land either way."""

import os
import random

import pytest

from cachefs import aio


@pytest.mark.parametrize("use_direct", [True, False])
def test_pwrite_all_writes_every_byte(tmp_path, use_direct):
    path = tmp_path / "f"
    path.write_bytes(bytes(1 << 20))
    fd = os.open(path, os.O_RDWR)
    direct = aio.open_direct(fd) if use_direct else -1
    if use_direct and direct < 0:
        pytest.skip("no O_DIRECT on this filesystem")
    rng = random.Random(3)
    model = bytearray(1 << 20)
    items = []
    for _ in range(60):                      # aligned and unaligned, more than MAX_INFLIGHT
        if rng.random() < 0.7:
            off, size = rng.randrange(0, 200) * 4096, rng.choice([4096, 8192, 65536])
        else:
            off, size = rng.randrange(0, 900_000), rng.randrange(1, 5000)
        data = os.urandom(size)
        items.append((data, off))
        model[off:off + size] = data
    # no two items overlap in time order issues: apply them in order, as pwrite_all may not
    for data, off in items:
        aio.pwrite_all(fd, direct, [(data, off)])
    assert path.read_bytes()[:len(model)] == bytes(model)
    # a batch of non-overlapping aligned writes submitted together
    batch = [(os.urandom(4096), i * 8192) for i in range(40)]
    aio.pwrite_all(fd, direct, batch)
    got = path.read_bytes()
    assert all(got[o:o + 4096] == d for d, o in batch)
    os.close(fd)
    if direct >= 0:
        os.close(direct)


def test_aligned_slices_of_a_writable_buffer_are_written_in_place(tmp_path):
    """A destage pass reads into one page-aligned mmap and writes its slices as they are;
    anything else (bytes, a slice off the page boundary) goes through an aligned copy."""
    import mmap
    buf = mmap.mmap(-1, 3 * 4096)
    view = memoryview(buf)
    keep = []
    assert aio._aligned_address(view[4096:8192], keep) == \
        aio._aligned_address(view, []) + 4096                   # no copy: the slice itself
    copied = aio._aligned_address(view[100:4196], keep)
    assert copied % aio.ALIGN == 0 and copied != aio._aligned_address(view, []) + 100
    assert aio._aligned_address(b"x" * 4096, keep) % aio.ALIGN == 0
    keep.clear()
    del view
    buf.close()                   # no export of the buffer outlives the write


def test_destage_io_writes_runs_and_zeros_past_the_cache_file_end(tmp_path):
    """_destage_io copies the runs from the cache file to BACKING through one aligned buffer;
    a run past the cache file's end (a file extended by a hole) goes out as zeros, and a
    block failing its checksum is left out."""
    from cachefs.integrity import block_sum
    from cachefs.writeback import _destage_io
    cache = tmp_path / "cache"
    backing = tmp_path / "backing"
    body = os.urandom(5 * 4096 + 300)
    cache.write_bytes(body)
    backing.write_bytes(b"\xee" * (9 * 4096))
    runs = [(0, 2 * 4096), (3 * 4096, 2 * 4096 + 300), (7 * 4096, 2 * 4096)]
    sums = {o: block_sum(body[o:o + 4096]) for o in (0, 4096, 3 * 4096)}
    sums[4096] ^= 1                                   # the SSD "damaged" block 1
    fd = os.open(backing, os.O_RDWR)
    try:
        _, damaged = _destage_io(fd, os.open(cache, os.O_RDONLY), runs, sums)  # closes it
    finally:
        os.close(fd)
    got = backing.read_bytes()
    assert damaged == [4096]
    assert got[:4096] == body[:4096]
    assert got[4096:2 * 4096] == b"\xee" * 4096        # left out: BACKING keeps its bytes
    assert got[2 * 4096:3 * 4096] == b"\xee" * 4096    # not in a run
    assert got[3 * 4096:5 * 4096 + 300] == body[3 * 4096:]
    assert got[5 * 4096 + 300:7 * 4096] == b"\xee" * (2 * 4096 - 300)
    assert got[7 * 4096:] == bytes(2 * 4096)           # past the cache file's end: zeros


def _aio_contexts() -> int:
    with open("/proc/self/maps") as f:
        return sum("[aio]" in line for line in f)


def test_failed_writes_do_not_leak_aio_contexts(tmp_path):
    """Each failed AIO batch gave up its thread's context without io_destroy: a BACKING
    failing destages for hours used up the system's fs.aio-max-nr (AIO then failed for every
    process). A failure whose events all came back keeps the context."""
    path = tmp_path / "f"
    path.write_bytes(bytes(1 << 16))
    ro = os.open(path, os.O_RDONLY)
    try:                                         # read-only: every write fails (EBADF)
        direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        os.close(ro)
        pytest.skip("no O_DIRECT on this filesystem")
    try:
        before = _aio_contexts()
        for _ in range(20):
            with pytest.raises(OSError):
                aio.pwrite_all(ro, direct, [(bytes(4096), 0), (bytes(4096), 8192)])
        assert _aio_contexts() <= before + 1
    finally:
        os.close(direct)
        os.close(ro)


def test_no_aio_context_to_be_had_falls_back_to_pwrite(tmp_path, monkeypatch):
    """io_setup failing (EAGAIN once fs.aio-max-nr is used up) must not fail the writes."""
    path = tmp_path / "f"
    path.write_bytes(bytes(1 << 16))
    fd = os.open(path, os.O_RDWR)
    direct = aio.open_direct(fd)
    if direct < 0:
        pytest.skip("no O_DIRECT on this filesystem")

    def no_context():
        raise aio.NoContext(11, "io_setup failed")

    monkeypatch.setattr(aio, "_context", no_context)
    try:
        aio.pwrite_all(fd, direct, [(b"\x07" * 4096, 4096)])
        assert path.read_bytes()[4096:8192] == b"\x07" * 4096
    finally:
        os.close(direct)
        os.close(fd)
